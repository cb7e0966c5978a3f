"""Stage 2: what the run relies on, measured before any load: the KV of the deployed model
(``kv``: measure-kv on the deploy's own model) and the link it crosses (``probe``: probe-link
over the deploy's KV link, judged against the run's KV demand).
"""

__all__ = ["kv", "probe"]
