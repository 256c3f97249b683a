"""A griffe extension for the API reference: ``aiokv.sync``'s blocking methods are made
from the async ones (``pull_blocks = blocking(_AsyncCacheManager.pull_blocks)``, see
``aiokv/_blocking.py``), which griffe's static reading sees as attributes. Each becomes
the method it is at run time: the async method's parameters and return annotation, and
the run-time docstring (the async summary and a link to the async contract). Loaded by
mkdocs.yml (``extensions: [docs/_ext/griffe_blocking.py]``)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

#: the calls in aiokv/sync.py that make a face's method from an async one
_MAKERS = ("blocking(", "wrapping(")


class BlockingMethods(griffe.Extension):
    """Replaces each made method of ``aiokv.sync``'s classes by a griffe ``Function``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "aiokv" or "sync" not in pkg.members:
            return
        runtime = importlib.import_module("aiokv.sync")
        for cls in pkg["sync"].classes.values():
            for name, member in list(cls.members.items()):
                value = getattr(member, "value", None)
                if member.is_attribute and str(value).startswith(_MAKERS):
                    made = getattr(getattr(runtime, cls.name), name)
                    cls.set_member(name, _function(pkg, name, made, member))


def _function(pkg: griffe.Module, name: str, made: Any, member: griffe.Object) -> griffe.Function:
    """The griffe function for the run-time method ``made``: the parameters and return
    of the async method it wraps (found in ``pkg``; copies, so that the async method
    keeps its own, and its annotations resolve where they were written), its own
    docstring."""
    target = inspect.unwrap(made)
    path = f"{target.__module__}.{target.__qualname__}".removeprefix("aiokv.")
    source = pkg[path]
    function = griffe.Function(
        name,
        lineno=member.lineno,
        endlineno=member.endlineno,
        parameters=griffe.Parameters(
            *(
                griffe.Parameter(p.name, annotation=p.annotation, kind=p.kind, default=p.default)
                for p in source.parameters
            )
        ),
        returns=source.returns,
    )
    function.docstring = griffe.Docstring(made.__doc__, parent=function)
    return function
