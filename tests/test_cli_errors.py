"""``aiokv`` fails early and in one line: every argument is checked before any work
starts, the error names the fix, and a traceback comes only with ``aiokv --debug``."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from _helpers import checkout_env
from _helpers import run_python
from typer.testing import CliRunner

from aiokv import cli
from aiokv._bench import _plot
from aiokv._bench import transfer
from aiokv.cli import app

ROOT = Path(__file__).resolve().parents[1]
ENV = checkout_env(COLUMNS="100")
SCRIPT = "import sys; sys.argv[0] = 'aiokv'; from aiokv._console import main; main()"


def _aiokv(*argv: str, code: str = SCRIPT) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    done = run_python("-c", code, *argv, env=ENV, timeout=120)
    return done, time.monotonic() - t0


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The transfer benchmark replaced by a recorder: it must not run (and matplotlib
    taken as installed: the path is what is checked)."""
    monkeypatch.setattr(_plot, "check_plotting", lambda: None)
    ran: list[object] = []
    monkeypatch.setattr(transfer, "run_transfer_bench", lambda **kw: ran.append(kw))
    return ran


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.parametrize("option", ["--listen", "--data-port"])
def test_a_port_in_use_is_one_line_naming_the_fix(option: str, busy_port: int) -> None:
    args = (
        ["--listen", f"127.0.0.1:{busy_port}"]
        if option == "--listen"
        else ["--listen", "127.0.0.1:0", "--data-port", str(busy_port), "--once"]
    )
    done, took = _aiokv("bench", "transfer", *args)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert line.startswith("aiokv bench transfer: ") and option in line
    assert "in use" in line and "0 for any free port" in line
    assert done.stdout == "" and took < 60


def test_a_host_of_another_machine_is_one_line() -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", "--listen", "192.0.2.1:0"])
    assert result.exit_code == 2
    assert "no address of this machine" in _one_line(result.output)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing/x.png", "does not exist: create it first"),
        ("x.txt", "name a .png, .svg, .pdf file"),
        (".", "is a folder"),
    ],
)
def test_a_bad_plot_path_stops_before_the_benchmark(
    name: str, says: str, tmp_path: Path, no_run: list[object]
) -> None:
    target = tmp_path if name == "." else tmp_path / name
    result = CliRunner().invoke(app, ["bench", "transfer", "--quick", "--plot", str(target)])
    assert result.exit_code == 2, result.output
    assert says in _one_line(result.output)
    assert not no_run


def test_a_plot_folder_without_write_access_stops_before_the_benchmark(
    tmp_path: Path, no_run: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: take the folder as read-only
        monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    result = CliRunner().invoke(app, ["bench", "transfer", "--plot", str(locked / "x.png")])
    assert result.exit_code == 2
    assert "cannot write into" in _one_line(result.output)
    assert not no_run


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--listen", "127.0.0.1:0", "--tls"], "--listen takes no"),
        (["--listen", "127.0.0.1:0", "--plot", "x.png"], "--listen takes no"),
        (["--once"], "go with --listen only"),
        (["--data-port", "5"], "go with --listen only"),
        (["--connect", "127.0.0.1:9", "--tls"], "--connect runs plain TCP"),
        (["--connect", "nohost"], "expected HOST:PORT"),
        (["--connect", "127.0.0.1:0"], "port 0 names no listener"),
    ],
)
def test_option_combinations_are_one_line(argv: list[str], says: str, no_run: list[object]) -> None:
    result = CliRunner().invoke(app, ["bench", "transfer", *argv])
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    assert line.startswith("aiokv bench transfer: ") and says in line
    assert not no_run


BOOM = (
    "import aiokv._info as info\n"
    "def collect():\n"
    "    raise RuntimeError('the probe broke\\nsecond line')\n"
    "info.collect = collect\n" + SCRIPT.replace("; ", "\n")
)


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback() -> None:
    with ThreadPoolExecutor(2) as both:  # the two runs at once
        (done, _), (debug, _) = both.map(
            lambda argv: _aiokv(*argv, code=BOOM), [("info",), ("--debug", "info")]
        )
    assert done.returncode == 1
    line = _one_line(done.stderr)
    assert line == (
        "aiokv: RuntimeError: the probe broke second line (aiokv --debug shows the traceback)"
    )
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "the probe broke" in debug.stderr


def _unless(missing: str, find_spec: Callable[..., object], name: str, *args: object) -> object:
    return None if name == missing else find_spec(name, *args)


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("cuda", "no CUDA device here; use --device auto or cpu"),
        ("npu", "torch_npu is not installed; use --device auto or cpu"),
    ],
)
def test_demo_on_a_device_this_machine_lacks_is_a_usage_error_before_any_process(
    device: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util
    import multiprocessing

    import torch

    find_spec = importlib.util.find_spec
    no_npu = partial(_unless, "torch_npu", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", no_npu)  # as if torch_npu were missing
    result = CliRunner().invoke(app, ["demo", "--device", device])
    assert result.exit_code == 2  # like any bad argument value: another --device fixes it
    assert _one_line(result.output) == f"aiokv demo: --device {device}: {says}"
    assert not multiprocessing.active_children()


def test_demo_over_nixl_without_nixl_names_the_extra_before_any_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing

    from aiokv import LLMException
    from aiokv import LLMStatusCode
    from aiokv._demo import _run

    def missing(name: str) -> None:
        raise LLMException(
            f"transport {name!r} is not available: pip install 'aiokv[nixl]'",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    monkeypatch.setattr(_run, "get_transport", missing)
    result = CliRunner().invoke(app, ["demo", "--backend", "nixl"])
    assert result.exit_code == 1
    line = _one_line(result.output)
    assert line.startswith("aiokv demo: --backend nixl: ") and "aiokv[nixl]" in line
    assert not multiprocessing.active_children()


def test_bench_device_without_an_accelerator_is_one_line_with_one_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokv._copy import _device

    monkeypatch.setattr(_device, "_device_count", lambda kind: 0)  # no CUDA, no NPU here
    result = CliRunner().invoke(app, ["bench", "device", "--quick"])
    assert result.exit_code == 1
    assert _one_line(result.output) == (
        "aiokv bench device: needs an accelerator: cuda:0 requested but cuda is not "
        "available (aiokv info lists this machine's devices)"
    )
