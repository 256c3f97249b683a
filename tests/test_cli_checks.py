"""The aiokv command checks every argument before any work starts (exit 2, one line)
and starts its children deaf to Ctrl-C: cases found in review."""

from __future__ import annotations

import multiprocessing.connection
import signal
import socket
from typing import Any

import pytest
from typer.testing import CliRunner

from aiokv._bench import _plot
from aiokv._bench import remote
from aiokv._bench import transfer
from aiokv._bench import vllm
from aiokv.cli import app


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The transfer benchmark and the listener replaced by recorders: neither may run."""
    monkeypatch.setattr(_plot, "check_plotting", lambda: None)
    calls: list[object] = []

    async def serve_peer(*args: Any, **kwargs: Any) -> None:
        calls.append(("serve_peer", args, kwargs))

    monkeypatch.setattr(remote, "serve_peer", serve_peer)
    monkeypatch.setattr(transfer, "run_transfer_bench", lambda **kw: calls.append(kw))
    return calls


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# ---- 1. a host name passes the argument check, then fails after work started ------------


@pytest.mark.parametrize("option", ["--connect", "--listen"])
def test_a_host_name_is_refused_before_any_work(option: str, ran: list[object]) -> None:
    """``--connect localhost:P`` connects to the listener (using up its ``--once``)
    and then fails with ``aiokv: ValueError: LLMClusterInfo: ... 'localhost' is not an
    IP address``, exit 1; ``--listen localhost:0`` fails likewise in LLMConfig. Both
    should be a usage error (exit 2) before anything runs, as the unknown-host check's
    own message ("give an IP address") says."""
    port = 9 if option == "--connect" else 0
    result = CliRunner().invoke(app, ["bench", "transfer", option, f"localhost:{port}"])
    assert not ran, f"{option} localhost:{port} went on to run: {ran}"
    assert result.exit_code == 2, result.output
    assert "IP address" in _one_line(result.output)


# ---- 2. --listen accepts --json / --quick and ignores them ------------------------------


@pytest.mark.parametrize("option", ["--json", "--quick"])
def test_listen_refuses_the_options_it_ignores(option: str, ran: list[object]) -> None:
    """``--listen`` refuses --plot, --tls, ... but takes --json (then prints the plain
    ``listening on ...`` line on stdout, which --json promises to keep to one JSON
    object) and --quick, both silently ignored."""
    result = CliRunner().invoke(app, ["bench", "transfer", "--listen", "127.0.0.1:0", option])
    assert not ran, f"--listen {option} was accepted and ignored"
    assert result.exit_code == 2, result.output
    assert "--listen takes no" in _one_line(result.output)


# ---- 3. --data-port equal to the --listen port ------------------------------------------


def test_data_port_equal_to_the_listen_port_is_a_usage_error(ran: list[object]) -> None:
    """Each port is checked alone (both free), so ``--listen H:P --data-port P`` starts
    the participant on P, then fails to bind the control port: exit 1 with
    ``[Errno 98] Address already in use (while attempting to bind ...)``."""
    port = _free_port()
    result = CliRunner().invoke(
        app, ["bench", "transfer", "--listen", f"127.0.0.1:{port}", "--data-port", str(port)]
    )
    assert not ran, "the listener was started with --data-port equal to the --listen port"
    assert result.exit_code == 2, result.output


# ---- 4. bench vllm: engines not shielded from the terminal's Ctrl-C ---------------------


def _probe(conn: multiprocessing.connection.Connection, *args: Any) -> None:
    """Stands in for a vLLM engine process: reports how it would take a SIGINT."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    conn.send(("ok", blocked or ignored))
    conn.recv()


def test_vllm_engines_are_started_deaf_to_sigint(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/cli.md: children are started with SIGINT blocked (a terminal's Ctrl-C
    signals the whole process group; only the command acts on it), so no traceback
    comes from them. The harness's Peer does it (sigint_blocked); bench vllm's
    _Engine starts its processes plainly, so each engine gets the Ctrl-C itself."""
    monkeypatch.setattr(vllm, "_engine", _probe)
    engine = vllm._Engine("model", None)
    try:
        assert engine.reply(60), "the engine process would take Ctrl-C (SIGINT) itself"
    finally:
        engine.stop()


# ---- 5. bench vllm --model: not checked before the engines start ------------------------


def test_vllm_model_directory_is_checked_before_any_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``--model DIR`` ("a local model directory") that does not exist goes to nine
    vLLM engine processes, each failing; the command ends with a squashed traceback
    (``aiokv: RuntimeError: a vLLM engine failed: Traceback ...``), exit 1."""
    started: list[str] = []
    real_find_spec = vllm.importlib.util.find_spec
    monkeypatch.setattr(
        vllm.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(vllm, "_run", lambda model, *a: started.append(model))
    missing = str(tmp_path / "no-such-model")
    result = CliRunner().invoke(app, ["bench", "vllm", "--model", missing])
    assert not started, f"the benchmark started with --model {missing}"
    assert result.exit_code == 2, result.output
