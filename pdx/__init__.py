"""pdx: prefill/decode disaggregation across datacenters, measured and proven.

The packages follow the workflow: ``kv`` (``pdx measure-kv``), ``link`` (``pdx probe-server`` /
``probe-link``), ``transfer`` (the KV contract, ``pdx kv-bench``), ``serving`` (``pdx deploy``),
``faults`` (``pdx faults``), ``accept`` (``pdx accept``), ``sim`` (``pdx simulate``) and ``cli``
over them; docs/architecture.md draws the layers.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
