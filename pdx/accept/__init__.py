"""Acceptance for ``pdx accept``: a playbook run as stages, each a sub-package.

``playbook`` (the schema every stage reads a section of) and ``run`` (one run: the stages in
order), then the stages: ``target`` (the system under test and its link conditions),
``preflight`` (the model's KV and the link, measured first), ``load`` (warm-up, Locust, what is
read while it runs), ``judge`` (statistics, confidence, criteria, gates, link verdict, baseline,
repeats), ``search`` (``--search``: the limit of one parameter), ``predict`` (the simulator
beside the measurement, recommendations) and ``report`` (report.json, Markdown, HTML, plots,
diff, the terminal view).
"""

__all__ = ["judge", "load", "playbook", "predict", "preflight", "report", "run", "search", "target"]
