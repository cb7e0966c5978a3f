"""pdx: prefill/decode disaggregation across datacenters, measured and proven.

The packages follow the workflow: ``kv`` (``pdx measure-kv``), ``link`` (``pdx probe-server`` /
``probe-link``), ``transfer`` (the KV contract, ``pdx kv-bench``), ``serving`` (``pdx deploy``),
``faults`` (``pdx faults``), ``accept`` (``pdx accept``), ``sim`` (``pdx simulate``) and ``cli``
over them; docs/architecture.md draws the layers.
"""

import os
import sys

__all__ = ["GRPC_IMPORTED_FIRST", "GRPC_TLS12_SUITES", "__version__"]

__version__ = "0.1.0"

#: gRPC's TLS ports accept TLS 1.3 only. gRPC Python has no setting for a minimum TLS version;
#: its TLS 1.2 cipher suites come from ``GRPC_SSL_CIPHER_SUITES``, which gRPC reads once, when
#: it is imported. pdx names one pre-shared-key suite there: no pdx peer holds a pre-shared key,
#: so a TLS 1.2 handshake finds no cipher in common and fails, while TLS 1.3, whose suites
#: BoringSSL fixes, is unaffected. Set here, before any pdx module imports grpc; a value you
#: set yourself wins (and ``pdx.tls.tls12_refused`` then says TLS 1.2 is accepted).
GRPC_TLS12_SUITES = "PSK-AES128-CBC-SHA"
#: grpc was imported before pdx (a program of yours): its TLS 1.2 suites are already fixed
GRPC_IMPORTED_FIRST = "grpc" in sys.modules
os.environ.setdefault("GRPC_SSL_CIPHER_SUITES", GRPC_TLS12_SUITES)
