"""The load pdx ships: a Locust user for OpenAI-compatible streaming endpoints.

``locustfile.py`` is what ``pdx accept`` hands to ``python -m locust -f`` (and what
``loadtests/locustfile.py`` loads for people running Locust by hand); ``llm_stream.py`` streams
and times one completion without Locust or gevent. Nothing here is imported by the rest of pdx:
Locust runs as a subprocess.
"""

from pathlib import Path

__all__ = ["LOCUSTFILE"]

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
