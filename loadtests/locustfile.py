"""``locust -f loadtests/locustfile.py``: the Locust user pdx ships, from the installed package.

The user, its ``--pdx-*`` options and its per-request records live in
``pdx/accept/load/traffic/locustfile.py`` (what ``pdx accept`` runs); see its docstring.
"""

from pdx.accept.load.traffic.locustfile import CompletionUser

__all__ = ["CompletionUser"]
