"""Ctrl-C ends ``aiokv demo`` cleanly: SIGINT to its process group (what a terminal
sends) while its prefill and decode processes run ends it within about a second, exit
code 130, no traceback, no process of it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups, SIGINT")


def _group(pgid: int) -> list[str]:
    """Processes of group ``pgid`` (zombies included) as ``pid stat cmd`` lines."""
    ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True)
    return ps.stdout.decode().splitlines()


def test_ctrl_c_ends_the_demo_and_its_processes_within_a_second() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiokv.cli", "demo", "--steps", "1000", "--decoders", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group, as a shell job
    )
    try:
        deadline = time.monotonic() + 60
        while len(_group(proc.pid)) < 4 and time.monotonic() < deadline:  # + tracker, 2+1
            time.sleep(0.1)
        assert len(_group(proc.pid)) >= 4, _group(proc.pid)
        time.sleep(3)  # the children import, link, prefill, decode
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode()
    assert proc.returncode == 130, text
    assert "aiokv demo: interrupted" in text
    assert "aiokv: interrupted" not in text  # said once, by the demo
    assert "Traceback" not in text
    assert took < 1.5, took  # ~1 s; the margin is for a loaded machine
    assert _group(proc.pid) == []  # the children and multiprocessing's tracker, reaped
