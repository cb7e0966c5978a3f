"""Certificates and mutual-TLS credentials: the one TLS module every pdx server and client uses.

``init_certs(dir)`` writes a private CA and one key + certificate per service
(``ca.pem``, ``<name>.pem``, ``<name>.key``), for local and test use, with
``cryptography``. Every certificate is valid for both server and client auth and for
localhost / 127.0.0.1 / ::1. Servers require a client certificate signed by the CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from pdx.errors import InputError

if TYPE_CHECKING:
    import grpc
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509 import Certificate

DEFAULT_NAMES = ("kv-store", "prefill", "decode", "gateway")  # every identity a deploy uses
CA_NAME = "ca"


class TLSConfig(BaseModel):
    """Mutual TLS: a directory made by ``pdx certs init`` and this service's name in it."""

    model_config = ConfigDict(extra="forbid")

    cert_dir: Path
    name: str = Field(min_length=1)


class TLSSettings(BaseModel):
    """Whether a deployment's services talk mutual TLS, and where their certificates are (the
    deploy config's ``tls:``). Without ``dir``, ``pdx deploy`` generates certificates; each
    service's identity in that directory is a :class:`TLSConfig` (:func:`tls_for`).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    dir: Path | None = Field(None, description="directory made by `pdx certs init`")


def tls_for(cert_dir: Path | None, name: str) -> TLSConfig | None:
    """Service ``name``'s mutual-TLS identity in ``cert_dir``, or None when TLS is off."""
    return TLSConfig(cert_dir=cert_dir, name=name) if cert_dir is not None else None


@dataclass(frozen=True)
class CertFiles:
    """Paths of one service's identity."""

    ca: Path
    cert: Path
    key: Path


def cert_files(cert_dir: Path | str, name: str) -> CertFiles:
    """Where ``name``'s certificate and key live in ``cert_dir`` (checked to exist)."""
    d = Path(cert_dir)
    files = CertFiles(d / f"{CA_NAME}.pem", d / f"{name}.pem", d / f"{name}.key")
    for path in (files.ca, files.cert, files.key):
        if not path.is_file():
            raise InputError("tls", str(path), f"a file made by `pdx certs init {d}`")
    return files


def _name(common_name: str) -> object:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdx"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _write_cert(path: Path, cert: Certificate) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = dt.datetime.now(dt.UTC)
    name = _name("pdx local CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)  # type: ignore[arg-type]
        .issuer_name(name)  # type: ignore[arg-type]
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san_entry(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _make_leaf(
    name: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: Certificate, days: int,
    hosts: tuple[str, ...] = (),
) -> tuple[ec.EllipticCurvePrivateKey, Certificate]:  # fmt: skip
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = dt.datetime.now(dt.UTC)
    san = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.DNSName(name),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            *(_san_entry(h) for h in hosts),
        ]
    )
    eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))  # type: ignore[arg-type]
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(san, critical=False)
        .add_extension(eku, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def init_certs(
    cert_dir: Path | str,
    names: tuple[str, ...] | list[str] = DEFAULT_NAMES,
    *,
    days: int = 30,
    hosts: tuple[str, ...] | list[str] = (),
) -> list[Path]:
    """Create a CA and one identity per name in ``cert_dir``; return the files written.

    Every certificate is valid for localhost, 127.0.0.1, ::1, its own name and ``hosts``
    (addresses or DNS names other sites dial, e.g. a store's address in another namespace).
    The CA's private key goes to :func:`ca_key_dir` (``DIR.ca-key/``), never into the
    directory handed to services: they get the CA certificate and their own key only.
    """
    d = Path(cert_dir)
    if d.exists() and (d / f"{CA_NAME}.pem").exists():
        raise InputError(
            "DIR", str(d), "a directory without an existing ca.pem (refusing to overwrite)"
        )
    for n in names:
        if not n or "/" in n or n == CA_NAME:
            raise InputError("--name", n, f"a plain service name other than {CA_NAME!r}")
    d.mkdir(parents=True, exist_ok=True)
    keys = ca_key_dir(d)
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca(days)
    written = [d / f"{CA_NAME}.pem", keys / f"{CA_NAME}.key"]
    _write_cert(written[0], ca_cert)
    _write_key(written[1], ca_key)
    for n in names:
        key, cert = _make_leaf(n, ca_key, ca_cert, days, tuple(hosts))
        _write_cert(d / f"{n}.pem", cert)
        _write_key(d / f"{n}.key", key)
        written += [d / f"{n}.pem", d / f"{n}.key"]
    return written


def ca_key_dir(cert_dir: Path | str) -> Path:
    """Where :func:`init_certs` keeps the CA's private key: a sibling of ``cert_dir``."""
    d = Path(cert_dir)
    return d.parent / f"{d.name}.ca-key"


def tls12_refused() -> bool:
    """Whether gRPC's TLS ports refuse TLS 1.2 in this process (see ``pdx.GRPC_TLS12_SUITES``)."""
    from pdx import GRPC_IMPORTED_FIRST, GRPC_TLS12_SUITES

    return os.environ.get("GRPC_SSL_CIPHER_SUITES") == GRPC_TLS12_SUITES and not GRPC_IMPORTED_FIRST


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server side of mutual TLS: present ``tls.name``'s cert, require a CA-signed client;
    TLS 1.3 only unless ``GRPC_SSL_CIPHER_SUITES`` was set to something else (a warning)."""
    import logging

    import grpc

    from pdx import GRPC_IMPORTED_FIRST

    if not tls12_refused():
        logging.getLogger("pdx.tls").warning(
            "this gRPC port accepts TLS 1.2 too: GRPC_SSL_CIPHER_SUITES is %r%s (pdx's "
            "default leaves TLS 1.2 no cipher suite, so only TLS 1.3 connects)",
            os.environ.get("GRPC_SSL_CIPHER_SUITES"),
            " (grpc was imported before pdx)" if GRPC_IMPORTED_FIRST else "",
        )
    f = cert_files(tls.cert_dir, tls.name)
    return grpc.ssl_server_credentials(
        [(f.key.read_bytes(), f.cert.read_bytes())],
        root_certificates=f.ca.read_bytes(),
        require_client_auth=True,
    )


def channel_credentials(
    tls: TLSConfig | None, *, cert_dir: Path | None = None
) -> grpc.ChannelCredentials:
    """Client side: trust the CA and present ``tls.name``'s certificate.

    ``tls=None`` with ``cert_dir`` gives a client that trusts the CA but has no
    certificate of its own (what an unauthorised peer looks like).
    """
    import grpc

    if tls is None:
        if cert_dir is None:
            raise InputError("tls", None, "a TLSConfig or a cert_dir")
        return grpc.ssl_channel_credentials(
            root_certificates=(Path(cert_dir) / f"{CA_NAME}.pem").read_bytes()
        )
    f = cert_files(tls.cert_dir, tls.name)
    return grpc.ssl_channel_credentials(
        root_certificates=f.ca.read_bytes(),
        private_key=f.key.read_bytes(),
        certificate_chain=f.cert.read_bytes(),
    )


def server_ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """The KV data plane's server side: TLS 1.3 only, a CA-signed client certificate required.

    Unlike gRPC's credentials, the standard library lets the data plane refuse anything
    older than TLS 1.3.
    """
    f = cert_files(tls.cert_dir, tls.name)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(f.cert, f.key)
    ctx.load_verify_locations(cafile=f.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    # No session tickets: a ticket arriving mid-Put would look like the store answering
    # early (the client watches for an early ERROR frame), and connections are pooled.
    ctx.num_tickets = 0
    return ctx


def client_ssl_context(tls: TLSConfig | None, *, cert_dir: Path | None = None) -> ssl.SSLContext:
    """The data plane's client side: trust the CA, check the host name, present a certificate.

    ``tls=None`` with ``cert_dir``: trust the CA but present no certificate (what an
    unauthorised peer looks like), as :func:`channel_credentials` does.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if tls is None:
        if cert_dir is None:
            raise InputError("tls", None, "a TLSConfig or a cert_dir")
        ctx.load_verify_locations(cafile=Path(cert_dir) / f"{CA_NAME}.pem")
        return ctx
    f = cert_files(tls.cert_dir, tls.name)
    ctx.load_verify_locations(cafile=f.ca)
    ctx.load_cert_chain(f.cert, f.key)
    return ctx


def peer_common_name(peer: ssl.SSLSocket | ssl.SSLObject | Any) -> str | None:
    """The common name of ``peer``'s verified certificate (anything with ``getpeercert``)."""
    cert = peer.getpeercert() or {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:  # type: ignore[str-unpack]  # typeshed's loose cert type
            if key == "commonName":
                return str(value)
    return None
