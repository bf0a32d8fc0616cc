"""A throwaway CA and a stream-listener certificate signed by it, as PEM files: for the tests and
``serve-app bench-wire-tls``. A region's real ones come from its Secret (docs/operations.md)."""

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from serve_app.wire.tls import STREAM_TLS_NAME


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _valid_for_a_day(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))


def issue(directory: Path, label: str = "region", dns_name: str = STREAM_TLS_NAME) -> dict[str, str]:
    """Write ``<label>-ca.pem``, ``<label>.pem`` (for ``dns_name``) and ``<label>.key`` into
    ``directory``; their paths by ``ca``, ``cert`` and ``key``. P-256 keys, valid for a day."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _valid_for_a_day(
        x509.CertificateBuilder().subject_name(_name(f"{label} CA")).issuer_name(_name(f"{label} CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    ).sign(ca_key, hashes.SHA256())
    leaf = _valid_for_a_day(
        x509.CertificateBuilder().subject_name(_name(dns_name)).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
    ).sign(ca_key, hashes.SHA256())
    paths = {"ca": directory / f"{label}-ca.pem", "cert": directory / f"{label}.pem", "key": directory / f"{label}.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths["key"].chmod(0o600)
    return {name: str(path) for name, path in paths.items()}
