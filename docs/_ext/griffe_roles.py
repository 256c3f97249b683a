"""A griffe extension for the API reference: the package's docstrings use Sphinx roles
(``:class:`CacheKey```, ``:meth:`~aiokv.transport.Link.move_at```), which Markdown
would print as text. Each role becomes a code span of its target; a leading ``~``
keeps only the last dotted part, as Sphinx does. Loaded by mkdocs.yml
(``extensions: [docs/_ext/griffe_roles.py]``); the docstrings themselves are unchanged."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|exc|mod|obj|const):`([^`]+)`")


def _target(match: re.Match[str]) -> str:
    text = match.group(1)
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def strip_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role replaced by a code span."""
    return _ROLE.sub(_target, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles in every docstring griffe loads, before mkdocstrings renders it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(obj.docstring.value)
