"""The documentation site (issue #12 item 1): ``mkdocs build --strict`` passes (no broken
link or anchor, no docstring the reference cannot parse), the generated reference
covers every public name, and the migration guide lists every option key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _helpers import run_python

import aiokv
import aiokv._sync_gen
import aiokv.metrics
import aiokv.sync
import aiokv.transport
from aiokv import _config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_site_builds_strict_with_every_public_name(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = run_python(
        "-m", "mkdocs", "build", "--strict", "--site-dir", str(site), env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def ids(page: str) -> set[str]:
        html = (site / "reference" / page / "index.html").read_text()
        return set(re.findall(r'id="([\w.]+)"', html))

    public = {f"aiokv.{n}" for n in aiokv.__all__ if n != "__version__"}
    assert public - ids("aiokv") == set()
    faces = {"LLMDataDist", "CacheManager", "KvCacheManager", "CacheTask"}
    assert {f"aiokv.sync.{n}" for n in faces} - ids("sync") == set()
    sync_table = (DOCS / "reference" / "sync.md").read_text()
    ops = [n for n in vars(aiokv._sync_gen.CacheManagerOps) if not n.startswith("_")]
    assert ops
    for op in ops:
        assert f"[aiokv.CacheManager.{op}]" in sync_table
    assert {f"aiokv.transport.{n}" for n in aiokv.transport.__all__} - ids("transport") == set()
    assert {f"aiokv.metrics.{n}" for n in aiokv.metrics.__all__} - ids("metrics") == set()
    for page in ("quickstart", "concepts", "migration", "examples", "security", "design"):
        assert (site / page / "index.html").is_file()


def test_migration_guide_lists_every_option_key() -> None:
    guide = (DOCS / "migration.md").read_text()
    keys = set(_config._OPTION_KEYS.values()) | set(_config._OLD_KEYS) | _config._PASSTHROUGH_KEYS
    missing = {k for k in keys if f"`{k}`" not in guide}
    assert missing == set()
    fields = {f for f in _config._OPTION_KEYS if f"| `{f}` |" not in guide}
    assert fields == set()


def test_readme_links_the_site_and_the_serve_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/docs.sh serve" in readme
    assert (ROOT / "scripts" / "docs.sh").is_file()
    assert (ROOT / "mkdocs.yml").is_file()


def test_quick_start_runs_as_the_readme_snippet_does() -> None:
    """The quick start's async program is README's, which test_readme_snippet runs."""
    block = re.compile(r"```python\n(.*?)```", re.S)
    readme = block.findall((ROOT / "README.md").read_text())[0]
    assert block.findall((DOCS / "quickstart.md").read_text())[0] == readme
