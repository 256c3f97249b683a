"""The public surface: one ``__all__``, derived by walking the package, nothing drifts."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType

import aiokv

#: modules that are programs (the CLI, the demo, benchmarks, examples), not libraries
SCRIPTS = ("aiokv.__main__", "aiokv.cli", "aiokv._demo", "aiokv._bench", "aiokv.examples")


#: modules that import an optional dependency (module -> the dependency): checked only
#: where it is installed
OPTIONAL = {"aiokv.integrations.vllm._connector": "vllm"}
#: names of a module's ``__all__`` that need an optional dependency (loaded lazily)
OPTIONAL_NAMES = {("aiokv.integrations.vllm", "AiokvConnector"): "vllm"}


def _missing(dependency: str | None) -> bool:
    return dependency is not None and importlib.util.find_spec(dependency) is None


def _modules() -> list[ModuleType]:
    mods = [aiokv]
    for info in pkgutil.walk_packages(aiokv.__path__, "aiokv."):
        if not _missing(OPTIONAL.get(info.name)):
            mods.append(importlib.import_module(info.name))
    return mods


def _is_private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split(".")[1:])


def test_every_module_declares_its_surface() -> None:
    for mod in _modules():
        assert mod.__doc__, f"{mod.__name__} has no docstring"
        names = getattr(mod, "__all__", None)
        if mod.__name__.startswith(SCRIPTS):
            continue  # entry points and examples, not libraries
        assert names is not None, f"{mod.__name__} has no __all__"
        for name in names:
            if _missing(OPTIONAL_NAMES.get((mod.__name__, name))):
                continue
            assert hasattr(mod, name), f"{mod.__name__}.__all__ names missing {name!r}"


def test_top_level_all_is_exactly_the_public_namespace() -> None:
    submodules = {m.__name__.split(".")[1] for m in _modules() if m is not aiokv}
    # (not identifiers: pytest's assertion rewriting adds "@py_builtins" and "@pytest_ar"
    # to modules of a distribution that has a pytest plugin, as aiokv has: aiokv.testing)
    # dir(): the names loaded so far and those loaded on first use (module __getattr__)
    names = {n for n in dir(aiokv) if n.isidentifier()}
    public = {n for n in names if not n.startswith("_")} - submodules
    assert public == set(aiokv.__all__) - {"__version__"}
    assert len(aiokv.__all__) == len(set(aiokv.__all__))
    for name in aiokv.__all__:
        obj = getattr(aiokv, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        # defined in a private module, re-exported here: one public surface
        assert _is_private(obj.__module__), f"{name} is defined in public {obj.__module__}"
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_type_checkers_see_every_lazily_loaded_name_from_its_module() -> None:
    """The type-checking imports of ``aiokv/__init__.py`` (what mypy and IDEs see) name
    exactly the public names of the table the lazy loading reads, each from the module
    that table gives and re-exported explicitly (``import X as X``)."""
    tree = ast.parse(Path(aiokv.__file__).read_text())
    [block] = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_typing.TYPE_CHECKING"
    ]
    seen: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported"
            seen.setdefault(node.module, set()).add(alias.name)
    assert seen == {home: set(names) for home, names in aiokv._NAMES.items()}


def test_public_methods_are_documented() -> None:
    for name in aiokv.__all__:
        obj = getattr(aiokv, name)
        if not inspect.isclass(obj) or issubclass(obj, BaseException | int):
            continue
        # its own members and those of the aiokv classes it is made of (CacheManager's parts)
        parts = [c for c in obj.__mro__ if c.__module__.startswith("aiokv")]
        for attr, member in {k: v for c in parts for k, v in vars(c).items()}.items():
            if attr.startswith("_") or not callable(member):
                continue
            assert inspect.getdoc(getattr(obj, attr)), f"{name}.{attr} has no docstring"


def test_manager_operations_are_async() -> None:
    # transfer_cache_async returns its CacheTask at once, as llm_datadist's (issue #8)
    sync = {"get_pool_stats", "statistics", "transfer_cache_async", "check_cache_key"}
    sync |= {"is_initialized", "get_cache_tensors"}
    for cls in (aiokv.CacheManager, aiokv.KvCacheManager):
        ops = [n for n, m in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
        assert len(ops) >= 17
        for op in ops:
            assert inspect.iscoroutinefunction(getattr(cls, op)) == (op not in sync), op
    for op in ("init", "finalize", "link_clusters", "unlink_clusters"):
        assert inspect.iscoroutinefunction(getattr(aiokv.LLMDataDist, op)), op


def test_legacy_manager_keeps_the_signatures() -> None:
    # the role gates are a table: KvCacheManager overrides no operation (it only adds
    # llm_datadist's legacy-only is_initialized / get_cache_tensors)
    own = {n for n in vars(aiokv.KvCacheManager) if not n.startswith("_")}
    assert own == {"is_initialized", "get_cache_tensors"}
    assert not own & set(dir(aiokv.CacheManager))
    assert inspect.signature(aiokv.KvCacheManager.pull_blocks) == inspect.signature(
        aiokv.CacheManager.pull_blocks
    )


def test_kv_cache_alias_and_exception_shape() -> None:
    assert aiokv.KvCache is aiokv.Cache
    exc = aiokv.LLMException("op: why", status_code=aiokv.LLMStatusCode.LLM_TIMEOUT)
    assert aiokv.LLMException("op: why").status_code == aiokv.LLMStatusCode.LLM_SUCCESS
    assert isinstance(exc, RuntimeError) and exc.status_code == 0x5010B000 + 26
    assert issubclass(aiokv.NoneArgumentError, TypeError)
    assert issubclass(aiokv.NoneArgumentError, AttributeError)
