"""Generate ``aiokv/_sync_gen.py``: the blocking methods of ``aiokv.sync``, written out.

Each public ``async def`` of the async classes below gets a blocking twin with the same
parameters, defaults, annotations and decorators, the async docstring's summary with a
link to its full contract, and a body that hands the call to the instance's engine thread.
Written out (not made at import time), type checkers and IDEs see real signatures. Like
httpcore's ``scripts/unasync.py``:

    python scripts/gen_sync.py           # rewrite aiokv/_sync_gen.py
    python scripts/gen_sync.py --check   # exit 1 if it is stale (tests run this)

Rerun it after adding or changing an ``async def`` of ``LLMDataDist``, ``CacheManager``
or ``CacheTask`` (a merge included). A class's methods include those of its bases
defined in aiokv (``CacheManager``'s parts, one module per job), the class's own first.
A public ``async def`` that has no blocking form (neither generated nor in
:data:`BY_HAND`) fails ``--check``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "aiokv" / "_sync_gen.py"


@dataclass(frozen=True)
class Face:
    """One async class and the mixin of blocking methods made from it."""

    module: str  # path under aiokv/ of the module that defines the class
    cls: str  # the async class
    mixin: str  # the generated class
    engine: str  # how a method reaches the engine (an expression on ``self``)


FACES = (
    Face("_layerwise.py", "CacheTask", "CacheTaskOps", "self._engine"),
    Face("_manager/__init__.py", "CacheManager", "CacheManagerOps", "self._engine"),
    Face("_datadist.py", "LLMDataDist", "LLMDataDistOps", 'self._engine("{name}")'),
)
#: async methods whose blocking form ``aiokv/sync.py`` writes by hand (``notifications``
#: is an async generator: its blocking form is a plain iterator, not one call)
BY_HAND = {"LLMDataDist": {"init", "finalize", "notifications"}}


def _package(path: str) -> list[str]:
    """The package of the module at ``path`` under aiokv/, as dotted parts."""
    return ["aiokv", *path.split("/")[:-1]]


def _absolute(path: str, node: ast.ImportFrom) -> str:
    """The dotted module ``node`` imports from, in the module at ``path`` under aiokv/."""
    if not node.level:
        return node.module or ""
    base = _package(path)[: len(_package(path)) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(tree: ast.Module, path: str) -> dict[str, str]:
    """name -> the import line that binds it at module level in ``tree`` (the module at
    ``path`` under aiokv/), written as ``aiokv/_sync_gen.py`` needs it."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = _absolute(path, node)
            if module.startswith("aiokv."):
                module = "." + module.removeprefix("aiokv.")
            for alias in node.names:
                name = alias.asname or alias.name
                found[name] = f"from {module} import {alias.name}" + (
                    f" as {alias.asname}" if alias.asname else ""
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = (alias.asname or alias.name).split(".")[0]
                found[name] = f"import {alias.name}" + (
                    f" as {alias.asname}" if alias.asname else ""
                )
    return found


def _names(nodes: list[ast.AST]) -> set[str]:
    """Names the expressions ``nodes`` use (annotations are strings here: parse them)."""
    out: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                out.add(sub.id)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                with contextlib.suppress(SyntaxError):
                    out |= _names([ast.parse(sub.value, mode="eval")])
    return out


def _forward(args: ast.arguments) -> str:
    """The call arguments that pass a method's parameters on unchanged."""
    parts = [a.arg for a in [*args.posonlyargs, *args.args][1:]]
    if args.vararg:
        parts.append(f"*{args.vararg.arg}")
    parts += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    if args.kwarg:
        parts.append(f"**{args.kwarg.arg}")
    return ", ".join(parts)


def _source(module: str) -> str | None:
    """The path under aiokv/ of the dotted ``module``, if it is one of aiokv's."""
    parts = module.split(".")
    if parts[0] != "aiokv":
        return None
    for path in ("/".join(parts[1:]) + ".py", "/".join([*parts[1:], "__init__.py"])):
        if (ROOT / "aiokv" / path).is_file():
            return path
    return None


def _async_methods(path: str, name: str) -> list[tuple[ast.AsyncFunctionDef, dict[str, str]]]:
    """The public ``async def`` methods of class ``name`` of the module at ``path`` under
    aiokv/, with the imports of the module each is written in: the class's own first,
    then those of its bases defined in aiokv, depth first, each name once (as Python
    resolves them for these mixins)."""
    found: list[tuple[ast.AsyncFunctionDef, dict[str, str]]] = []
    seen: set[str] = set()

    def visit(path: str, name: str) -> None:
        tree = ast.parse((ROOT / "aiokv" / path).read_text())
        bound = _imports(tree, path)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        for fn in cls.body:
            if (
                isinstance(fn, ast.AsyncFunctionDef)
                and not fn.name.startswith("_")
                and fn.name not in seen
            ):
                seen.add(fn.name)
                found.append((fn, bound))
        for base in cls.bases:
            if not isinstance(base, ast.Name):
                continue
            if any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
                visit(path, base.id)
                continue
            node = next(
                (
                    n
                    for n in tree.body
                    if isinstance(n, ast.ImportFrom)
                    and any((a.asname or a.name) == base.id for a in n.names)
                ),
                None,
            )
            where = None if node is None else _source(_absolute(path, node))
            if node is not None and where is not None:
                alias = next(a for a in node.names if (a.asname or a.name) == base.id)
                visit(where, alias.name)

    visit(path, name)
    return found


def _method(face: Face, fn: ast.AsyncFunctionDef) -> tuple[str, list[ast.AST]]:
    """The blocking twin of ``fn``, and the expressions whose names it needs."""
    used: list[ast.AST] = [*fn.decorator_list]
    all_args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    for extra in (fn.args.vararg, fn.args.kwarg):
        if extra is not None:
            all_args.append(extra)
    used += [a.annotation for a in all_args if a.annotation is not None]
    used += [d for d in [*fn.args.defaults, *fn.args.kw_defaults] if d is not None]
    if fn.returns is not None:
        used.append(fn.returns)
    blocking = ast.FunctionDef(
        name=fn.name,
        args=fn.args,
        body=[ast.Pass()],
        decorator_list=fn.decorator_list,
        returns=fn.returns,
        type_comment=None,
    )
    ast.fix_missing_locations(ast.copy_location(blocking, fn))
    head = ast.unparse(blocking).rsplit("\n", 1)[0]  # "def ...(...) -> T:" and decorators
    text = _docstring(face.cls, fn)
    body = '"""' + text.replace("\\", "\\\\") + '\n"""'
    engine = face.engine.format(name=fn.name)
    call = f"return {engine}.call(self._async.{fn.name}" + (
        f", {_forward(fn.args)})" if _forward(fn.args) else ")"
    )
    code = head + "\n" + textwrap.indent(body + "\n" + call, "    ")
    return textwrap.indent(code, "    "), used


def _docstring(cls: str, fn: ast.AsyncFunctionDef) -> str:
    """A blocking twin's docstring: the async method's summary (its first paragraph),
    then where its full contract is (the async method's own docstring, not a copy)."""
    summary = (ast.get_docstring(fn) or "").split("\n\n", 1)[0]
    target = f"aiokv.{cls}.{fn.name}"
    pointer = (
        f"Blocking form of [`{cls}.{fn.name}`][{target}]: the same arguments, result "
        "and errors, run on the instance's engine thread."
    )
    return f"{summary}\n\n{textwrap.fill(pointer, 88)}".strip()


def generate() -> str:
    """The text of ``aiokv/_sync_gen.py``."""
    classes: list[str] = []
    imports: set[str] = set()
    for face in FACES:
        methods = []
        hand = BY_HAND.get(face.cls, set())
        for fn, bound in _async_methods(face.module, face.cls):
            if fn.name in hand:
                continue
            text, used = _method(face, fn)
            methods.append(text)
            for name in _names(used):
                if name in bound:
                    imports.add(bound[name])
        engine_type = "Callable[[str], Engine]" if "(" in face.engine else "Engine"
        where = face.module.removesuffix("__init__.py")  # a package: its folder
        classes.append(
            f"class {face.mixin}:\n"
            f'    """The blocking methods of ``{face.cls}`` (``aiokv/{where}``)."""\n\n'
            "    __slots__ = ()\n"
            f"    _engine: {engine_type}\n"
            f"    _async: _Async{face.cls}\n\n" + "\n\n".join(methods)
        )
        module = face.module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        imports.add(f"from .{module} import {face.cls} as _Async{face.cls}")
    imports |= {
        "from collections.abc import Callable",
        "from ._engine import Engine",
    }
    header = (
        '"""GENERATED by scripts/gen_sync.py from the async classes: do not edit.\n\n'
        "The blocking methods of ``aiokv.sync``'s faces (mixed into its classes), with the\n"
        "async methods' signatures and docstrings. Regenerate: ``python scripts/gen_sync.py``;\n"
        "``--check`` (run by tests/test_sync_generated.py) fails when this file is stale.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
    )
    names = sorted(f.mixin for f in FACES)
    body = header + "\n".join(sorted(imports)) + f"\n\n__all__ = {names!r}\n\n\n"
    body += "\n\n\n".join(classes) + "\n"
    return _format(body)


def _format(text: str) -> str:
    """``text`` through ``ruff format`` and ``ruff check --fix`` (import order): the
    committed file is what they leave, so a check does not depend on line wrapping."""
    ruff = [sys.executable, "-m", "ruff"]
    name = "aiokv/_sync_gen.py"  # ruff's settings for that path, wherever it is written
    fixed = subprocess.run(
        [*ruff, "check", "--fix", "--quiet", "--select", "I,F401", "--stdin-filename", name, "-"],
        input=text, capture_output=True, text=True, cwd=ROOT, check=False,
    ).stdout or text  # fmt: skip
    return subprocess.run(
        [*ruff, "format", "--stdin-filename", name, "-"],
        input=fixed, capture_output=True, text=True, cwd=ROOT, check=True,
    ).stdout  # fmt: skip


def missing() -> list[str]:
    """Public async methods that have no blocking form in ``aiokv.sync``."""
    sys.path.insert(0, str(ROOT))
    import aiokv.sync as blocking

    out = []
    for face in FACES:
        for fn, _ in _async_methods(face.module, face.cls):
            if not callable(getattr(getattr(blocking, face.cls), fn.name, None)):
                out.append(f"{face.cls}.{fn.name}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args()
    text = generate()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is stale: run python scripts/gen_sync.py", file=sys.stderr)
            return 1
        gaps = missing()
        if gaps:
            print(f"no blocking form in aiokv.sync: {', '.join(gaps)}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
