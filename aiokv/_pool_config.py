"""``MemPoolConfig``: a memory pool's size and page size, as llm_datadist's JSON string
or a dict; and :func:`unknown_name`, the "did you mean" of every configuration error."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING
from typing import Any

from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from ._checks import parse_json
from ._errors import NoneArgumentError
from ._models import Model

__all__ = ["MemPoolConfig", "unknown_name"]


def unknown_name(what: str, name: object, valid: Iterable[str]) -> str:
    """``unknown <what> 'x'; did you mean 'y'? valid: ...`` (the nearest by difflib)."""
    names = sorted(valid)
    near = difflib.get_close_matches(str(name), names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else "."
    return f"unknown {what} {name!r}{hint} Valid: {', '.join(names)}"


#: what each ``MemPoolConfig`` key must be, for errors
_POOL_KEYS = {
    "memory_size": "an integer number of bytes (67108864 for 64 MiB)",
    "page_shift": "an integer, log2 of the page size in bytes (16 for 64 KiB pages)",
}


class MemPoolConfig(Model):
    """A memory pool: ``memory_size`` bytes served in pages of ``1 << page_shift`` bytes.

    ``MemPoolConfig.parse('{"memory_size": 1073741824, "page_shift": 16}')`` accepts
    llm_datadist's JSON string form.
    """

    if TYPE_CHECKING:

        def __init__(self, memory_size: int, page_shift: int = ...) -> None: ...

    _positional = ("memory_size", "page_shift")
    memory_size: int = Field(gt=0, le=1 << 48)
    page_shift: int = Field(default=16, ge=10, lt=31)

    @field_validator("memory_size", "page_shift", mode="before")
    @classmethod
    def _an_int(cls, value: Any, info: ValidationInfo) -> Any:
        """A value of the wrong kind (``"64MiB"``, ``1.5``) is a ``TypeError`` that says
        what the key must be; ``None`` is left to the None check."""
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            key = str(info.field_name)
            shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
            raise TypeError(f"MemPoolConfig: {key} must be {_POOL_KEYS[key]}, got {shown}")
        return value

    @model_validator(mode="after")
    def _fits(self) -> MemPoolConfig:
        if self.memory_size < self.page_size:
            raise ValueError(
                f"memory_size {self.memory_size} is smaller than one page ({self.page_size})"
            )
        return self

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return 1 << self.page_shift

    @classmethod
    def parse(cls, value: Any) -> MemPoolConfig:
        """Build from a ``MemPoolConfig``, a dict, or llm_datadist's JSON string.

        Raises:
            TypeError: wrong type (of the value or of a field).
            ValueError: bad JSON, unknown keys, or values out of range.
        """
        if isinstance(value, MemPoolConfig):
            return value
        if value is None:
            raise NoneArgumentError("MemPoolConfig: value must not be None")
        if isinstance(value, str):
            try:
                value = parse_json(value)
            except ValueError as exc:
                raise ValueError(f"MemPoolConfig: invalid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("MemPoolConfig: JSON must be an object")
        if not isinstance(value, dict):
            raise TypeError(f"MemPoolConfig: expected str, dict or MemPoolConfig, got {value!r}")
        for key, v in value.items():
            if key not in _POOL_KEYS:
                raise ValueError(f"MemPoolConfig: {unknown_name('key', key, _POOL_KEYS)}")
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"MemPoolConfig: {key} must be {_POOL_KEYS[key]}, got {v!r}")
        return cls(**value)

    def to_json(self) -> str:
        """llm_datadist's JSON string form."""
        return json.dumps({"memory_size": self.memory_size, "page_shift": self.page_shift})
