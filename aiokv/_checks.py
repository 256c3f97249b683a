"""Every argument rule, written once (SPEC §1.2).

Wrong type → ``TypeError``; ``None`` where an object is required →
``NoneArgumentError``; an int outside its range → ``ValueError``; well-typed but
semantically invalid (an index past the end, a block named twice) →
``LLMException(LLM_PARAM_INVALID)``. Every check returns the checked value so call
sites read ``n = check_int(...)``. Nothing here touches state: a failing check changes
nothing.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import NoReturn
from typing import TypeVar
from typing import cast

import numpy as np
import numpy.typing as npt

from ._enums import LLMStatusCode
from ._errors import LLMException
from ._errors import NoneArgumentError

__all__ = [
    "MAX_BLOCK_INDEX",
    "MAX_LAYER",
    "UINT64_MAX",
    "BlockList",
    "Blocks",
    "check_blocks",
    "check_index",
    "check_instance",
    "check_int",
    "check_layer_range",
    "check_list",
    "check_unique",
    "duplicated",
    "param_invalid",
    "parse_json",
    "renamed",
    "repeated",
    "tensor_range",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: The largest uint64: ids, keys and addresses travel as uint64.
UINT64_MAX = 2**64 - 1
#: Bound for block indices on a peer this side cannot see (they travel as int64).
MAX_BLOCK_INDEX = 2**63 - 1
#: Bound for a layer range's ``stop``: past any cache (at most 2**20 tensors), and small
#: enough for ``len()`` and every wire encoding (a bigger one was a raw ``OverflowError``).
MAX_LAYER = 2**31 - 1
# block lists up to this long are bounds-checked in plain Python (cheaper than numpy)
_FEW_BLOCKS: Final = 32

#: A validated block list: a read-only int64 array.
Blocks = npt.NDArray[np.int64]
#: A block list as callers give it: a list or tuple of ``int``, or a 1-D numpy array of
#: an integer dtype (checked and copied with a few numpy calls instead of a Python pass
#: over every entry: engines keep block tables as arrays).
BlockList = Sequence[int] | npt.NDArray[np.integer[Any]]


def param_invalid(op: str, reason: str) -> NoReturn:
    """Raise ``LLMException(LLM_PARAM_INVALID)`` naming ``op`` and ``reason``."""
    raise LLMException(f"{op}: {reason}", status_code=LLMStatusCode.LLM_PARAM_INVALID, op=op)


def check_instance(op: str, name: str, value: Any, expected: type[T] | tuple[type, ...]) -> T:
    """Return ``value`` if it is an instance of ``expected``.

    Raises:
        NoneArgumentError: ``value`` is ``None``.
        TypeError: ``value`` has another type.
    """
    if value is None:
        raise NoneArgumentError(f"{op}: {name} must not be None")
    if not isinstance(value, expected):
        want = (
            expected.__name__
            if isinstance(expected, type)
            else " | ".join(t.__name__ for t in expected)
        )
        raise TypeError(f"{op}: {name} must be {want}, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def check_int(op: str, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) within ``[lo, hi]``.

    Raises:
        NoneArgumentError: ``value`` is ``None``.
        TypeError: not an int.
        ValueError: outside ``[lo, hi]``.
    """
    if value is None:
        raise NoneArgumentError(f"{op}: {name} must not be None")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{op}: {name}={value} is out of range [{lo}, {hi}]")
    return int(value)


def check_index(op: str, name: str, value: Any, length: int) -> int:
    """Return ``value`` if it is a valid index into ``length`` items.

    Raises:
        TypeError / NoneArgumentError: as :func:`check_int`.
        LLMException: ``LLM_PARAM_INVALID`` when negative or ``>= length`` (one error,
            one wording, either side).
    """
    v = check_int(op, name, value)
    if not 0 <= v < length:
        param_invalid(op, f"{name}={v} is out of range [0, {length})")
    return v


def check_list(op: str, name: str, value: Any, item: type | tuple[type, ...]) -> list[Any]:
    """Return ``value`` (a list or tuple whose items are all ``item``) as a new list.

    Raises:
        NoneArgumentError / TypeError: ``value`` or one of its items has the wrong type.
    """
    check_instance(op, name, value, (list, tuple))
    for i, v in enumerate(value):
        check_instance(op, f"{name}[{i}]", v, item)
    return list(value)


def check_blocks(op: str, name: str, value: Any, nblocks: int) -> Blocks:
    """Return the block list ``value`` as an int64 array, every entry in ``[0, nblocks)``.

    ``value``: a list or tuple of ``int`` (not ``bool``), or a 1-D numpy array of an
    integer dtype (not ``bool``), which is copied: the caller may change it once the
    call returns or while its operation runs.

    Args:
        nblocks: how many blocks the cache has; :data:`MAX_BLOCK_INDEX` + 1 for a peer's
            cache whose size only the peer knows (it checks again).

    Raises:
        NoneArgumentError / TypeError: not a list/tuple of ints nor a 1-D integer array.
        LLMException: ``LLM_PARAM_INVALID`` for an entry out of ``[0, nblocks)``,
            negative or too big alike (one error, one wording).
    """
    bound = str(nblocks) if nblocks <= MAX_BLOCK_INDEX else "the peer cache's block count"
    if isinstance(value, np.ndarray):
        return _block_array(op, name, value, nblocks, bound)
    if not isinstance(value, (list, tuple)):
        check_instance(op, name, value, object)  # None: NoneArgumentError
        raise TypeError(
            f"{op}: {name} must be a list or tuple of int or a 1-D integer numpy array, got "
            f"{type(value).__name__}"
            + (" (a torch tensor: pass t.tolist() or t.numpy())" if _is_tensor(value) else "")
        )
    if not set(map(type, value)) <= {int}:  # plain ints (the usual case) need no loop
        for i, b in enumerate(value):
            if isinstance(b, bool) or not isinstance(b, int):
                check_int(op, f"{name}[{i}]", b)  # raises the right error for the type
    if not value:
        return np.empty(0, dtype=np.int64)
    arr = None
    if len(value) <= _FEW_BLOCKS:  # Python's min/max: numpy's cost a call (~3 µs) is fixed
        lo, hi = min(value), max(value)
    else:
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:  # beyond int64 either way: name the worst entry
            lo, hi = min(value), max(value)
            bad = lo if lo < 0 else hi
            param_invalid(op, f"{name} entry {bad} is out of range [0, {bound})")
        # one reduction: a negative entry's bits as uint64 are >= 2**63 >= nblocks
        if int(arr.view(np.uint64).max()) < nblocks:
            arr.flags.writeable = False
            return arr
        lo, hi = int(arr.min()), int(arr.max())
    _check_bounds(op, name, lo, hi, nblocks, bound)
    if arr is None:
        arr = np.array(value, dtype=np.int64)  # in [0, nblocks <= 2**63): fits
    arr.flags.writeable = False
    return arr


def _is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch for the question)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy")


def _block_array(op: str, name: str, value: npt.NDArray[Any], nblocks: int, bound: str) -> Blocks:
    """:func:`check_blocks` of a numpy array: two reductions and one copy."""
    if value.ndim != 1 or value.dtype.kind not in "iu":
        raise TypeError(
            f"{op}: {name} must be a list or tuple of int or a 1-D integer numpy array, "
            f"got a {value.ndim}-D array of {value.dtype}"
        )
    if value.size:
        _check_bounds(op, name, int(value.min()), int(value.max()), nblocks, bound)
    arr = value.astype(np.int64)  # a copy, and in [0, nblocks <= 2**63): fits
    arr.flags.writeable = False
    return arr


def _check_bounds(op: str, name: str, lo: int, hi: int, nblocks: int, bound: str) -> None:
    """Refuse a block list whose smallest entry ``lo`` or largest ``hi`` is outside
    ``[0, nblocks)``, naming it."""
    if lo < 0:
        param_invalid(op, f"{name} entry {lo} is out of range [0, {bound})")
    if hi >= nblocks:
        param_invalid(op, f"{name} entry {hi} is out of range [0, {bound})")


def duplicated(values: Blocks) -> bool:
    """Whether the non-negative ``values`` name an entry twice: a count per entry when
    the largest is within a small multiple of their number (7 µs for 4096 entries), else
    a sort (15x slower); both bounded by the input's size."""
    if values.size < 2:
        return False
    if int(values.max()) < 16 * values.size + 4096:
        return bool(np.bincount(values).max() > 1)
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def repeated(values: Blocks) -> int | None:
    """The smallest entry the non-negative ``values`` name twice; None if none is
    (:func:`duplicated`'s cost; a sort only when there is one)."""
    if not duplicated(values):
        return None
    ordered = np.sort(values)
    return int(ordered[1:][ordered[1:] == ordered[:-1]][0])


def check_unique(op: str, what: str, values: Blocks) -> None:
    """Refuse a list naming the same entry twice (``LLM_PARAM_INVALID``, naming the
    smallest such entry)."""
    if (twice := repeated(values)) is not None:
        param_invalid(op, f"{what} appears twice: {twice}")


def check_layer_range(op: str, name: str, value: Any) -> range | None:
    """Return ``value`` if it is ``None`` or a non-empty ``range`` with step 1 within
    ``[0, MAX_LAYER]``.

    Raises:
        TypeError: not a range.
        LLMException: ``LLM_PARAM_INVALID`` for an empty, stepped, negative or huge range.
    """
    if value is None:
        return None
    check_instance(op, name, value, range)
    # ``not value``, not ``len(value)``: len() of a range past 2**63 raises OverflowError
    if value.step != 1 or value.start < 0 or not value or value.stop > MAX_LAYER:
        param_invalid(op, f"{name} {value} must be non-empty with step 1, within [0, {MAX_LAYER}]")
    r: range = value
    return r


def tensor_range(op: str, ntensors: int, layers: range | None, per_layer: int) -> range:
    """Tensor indices of layer range ``layers`` (layer ``i`` = tensors ``[i*n, (i+1)*n)``).

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` if ``per_layer`` does not divide the tensor
            count or the layers fall outside the cache.
    """
    if layers is None:
        return range(ntensors)
    if per_layer < 1 or per_layer > ntensors or ntensors % per_layer:
        param_invalid(op, f"tensor_num_per_layer {per_layer} does not divide {ntensors} tensors")
    if layers.step != 1 or layers.start < 0 or layers.stop * per_layer > ntensors or not layers:
        param_invalid(op, f"layer range {layers} is outside 0..{ntensors // per_layer - 1}")
    return range(layers.start * per_layer, layers.stop * per_layer)


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """Also accept each keyword ``old`` for the parameter ``new`` (today's names kept
    working beside llm_datadist's): the same function, the keyword renamed on the way in.

    Raises (from the decorated call):
        TypeError: both spellings given.
    """

    def rename(name: str, kwargs: dict[str, Any]) -> None:
        for old, new in old_to_new.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{name}: give {new} or {old}, not both")
                kwargs[new] = kwargs.pop(old)

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def coro(*args: Any, **kwargs: Any) -> Any:
                if kwargs:
                    rename(fn.__name__, kwargs)
                return await fn(*args, **kwargs)

            return cast(F, coro)

        @functools.wraps(fn)
        def plain(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                rename(fn.__name__, kwargs)
            return fn(*args, **kwargs)

        return cast(F, plain)

    return decorate


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``), or nested too deep for the
            decoder (a ``RecursionError`` from ``json``, as a ``ValueError`` too).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
