"""The methods of :mod:`aiokv.sync`'s blocking faces, made from the async methods.

In a face class, ``pull_blocks = blocking(_AsyncCacheManager.pull_blocks)`` is a method
that runs ``self._async.pull_blocks(...)`` on the face's engine thread (``Engine.call``)
and returns its result. There is one implementation and one signature: type checkers
see the method as ``(self, <the async parameters>) -> <the async result>`` (a
``ParamSpec``, through :class:`FaceMethod`'s ``__get__``); at run time the class holds a
plain function whose ``inspect.signature`` is the async one's (``__wrapped__``) and whose
docstring is the async summary with a pointer to the async contract.

A face (the object ``self`` is) has ``_async``, the async object, and
``_engine_for(op)``, the engine to run operation ``op`` on (it raises when there is
none, e.g. before ``init``).
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any
from typing import Concatenate
from typing import Generic
from typing import ParamSpec
from typing import TypeVar
from typing import overload

from ._engine import blocking_caller

__all__ = ["FaceMethod", "blocking", "wrapping"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


#: how a docstring names the async method, and what it says of the face method
_BLOCKING = (
    "Blocking form of",
    "the same arguments, result and errors, run on the instance's engine thread.",
)
_WRAPPING = (
    "Blocking face of",
    "the same arguments and errors; it returns the blocking face of the result.",
)


class FaceMethod(Generic[P, R]):
    """A face's method made from the async ``method``: seen by type checkers as a method
    ``(self, *P) -> R``; on ``__set_name__`` it puts the plain function ``make(name)``
    (with the async method's name, signature and summary) in the class in its place, so a
    call costs what a hand-written method's does."""

    def __init__(
        self,
        method: Callable[..., Any],
        make: Callable[[str], Callable[..., Any]],
        how: tuple[str, str],
    ) -> None:
        self._method = method
        self._make = make
        self._how = how
        self._function: Callable[..., Any] | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        function = functools.wraps(self._method)(self._make(name))
        function.__module__ = owner.__module__
        function.__qualname__ = f"{owner.__qualname__}.{name}"
        function.__doc__ = self._doc(owner.__name__, name)
        self._function = function
        setattr(owner, name, function)

    def _doc(self, face: str, name: str) -> str:
        """The docstring: the async method's summary (its first paragraph), then where its
        full contract is (the async method's own docstring, not a copy)."""
        summary = textwrap.dedent((self._method.__doc__ or "").split("\n\n", 1)[0]).strip()
        kind, then = self._how
        pointer = f"{kind} [`{face}.{name}`][aiokv.{face}.{name}]: {then}"
        return f"{summary}\n\n{textwrap.fill(pointer, 88)}"

    @overload
    def __get__(self, face: None, owner: type) -> Callable[Concatenate[Any, P], R]: ...

    @overload
    def __get__(self, face: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, face: object, owner: type | None = None) -> Callable[..., Any]:
        """The function, bound to ``face`` (at run time a class holds the function
        itself, so its lookups never come here: only this object's outside a class do)."""
        if self._function is None:
            raise TypeError("a face method works only as a class attribute")
        bound: Callable[..., Any] = self._function.__get__(face, owner)
        return bound


def blocking(method: Callable[Concatenate[Any, P], Awaitable[R]]) -> FaceMethod[P, R]:
    """The blocking form of the async ``method``: the face's method of the same name
    awaits ``self._async.<name>(*args, **kwargs)`` on the engine thread and returns what
    it returns (its exception raised in the calling thread)."""

    def make(name: str) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._engine_for(name).call(getattr(self._async, name), *args, **kwargs)

        return call

    return FaceMethod(method, make, _BLOCKING)


def wrapping(
    method: Callable[Concatenate[Any, P], T], face: Callable[[Any, T], R]
) -> FaceMethod[P, R]:
    """The face of the plain (not async) ``method``: the face's method of the same name
    calls ``self._async.<name>(*args, **kwargs)`` in the calling thread and returns
    ``face(engine, result)`` (e.g. the blocking face of the object it returned). It runs
    as a blocking caller's (:func:`~aiokv._engine.blocking_caller`): what it starts never
    waits on a loop the calling thread may run, which a blocking wait would stall."""

    def make(name: str) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            engine = self._engine_for(name)
            with blocking_caller():
                result = getattr(self._async, name)(*args, **kwargs)
            return face(engine, result)

        return call

    return FaceMethod(method, make, _WRAPPING)
