"""KV cache sizing for ``pdx measure-kv``: specs per attention family, empirical measurement,
codecs, bandwidth budget.

Public modules: ``spec`` (KV bytes per token of a model), ``source`` (where a model's config
comes from), ``engines`` (what an engine's connector moves), ``budget`` (link budget),
``report`` / ``render`` (measure-kv's result and its table), ``codecs`` (KV codecs).
"""

__all__ = ["budget", "codecs", "engines", "render", "report", "source", "spec"]
