"""README's python snippet runs as written (in a fresh interpreter, another directory)
and shows both sides: a prefill participant and a decoder pulling its blocks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def run_snippet(snippet: str, cwd: Path) -> str:
    """Run ``snippet`` in a fresh interpreter from ``cwd``; it must exit 0 within 60 s.
    Returns what it wrote (stdout, then stderr), stripped."""
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=cwd, capture_output=True, timeout=60)
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, out
    return out.strip()


def test_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "README has one python snippet"
    snippet = blocks[0]
    assert "LLMRole.PROMPT" in snippet and "LLMRole.DECODER" in snippet  # both sides
    assert run_snippet(snippet, tmp_path) == "decode holds the prefill's KV blocks: True"


def test_quickstart_blocking_snippet_runs_as_written(tmp_path: Path) -> None:
    """docs/quickstart.md's ``aiokv.sync`` snippet: both sides, the link checked."""
    page = (README.parent / "docs" / "quickstart.md").read_text()
    section = page[page.index("## Blocking: `aiokv.sync`") :]
    snippet = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert "import aiokv.sync as llm_datadist" in snippet and "link_clusters" in snippet
    assert run_snippet(snippet, tmp_path) == "pulled: True"
