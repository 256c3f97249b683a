"""The package's import graph has no circle: no module of aiokv imports, directly or
through others, a module that imports it back (import-time imports; ``TYPE_CHECKING``
blocks included, as grimp reads them). import-linter's contracts (``lint-imports``)
keep the layers; this keeps every module out of a loop, layered or not."""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp", reason="a development tool: pip install -e '.[dev]'")


def test_aiokv_has_no_import_circle() -> None:
    graph = grimp.build_graph("aiokv", include_external_packages=False)
    circles = sorted(
        (module, imported)
        for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if graph.chain_exists(importer=imported, imported=module)
    )
    assert circles == [], f"import circles (module, imports): {circles}"
