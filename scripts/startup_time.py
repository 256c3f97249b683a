"""What aiokv adds to start-up, in seconds, against what it is compared with, same run.

``PYTHONPATH=. python scripts/startup_time.py [TRIES]`` (repository root): the best of
``TRIES`` (default 5) wall-clock runs of each command, alternating the pairs:
``aiokv --version`` and ``aiokv --help`` against a bare interpreter, and a one-test pytest
run with the aiokv plugin against the same run without it (``-p no:aiokv``). Prints each
pair's seconds and the difference. The test suite checks what is imported
(tests/test_startup.py); this measures what that costs on the machine it runs on.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = "import sys; sys.argv[0] = 'aiokv'; from aiokv._console import main; main()"


def _seconds(args: list[str], cwd: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, check=False)
    return time.perf_counter() - t0


def main(tries: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", tmp]
        pairs: dict[str, tuple[list[str], list[str]]] = {
            "aiokv --version": (["-c", CLI, "--version"], ["-c", "pass"]),
            "aiokv --help": (["-c", CLI, "--help"], ["-c", "pass"]),
            "pytest with the plugin": (pytest, [*pytest, "-p", "no:aiokv"]),
        }
        best = {name: [float("inf"), float("inf")] for name in pairs}
        for _ in range(tries):
            for name, (it, base) in pairs.items():
                best[name][0] = min(best[name][0], _seconds(it, tmp))
                best[name][1] = min(best[name][1], _seconds(base, tmp))
    for name, (it_s, base_s) in best.items():
        print(f"{name:24} {it_s:6.3f} s  baseline {base_s:6.3f} s  adds {it_s - base_s:+.3f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
