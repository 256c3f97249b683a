"""Harness for the ported llm_datadist clients (tests/ports/clients/).

Each client runs as its own processes, exactly as its authors run it (``python sample.py
--role p ...``), against aiokv instead of llm_datadist. The harness only hands out free
ports, starts the parties, bounds them in time and kills whatever is still running.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@dataclass
class Result:
    """How one party ended: its exit status and everything it printed."""

    name: str
    returncode: int | None
    output: str


def run_parties(
    parties: dict[str, list[str]],
    env: dict[str, str],
    timeout: float,
    party_env: dict[str, dict[str, str]] | None = None,
) -> dict[str, Result]:
    """Run ``python CLIENTS/<argv...>`` per party at once; all must end within ``timeout`` s.

    ``env`` is added to every party's environment, ``party_env[name]`` to that party's.
    If a port picked free was taken meanwhile (another process's ephemeral port: a party
    says so, see :func:`_port_taken`) -- a race of the harness, not of the client -- all
    run once more on fresh ports (the ``PORTS_*_PORT`` keys of ``env``).
    """
    # the ported clients put their caches in host memory (where llm_datadist's samples use
    # the NPU): on a host with an accelerator, device_type "auto" would pick it
    base = {**os.environ, "PYTHONUNBUFFERED": "1", "AIOKV_DEVICE_TYPE": "cpu"}
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    keys = [k for k in env if k.startswith("PORTS_") and k.endswith("_PORT")]
    for fresh_ports in (False, True):
        if fresh_ports:
            env = {**env, **dict(zip(keys, map(str, free_ports(len(keys))), strict=True))}
        envs = {name: {**base, **env, **(party_env or {}).get(name, {})} for name in parties}
        results = _run_once(parties, envs, timeout)
        if not any(_port_taken(r.output) for r in results.values()):
            break
    return results


def _port_taken(output: str) -> bool:
    """Whether a party failed to bind a port (errno's name, or its message as Python's
    ``OSError`` words it: ``[Errno 98] Address already in use``)."""
    return "EADDRINUSE" in output or "Address already in use" in output


def _run_once(
    parties: dict[str, list[str]], envs: dict[str, dict[str, str]], timeout: float
) -> dict[str, Result]:
    """Run ``python CLIENTS/<argv...>`` per party at once, each with its environment
    ``envs[name]``; all must end within ``timeout`` s.

    A party that fails makes the others pointless (they would wait at a barrier until
    gloo's own 30 s timeout), so the first non-zero exit stops the rest. Every process
    started here is killed and reaped before this returns.
    """
    procs: dict[str, tuple[subprocess.Popen[bytes], tempfile._TemporaryFileWrapper[bytes]]] = {}
    try:
        for name, argv in parties.items():
            out = tempfile.NamedTemporaryFile(prefix=f"aiokv-port-{name}-")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, *argv],
                cwd=CLIENTS,
                env=envs[name],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            procs[name] = (proc, out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p, _ in procs.values()]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        results: dict[str, Result] = {}
        for name, (proc, out) in procs.items():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            out.seek(0)
            text = out.read().decode(errors="replace")
            out.close()
            results[name] = Result(name, proc.returncode, text)
    return results


def assert_all_ok(results: dict[str, Result]) -> None:
    """Every party exited 0; else fail showing every party's output."""
    if all(r.returncode == 0 for r in results.values()):
        return
    report = "\n".join(
        f"===== {r.name}: exit {r.returncode} =====\n{r.output[-6000:]}" for r in results.values()
    )
    pytest.fail(f"a ported client failed\n{report}", pytrace=False)
