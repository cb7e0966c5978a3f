"""Acceptance for ``pdx accept``: playbook schema, orchestration, criteria, reports.

Public modules: ``playbook`` (the schema), ``run`` (one run of a playbook), ``repeat``
(``--repeat``), ``report`` (report.json, Markdown, HTML, diff), ``show`` (reading a report
back), ``traffic`` (the Locust user a run drives).
"""

__all__ = ["playbook", "repeat", "report", "run", "show", "traffic"]
