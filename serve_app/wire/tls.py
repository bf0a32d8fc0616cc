"""TLS on the byte socket: a region option, off by default (docs/threat-model.md, "The stream
listener", says when it is worth it and what it costs, measured).

A replica serves TLS when its environment names a certificate and its key
(``SERVE_APP_STREAM_TLS_CERT``, ``SERVE_APP_STREAM_TLS_KEY``: PEM files, the region's Secret
mounted into every Ray pod); it then refuses plaintext and says ``tls`` in every head it sends.
A router that reads such a head verifies the replica against ``SERVE_APP_STREAM_TLS_CA`` and the
DNS name ``SERVE_APP_STREAM_TLS_NAME`` (``STREAM_TLS_NAME`` by default): one certificate for the
region's listeners, named, not addressed, because a listener binds its pod's IP, which changes
with every pod. TLS 1.3 only. The files are read when the replica starts, and on a router when
its first TLS stream opens: a rotated certificate takes a replica (router) restart.
"""

import os
import ssl
from collections.abc import Mapping

CERT_ENV = "SERVE_APP_STREAM_TLS_CERT"
KEY_ENV = "SERVE_APP_STREAM_TLS_KEY"
CA_ENV = "SERVE_APP_STREAM_TLS_CA"
NAME_ENV = "SERVE_APP_STREAM_TLS_NAME"
STREAM_TLS_NAME = "stream-listener.serve-app.internal"


class StreamTLSNotConfigured(RuntimeError):
    """A replica serves TLS and this router has no CA to verify it with."""


def server_context(environ: Mapping[str, str] = os.environ) -> ssl.SSLContext | None:
    """The listener's context, or None (plaintext) when no certificate is configured. A
    certificate without its key (or the reverse) is a configuration error, raised at start."""
    cert, key = environ.get(CERT_ENV, "").strip(), environ.get(KEY_ENV, "").strip()
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError(f"stream TLS needs both {CERT_ENV} and {KEY_ENV} (PEM files); one is unset")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    return context


_clients: dict[str, ssl.SSLContext] = {}  # by CA file: built once per process


def client_context(environ: Mapping[str, str] = os.environ) -> tuple[ssl.SSLContext, str]:
    """The router's context for TLS listeners, and the name it verifies them by."""
    ca = environ.get(CA_ENV, "").strip()
    if not ca:
        raise StreamTLSNotConfigured(f"a model replica serves its stream over TLS and {CA_ENV} is unset here")
    if ca not in _clients:
        context = ssl.create_default_context(cafile=ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        _clients[ca] = context
    return _clients[ca], environ.get(NAME_ENV, "").strip() or STREAM_TLS_NAME
