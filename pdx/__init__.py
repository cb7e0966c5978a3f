"""pdx: prefill/decode disaggregation across datacenters, measured and proven."""

__version__ = "0.1.0"
