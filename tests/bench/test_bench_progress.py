"""``aiokv bench`` progress: every bar has its total before its part starts (``3/8``,
never ``0/?``), and a part's named steps are counted as they end."""

from __future__ import annotations

import ast
import inspect
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.progress import Progress

from aiokv._bench import _progress
from aiokv._bench._progress import shown
from aiokv._bench._progress import steps
from aiokv._bench.local import run_local_bench

BENCH = Path(_progress.__file__).parent


def test_steps_takes_a_total_and_every_part_gives_one() -> None:
    assert inspect.signature(steps).parameters["total"].default is inspect.Parameter.empty
    calls = 0
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "steps":
                calls += 1
                total = node.args[1] if len(node.args) > 1 else None
                for kw in node.keywords:
                    total = kw.value if kw.arg == "total" else total
                assert total is not None, f"{path.name}:{node.lineno}: steps() without a total"
                assert not (isinstance(total, ast.Constant) and total.value is None)
    assert calls >= 6


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every bar a run adds: its description and total, and its progress when removed."""
    bars: list[dict[str, Any]] = []
    add, remove = Progress.add_task, Progress.remove_task

    def add_task(self: Progress, description: str, *args: Any, **kwargs: Any) -> Any:
        task = add(self, description, *args, **kwargs)
        bars.append({"id": task, "description": description, "total": self.tasks[-1].total})
        return task

    def remove_task(self: Progress, task: Any) -> None:
        done = next(t for t in self.tasks if t.id == task)
        next(b for b in bars if b["id"] == task)["completed"] = done.completed
        remove(self, task)

    monkeypatch.setattr(Progress, "add_task", add_task)
    monkeypatch.setattr(Progress, "remove_task", remove_task)
    return bars


def test_a_named_step_counts_when_it_ends(recorded: list[dict[str, Any]]) -> None:
    with shown(Console(file=StringIO())), steps("parts", 3) as part:
        for name in ("a", "b"):
            with part.step(f"part {name}"):
                pass
        with pytest.raises(RuntimeError), part.step("part c"):
            raise RuntimeError("a step that fails still counts")
    assert recorded == [{"id": recorded[0]["id"], "description": "parts", "total": 3,
                         "completed": 3}]  # fmt: skip


def test_a_benchmark_run_shows_every_total_before_it_starts(
    recorded: list[dict[str, Any]],
) -> None:
    with shown(Console(file=StringIO())):
        run_local_bench(block_kib=(16,), nblocks=(8,), layers=1, repeat=1, small_rounds=5)
    assert recorded, "no bar was shown"
    for bar in recorded:
        assert bar["total"] is not None, bar
        assert bar["completed"] == bar["total"], bar
