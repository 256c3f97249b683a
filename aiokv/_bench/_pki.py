"""Throwaway certificates for TLS benchmarks and tests: a CA and leaf certificates it
signed, made with the ``openssl`` command in a directory the caller owns.

EC P-256 keys, valid two days, each leaf naming ``127.0.0.1`` and ``localhost`` (unless
asked otherwise) and usable as a TLS server and client. Never use them for anything but a test.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Pki", "TlsFiles", "make_pki"]

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_LEAF_EXT = (
    "basicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature\n"
    "extendedKeyUsage=serverAuth,clientAuth\n"
    "subjectAltName={san}\n"
)
LOOPBACK = "IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """One participant's TLS files: what ``tls_cert_file`` / ``tls_key_file`` /
    ``tls_ca_file`` take."""

    cert_file: str
    key_file: str
    ca_file: str

    def options(self) -> dict[str, Any]:
        """As ``LLMConfig`` keyword arguments."""
        return {"tls_cert_file": self.cert_file, "tls_key_file": self.key_file,
                "tls_ca_file": self.ca_file}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Pki:
    """A CA (``ca_file``, ``ca_key``) and the leaves made with it, by name."""

    ca_file: str
    ca_key: str
    leaves: dict[str, TlsFiles]


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def make_pki(
    directory: Path, names: tuple[str, ...] = ("a", "b"), ca: str = "ca", san: str = LOOPBACK
) -> Pki:
    """A new CA named ``ca`` and one leaf per name, all under ``directory``, each leaf
    naming ``san`` (an openssl subjectAltName value).

    Raises:
        RuntimeError: the ``openssl`` command is missing or failed.
    """
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    ca_file, ca_key = str(directory / f"{ca}.pem"), str(directory / f"{ca}.key")
    _openssl(
        "req", "-x509", *_EC, "-keyout", ca_key, "-out", ca_file, "-days", "2",
        "-subj", f"/CN=aiokv throwaway {ca}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    ext = directory / f"{ca}-leaf.ext"
    ext.write_text(_LEAF_EXT.format(san=san))
    leaves: dict[str, TlsFiles] = {}
    for serial, name in enumerate(names, start=1):
        stem = directory / f"{ca}-{name}"
        key, csr, cert = f"{stem}.key", f"{stem}.csr", f"{stem}.pem"
        _openssl("req", "-new", *_EC, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        _openssl(
            "x509", "-req", "-in", csr, "-CA", ca_file, "-CAkey", ca_key,
            "-set_serial", str(serial), "-days", "2", "-out", cert, "-extfile", str(ext),
        )  # fmt: skip
        leaves[name] = TlsFiles(cert, key, ca_file)
    return Pki(ca_file, ca_key, leaves)
