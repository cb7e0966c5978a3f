"""Serving for ``pdx deploy``: prefill, decode, router, gateway, supervisor, backends, engines.

Public modules: ``deploy_config`` (the validated deploy config), ``supervisor`` (starting and
watching a deployment), ``k8s`` (manifests), ``backends`` (model backends and presets).
"""

__all__ = ["backends", "deploy_config", "k8s", "supervisor"]
