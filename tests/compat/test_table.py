"""docs/compat.md, the llm_datadist compatibility table, checked row by row against the
code: every member it lists exists in ``aiokv`` and ``aiokv.sync`` in the form it states."""

from __future__ import annotations

import enum
import inspect
import pathlib
import re

import pytest

import aiokv
import aiokv.sync

TABLE = pathlib.Path(__file__).parents[2] / "docs" / "compat.md"
ROW = re.compile(r"^\| `(\w+)(?:\.(\w+))?` \| ([^|]+) \| ([^|]+) \|")
FACADES = {"LLMDataDist", "CacheManager", "KvCacheManager", "CacheTask"}


def rows() -> list[tuple[str, str | None, str, str]]:
    out = []
    for line in TABLE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            cls, member, a, s = m.groups()
            out.append((cls, member, a.strip(), s.strip()))
    return out


def form(obj: object, name: str) -> str | None:
    """How ``obj`` offers ``name``: the words the table uses."""
    fields = getattr(obj, "model_fields", {})
    if name in fields:
        return "field"
    try:
        attr = inspect.getattr_static(obj, name)
    except AttributeError:
        return "attribute" if hasattr(obj, name) else None
    if isinstance(attr, property):
        return "property"
    if isinstance(attr, staticmethod):
        return "static method"
    if isinstance(attr, classmethod):
        return "class method"
    if inspect.iscoroutinefunction(attr):
        return "async"
    if inspect.isfunction(attr):
        return "method"
    return "member"


def test_the_table_lists_every_public_class() -> None:
    classes = {cls for cls, member, _, _ in rows() if member is None}
    assert len(rows()) > 130
    assert classes >= {"LLMDataDist", "CacheManager", "KvCacheManager", "LlmConfig", "LLMException"}
    for cls in classes:
        name = "LLMConfig" if cls == "LlmConfig" else cls
        assert name in aiokv.__all__ and name in aiokv.sync.__all__, cls


@pytest.mark.parametrize(("cls", "member", "a_form", "s_form"), [r for r in rows() if r[1]])
def test_each_member_has_the_stated_form(cls: str, member: str, a_form: str, s_form: str) -> None:
    name = "LLMConfig" if cls == "LlmConfig" else cls
    a, s = getattr(aiokv, name), getattr(aiokv.sync, name)
    if a_form == "attribute":  # set on the instance
        assert member in inspect.signature(a).parameters
        return
    assert form(a, member) == a_form, f"aiokv.{name}.{member}"
    if cls in FACADES:
        expected = "method" if s_form == "blocking" else s_form
        assert form(s, member) == expected, f"aiokv.sync.{name}.{member}"
        if s_form == "blocking":
            assert not inspect.iscoroutinefunction(getattr(s, member))
    else:
        assert s_form == "same" and s is a


@pytest.mark.parametrize(
    ("cls", "a_form"), [(r[0], r[2]) for r in rows() if r[2].startswith("enum")]
)
def test_enum_members(cls: str, a_form: str) -> None:
    enum_cls = getattr(aiokv, cls)
    assert issubclass(enum_cls, enum.Enum) and getattr(aiokv.sync, cls) is enum_cls
    for member in a_form.removeprefix("enum:").split(","):
        assert member.strip() in enum_cls.__members__, f"{cls}.{member.strip()}"
