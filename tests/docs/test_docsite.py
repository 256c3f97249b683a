"""The documentation site: ``mkdocs build --strict`` passes (no broken link or anchor, no
docstring the reference cannot parse), the generated reference covers every public name
on pages of a readable size, the built HTML has none of the rendering faults Markdown
makes easy (escaped pipes, Sphinx roles, emphasis inside identifiers, swallowed lists),
and the migration guide lists every option key."""

from __future__ import annotations

import asyncio
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import checkout_env
from _helpers import run_python

import aiokv
import aiokv.metrics
import aiokv.sync
import aiokv.transport
from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv import LLMConfig
from aiokv import _config
from aiokv.testing import linked_pair
from aiokv.testing import make_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


REFERENCE = ROOT / "docs" / "reference"
#: The largest a generated reference page may be (bytes of HTML, theme included): one
#: page per class or topic, never the whole package on one page.
MAX_REFERENCE_PAGE = 200_000


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` writes it (no broken link or anchor, no
    docstring the reference cannot parse)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = checkout_env(NO_MKDOCS_2_WARNING="1")
    proc = run_python(
        "-m", "mkdocs", "build", "--strict", "--site-dir", str(site), env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def _pages(site: Path) -> dict[str, str]:
    return {
        str(p.parent.relative_to(site)): p.read_text()
        for p in sorted(site.rglob("index.html"))
        if p.parent.name != "404"
    }


def _ids(site: Path, pages: list[str]) -> set[str]:
    found: set[str] = set()
    for page in pages:
        html = (site / "reference" / page / "index.html").read_text()
        found |= set(re.findall(r'id="([\w.]+)"', html))
    return found


def test_site_builds_strict_with_every_public_name(site: Path) -> None:
    pages = [p.stem for p in REFERENCE.glob("*.md")]
    public = {f"aiokv.{n}" for n in aiokv.__all__ if n != "__version__"}
    assert public - _ids(site, pages) == set()
    faces = {"LLMDataDist", "CacheManager", "KvCacheManager", "CacheTask"}
    assert {f"aiokv.sync.{n}" for n in faces} - _ids(site, ["sync", "sync-managers"]) == set()
    sync_table = (REFERENCE / "sync-managers.md").read_text()
    ops = [
        n
        for n, fn in inspect.getmembers(aiokv.CacheManager, inspect.iscoroutinefunction)
        if not n.startswith("_")
    ]
    assert ops
    for op in ops:
        assert f"[aiokv.CacheManager.{op}]" in sync_table
    # CacheManager's operations live in one module per job: each still has its entry
    methods = {n for n in dir(aiokv.CacheManager) if not n.startswith("_")}
    assert {f"aiokv.CacheManager.{n}" for n in methods} - _ids(site, ["cachemanager"]) == set()
    transport = {f"aiokv.transport.{n}" for n in aiokv.transport.__all__}
    assert transport - _ids(site, ["transport"]) == set()
    assert {f"aiokv.metrics.{n}" for n in aiokv.metrics.__all__} - _ids(site, ["metrics"]) == set()
    for page in ("quickstart", "concepts", "migration", "examples", "security", "design"):
        assert (site / page / "index.html").is_file()


def _prose(html: str) -> str:
    """``html`` without its code blocks (``<pre>``), where any text may stand."""
    return re.sub(r"<pre\b.*?</pre>", "", html, flags=re.S)


def test_no_literal_escaped_pipe_in_table_cells(site: Path) -> None:
    """A ``\\|`` in the Markdown of a table cell must not reach the reader."""
    bad = {
        page: cell[:80]
        for page, html in _pages(site).items()
        for cell in re.findall(r"<td\b[^>]*>(.*?)</td>", html, flags=re.S)
        if "\\|" in cell
    }
    assert bad == {}


def test_no_sphinx_role_leaks_as_text(site: Path) -> None:
    """Docstrings' ``:class:`X``` roles render as code, not as the role's text."""
    role = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|exc|mod|obj|const):")
    bad = {
        page: m.group(0) for page, html in _pages(site).items() if (m := role.search(_prose(html)))
    }
    assert bad == {}


def test_no_emphasis_inside_a_word(site: Path) -> None:
    """Underscores inside identifiers (``llm_datadist's``) never open or close emphasis:
    an ``<em>`` / ``<strong>`` glued to a letter on its outer side is one that did."""
    glued = re.compile(r"\w<(em|strong)>|</(em|strong)>\w")
    bad = {
        page: _prose(html)[m.start() - 40 : m.end() + 40]
        for page, html in _pages(site).items()
        if (m := glued.search(_prose(html)))
    }
    assert bad == {}


def test_lists_and_code_blocks_are_not_swallowed_by_a_paragraph(site: Path) -> None:
    """A list, a table or a code block right under a line of text needs a blank line
    before it in Markdown; without one it renders as one paragraph with ``- `` (or
    ``| a | b |``) in its text."""
    bad: dict[str, str] = {}
    for page, html in _pages(site).items():
        for para in re.findall(r"<p>(.*?)</p>", html, flags=re.S):
            swallowed = re.search(r"\n\s*(?:[-*+]|\d+\.) ", para) or re.search(
                r"(?:^|\n)\s*\|.*\|", para
            )
            if swallowed or '<div class="highlight">' in para:
                bad[page] = para[:120]
    assert bad == {}


def test_reference_is_split_with_the_main_classes_first(site: Path) -> None:
    sizes = {
        page: len(html.encode())
        for page, html in _pages(site).items()
        if page.startswith("reference/")
    }
    assert len(sizes) >= 8
    assert {p: s for p, s in sizes.items() if s > MAX_REFERENCE_PAGE} == {}
    # The navigation lists the reference pages in order: LLMDataDist, CacheManager and
    # aiokv.sync come first, after the reference's own index.
    html = (site / "reference" / "aiokv" / "index.html").read_text()
    order: list[str] = []
    for href in re.findall(r'href="\.\./([\w-]+)/"', html):
        if (REFERENCE / f"{href}.md").is_file() and href not in order:
            order.append(href)
    assert order[:4] == ["llmdatadist", "cachemanager", "sync", "sync-managers"], order


def test_home_page_is_a_front_door(site: Path) -> None:
    """The home page says what aiokv is, shows a short program, and points onward."""
    html = (site / "index.html").read_text()
    assert "KV" in html and "llm_datadist" in html
    code = re.findall(r"<pre\b.*?</pre>", html, flags=re.S)
    assert code, "no code on the home page"
    lines = re.sub(r"<[^>]+>", "", code[0]).strip().splitlines()
    assert 8 <= len(lines) <= 30
    for target in ("quickstart/", "concepts/", "api/", "reference/aiokv/", "why/"):
        assert f'href="{target}' in html, target


def test_home_page_program_runs_as_written(tmp_path: Path) -> None:
    program = re.findall(r"```python\n(.*?)```", (DOCS / "index.md").read_text(), re.S)[0]
    env = checkout_env()
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "pulled: True"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_page_certificates_link_and_pull(tmp_path: Path) -> None:
    """docs/tls.md's openssl recipe, run as written, makes files two participants link
    over (hostname checked) and pull through."""
    recipe = re.findall(r"```bash\n(.*?)```", (DOCS / "tls.md").read_text(), re.S)[0]
    make = ["bash", "-e", "-c", recipe]
    done = await asyncio.to_thread(
        subprocess.run, make, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr

    def config(name: str) -> LLMConfig:
        return make_config(
            "tcp",
            tls_cert_file=str(tmp_path / f"{name}.pem"),
            tls_key_file=str(tmp_path / f"{name}.key"),
            tls_ca_file=str(tmp_path / "ca.pem"),
            tls_check_hostname=True,
        )

    desc = CacheDesc(1, [4, 64], DataType.DT_UINT8)
    async with linked_pair(config("prefill"), config("decode")) as (p, d):
        src = await p.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        src.tensors[0][2].fill_(7)
        dst = await d.cache_manager.allocate_blocks_cache(desc)
        await d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [2], [1])
        assert dst.tensors[0][1].tolist() == [7] * 64


def test_no_heading_names_an_issue_or_a_run() -> None:
    """Headings name topics; history belongs in CHANGELOG.md and the benchmarks' history."""
    word = re.compile(
        r"issue|#\d|\bbranch|\bround\b|\b(?:first|second|third|fourth) run|"
        r"before ?/ ?after|the rework|withdrawn|"
        # the code names work was done under
        r"\b(?:nixlprep|nixlvram|nixlbench|gpunixl|docsite|fuzz|pack|grants|staging)\)",
        re.I,
    )
    bad = []
    for md in sorted(DOCS.rglob("*.md")):
        fence = False
        for line in md.read_text().splitlines():
            if line.startswith("```"):
                fence = not fence
            if not fence and re.match(r"#{1,6} ", line) and word.search(line):
                bad.append(f"{md.relative_to(ROOT)}: {line}")
    assert bad == []


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
