"""examples/README.md: each example checks the bytes it moved and exits non-zero when
they differ (found in review: engine_integration.py printed ``False`` and exited 0)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_integration.py"
# ---- 6. examples/engine_integration.py exits 0 with wrong bytes -------------------------


async def test_engine_integration_example_fails_when_the_bytes_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/README.md: "Each checks the bytes it moved and exits non-zero when they
    differ". engine_integration.py prints ``holds: False`` and returns normally (exit
    0): only the repository's test counts the ``: True`` lines. Here the pull moves
    nothing (a stand-in for a transfer that lost the bytes)."""
    path = EXAMPLE
    spec = importlib.util.spec_from_file_location("engine_integration_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    async def pull_nothing(*args: Any) -> None:
        return None

    monkeypatch.setattr(example, "pull_request", pull_nothing)
    said: list[str] = []
    with pytest.raises(RuntimeError):
        await example.main(said.append)
    assert any("False" in line for line in said), said
