"""docs/notebook.ipynb runs top to bottom in a real Jupyter kernel (nbclient), and
re-running its cells in the same kernel does not leak: the re-run finalizes the
previous run's instances (their engine threads end), and the last cell releases all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import threading, time
from aiokv import _datadist
deadline = time.monotonic() + 10  # the finalized engines' threads end by themselves
count = lambda: sum(t.name.startswith("aiokv-engine") for t in threading.enumerate())
while count() > {engines} and time.monotonic() < deadline:
    time.sleep(0.05)
print("ENGINES", count(), "LIVE", len(_datadist._live))
"""


def probe(client: Any, engines: int) -> str:
    cell = nbformat.v4.new_code_cell(PROBE.format(engines=engines))
    client.execute_cell(cell, 0)
    return "".join(o.get("text", "") for o in cell.outputs)


def test_notebook_runs_and_reruns_without_leaking() -> None:
    nb = nbformat.read(ROOT / "docs" / "notebook.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    with client.setup_kernel(env=env):
        for _ in range(3):  # run all but the clean-up, three times over
            for index, cell in enumerate(code[:-1]):
                client.execute_cell(cell, index)
        assert "ENGINES 2 LIVE 2" in probe(client, engines=2)  # one run's worth
        text = "".join(o.get("text", "") for o in code[-2].outputs)
        assert "MiB/s" in text and "pull" in text and "swap out" in text
        client.execute_cell(code[-1], len(code) - 1)  # clean up
        assert "(False, False)" in code[-1].outputs[0]["data"]["text/plain"]
        assert "ENGINES 0 LIVE 0" in probe(client, engines=0)
    errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert errors == []
    warned = [o for c in code for o in c.outputs if "finalize the old one" in o.get("text", "")]
    assert warned == []  # the notebook finalizes before it re-creates: aiokv never warns
