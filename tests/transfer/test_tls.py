"""Mutual TLS: certificates from `init_certs`, a good client works, others are rejected."""

from __future__ import annotations

import os
import socket
import ssl
from pathlib import Path

import pytest

from pdx.errors import InputError
from pdx.tls import TLSConfig, channel_credentials, init_certs
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d)
    return d


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("other")
    init_certs(d, ["decode"])
    return d


def test_init_certs_writes_ca_and_identities(certs: Path) -> None:
    from cryptography import x509

    names = sorted(p.name for p in certs.iterdir())
    assert names == sorted(
        ["ca.pem"]
        + [f"{n}.{e}" for n in ("kv-store", "prefill", "decode", "gateway") for e in ("pem", "key")]
    )
    assert (certs.parent / f"{certs.name}.ca-key" / "ca.key").is_file()
    assert (certs / "decode.key").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate((certs / "decode.pem").read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "decode"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
    with pytest.raises(InputError):
        init_certs(certs)  # refuses to overwrite an existing CA


async def test_mtls_roundtrip_audits_certificate_identity(
    certs, kv_server_factory, kv_client_cfg
) -> None:
    server, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    data = os.urandom(500_000)
    async with KVClient(
        target, kv_client_cfg(), tls=TLSConfig(cert_dir=certs, name="decode")
    ) as kv:
        kv_id = await kv.put(data)
        assert bytes((await kv.get(kv_id)).data) == data
    assert server.audit.records(event="get", kv_id=kv_id)[0]["who"] == "cn=decode"


async def _rejected(target: str, creds, kv_client_cfg, audit) -> KVError:
    async with KVClient(
        target,
        kv_client_cfg(kv_retry_budget=0, kv_transfer_timeout_ms=3000),
        credentials=creds,
        audit=audit,
    ) as kv:
        with pytest.raises(KVError) as err:
            await kv.put(b"secret" * 1000)
    return err.value


async def test_client_without_certificate_is_rejected(
    certs, kv_server_factory, kv_client_cfg, kv_audit
) -> None:
    server, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    err = await _rejected(
        target, channel_credentials(None, cert_dir=certs), kv_client_cfg, kv_audit
    )
    assert err.code is KVErrorCode.KV_UNAVAILABLE  # the TLS handshake fails: no RPC ever runs
    assert len(server.store) == 0 and not server.audit.records(event="put")
    # The store never sees a rejected handshake, so the record is the client's own.
    assert kv_audit.records(event="put", side="client", outcome="KV_UNAVAILABLE")


async def test_client_with_foreign_ca_certificate_is_rejected(
    certs, other_ca, kv_server_factory, kv_client_cfg, kv_audit
) -> None:
    import grpc

    server, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(other_ca / "decode.key").read_bytes(),
        certificate_chain=(other_ca / "decode.pem").read_bytes(),
    )
    err = await _rejected(target, creds, kv_client_cfg, kv_audit)
    assert err.code is KVErrorCode.KV_UNAVAILABLE
    assert len(server.store) == 0
    assert kv_audit.records(event="put", outcome="KV_UNAVAILABLE")


async def test_plaintext_client_is_rejected(
    certs, kv_server_factory, kv_client_cfg, kv_audit
) -> None:
    _, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    err = await _rejected(target, None, kv_client_cfg, kv_audit)
    assert err.code is KVErrorCode.KV_UNAVAILABLE


async def test_server_negotiates_tls13_and_demands_a_client_cert(certs, kv_server_factory) -> None:
    _, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    host, port = target.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.set_alpn_protocols(["h2"])
    ctx.load_cert_chain(certs / "decode.pem", certs / "decode.key")
    import asyncio

    def handshake() -> str | None:
        with (
            socket.create_connection((host, int(port)), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            return tls.version()

    assert await asyncio.to_thread(handshake) == "TLSv1.3"
    # A client that speaks TLS 1.2 at most finds no cipher suite in common (pdx leaves TLS 1.2
    # none on gRPC ports): refused at the handshake.
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.to_thread(handshake)
