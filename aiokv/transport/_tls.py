"""TLS settings of a transport: both ends' ``ssl`` contexts, loaded from PEM files.

Mutual certificates, TLS 1.3 only: each side presents its certificate and verifies the
other's against one CA. The contexts are built once (at ``init``); a bad file is a
configuration error, ``LLMException(LLM_PARAM_INVALID)``, never a link failure later.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

from .._enums import LLMStatusCode
from .._errors import LLMException

__all__ = ["TlsContexts", "load_tls"]


@dataclass(frozen=True, slots=True)
class TlsContexts:
    """The two ``ssl`` contexts a TLS transport needs.

    Attributes:
        server: for connections this side accepts (requires a client certificate).
        client: for connections this side opens.
        check_hostname: the connecting side checks that the listener's certificate names
            the host it dialled.
    """

    server: ssl.SSLContext
    client: ssl.SSLContext
    check_hostname: bool

    def wrap(self, sock: socket.socket, *, server_side: bool, host: str) -> ssl.SSLSocket:
        """``sock`` (connected, non-blocking) wrapped, its TLS handshake not yet run.

        ``sock`` is detached: from now on only the returned socket owns the descriptor.
        """
        if server_side:
            return self.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return self.client.wrap_socket(
            sock,
            do_handshake_on_connect=False,
            server_hostname=host if self.check_hostname else None,
        )


def _no_password() -> bytes:
    raise ValueError("an encrypted private key is not supported")


def _no_key_in(path: str) -> bool:
    """Whether the readable PEM file ``path`` holds no private key."""
    try:
        with open(path, "rb") as f:
            return b"PRIVATE KEY-----" not in f.read(1 << 20)
    except OSError:
        return False


def _context(
    purpose: int, cert_file: str, key_file: str | None, ca_file: str, check_hostname: bool
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    if purpose == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = check_hostname
    else:
        ctx.num_tickets = 0  # no session resumption: no tickets after the handshake
    for what, path in (("tls_ca_file", ca_file), ("tls_cert_file", cert_file)):
        try:
            if what == "tls_ca_file":
                ctx.load_verify_locations(cafile=path)
            else:
                ctx.load_cert_chain(path, key_file, password=_no_password)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            names = f"{path!r}" if what == "tls_ca_file" else f"{path!r} / key {key_file!r}"
            hint = ""
            if what == "tls_cert_file" and key_file is None and _no_key_in(path):
                hint = " (it holds no private key: set tls_key_file to the key's file)"
            raise LLMException(
                f"init: TLS: cannot load {what} {names}: {exc}{hint}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from None
    return ctx


def load_tls(
    cert_file: str | None, key_file: str | None, ca_file: str | None, check_hostname: bool
) -> TlsContexts | None:
    """The contexts for these options, or ``None`` when TLS is off (none of them set).

    Args:
        cert_file: this side's certificate chain (PEM), presented to every peer.
        key_file: its private key (PEM, not encrypted); ``None``: inside ``cert_file``.
        ca_file: the CA certificate(s) (PEM) every peer's certificate must chain to.
        check_hostname: whether the connecting side checks the listener's name.

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` when only some options are set, or a file
            is missing, unreadable, not PEM, or the key does not match the certificate.
    """
    if cert_file is None and key_file is None and ca_file is None:
        if check_hostname:
            raise LLMException(
                "init: tls_check_hostname needs TLS (tls_cert_file and tls_ca_file)",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return None
    if cert_file is None or ca_file is None:
        missing = " and ".join(
            n for n, v in (("tls_cert_file", cert_file), ("tls_ca_file", ca_file)) if v is None
        )
        raise LLMException(
            f"init: TLS needs {missing} too (set tls_cert_file, tls_ca_file and, unless the "
            "key is in the certificate file, tls_key_file)",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    return TlsContexts(
        server=_context(ssl.PROTOCOL_TLS_SERVER, cert_file, key_file, ca_file, check_hostname),
        client=_context(ssl.PROTOCOL_TLS_CLIENT, cert_file, key_file, ca_file, check_hostname),
        check_hostname=check_hostname,
    )
