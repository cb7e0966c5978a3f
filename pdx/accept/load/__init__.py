"""Stage 3: the load on the target and what is read while it runs.

``warmup`` (requests before the first measured step), ``locust`` (Locust as a subprocess: its
command line, its run, its CSV), ``traffic`` (the Locust user pdx ships: this package's
subprocesses import it, pdx itself never does), ``metrics`` (the target's /metrics, scraped
before and after each step), ``resources`` (CPU and memory of the processes under test).
Nothing is imported here, so Locust's gevent-patched process loads only ``traffic``.
"""

__all__ = ["locust", "metrics", "resources", "section", "traffic", "warmup"]
