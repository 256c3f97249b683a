"""Every runnable example in ``aiokv/examples`` runs to its end as a user would run it
(``python -m aiokv.examples.<name>``, a fresh interpreter), and reports that the bytes
arrived. Each example checks its own bytes and exits non-zero when they differ."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_python

ROOT = Path(__file__).resolve().parents[2]

#: example -> lines its output must contain (each a check the example made)
EXAMPLES = {
    "local_blocks": [
        "swap block 0 back in: bytes identical = True",
        "forked = True",
        "after deallocate: 0 bytes used, 0 allocations",
    ],
    "pull_two_processes": ["decode holds the prefill's blocks: True"],
    "layerwise_push": ["decoder blocks 10..15 hold the prefill's blocks 0..5: True"],
    "sync_datadist": [
        "pull_blocks [2, 3] -> [0, 1]: bytes identical = True",
        "finalized; still initialized: False",
    ],
}


def test_every_example_is_listed() -> None:
    shipped = {
        p.stem
        for p in (ROOT / "aiokv" / "examples").glob("*.py")
        if p.stem != "__init__" and "def main(" in p.read_text()
    }
    assert shipped == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str) -> None:
    proc = run_python("-m", f"aiokv.examples.{name}", timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in EXAMPLES[name]:
        assert line in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
