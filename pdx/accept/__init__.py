"""Acceptance: playbook schema, orchestration, criteria, reports."""
