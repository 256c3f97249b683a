"""Argument checks shared by every call: block lists and duplicates."""

from __future__ import annotations

import asyncio
import errno

import numpy as np
import pytest
import torch

from aiokv import LLMException
from aiokv import LLMStatusCode
from aiokv import NoneArgumentError
from aiokv._checks import MAX_BLOCK_INDEX
from aiokv._checks import check_blocks
from aiokv._checks import check_unique
from aiokv._checks import duplicated
from aiokv._errors import map_errors


def test_check_blocks_returns_a_read_only_int64_array() -> None:
    arr = check_blocks("op", "blocks", [3, 0, 7], 8)
    assert arr.dtype == np.int64 and arr.tolist() == [3, 0, 7]
    assert not arr.flags.writeable
    assert check_blocks("op", "blocks", (), 8).size == 0


@pytest.mark.parametrize("bad", [[1, True], [1, 1.0], [None], ["1"], [np.float32(1)]])
def test_check_blocks_refuses_what_is_not_an_int(bad: list[object]) -> None:
    with pytest.raises(TypeError):
        check_blocks("op", "blocks", bad, 8)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint16", "uint64"])
def test_check_blocks_takes_integer_arrays_as_a_copy(dtype: str) -> None:
    given = np.array([9, 3, 0, 7, 1], dtype=dtype)
    arr = check_blocks("op", "blocks", given, 10)
    assert arr.dtype == np.int64 and arr.tolist() == [9, 3, 0, 7, 1]
    assert not arr.flags.writeable and not np.shares_memory(arr, given)
    given[0] = 2  # the caller's array is theirs again once the call returned
    assert arr[0] == 9
    column = np.arange(40, dtype=dtype).reshape(20, 2)[:, 1]  # 1-D, strided
    assert check_blocks("op", "blocks", column, 40).tolist() == list(range(1, 40, 2))
    assert check_blocks("op", "blocks", np.empty(0, dtype=dtype), 8).size == 0


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 0], dtype=bool),
        np.array([1.0, 2.0]),
        np.array([[1, 2], [3, 4]]),
        np.array([1, 2], dtype=object),
        np.array(3),
    ],
)
def test_check_blocks_refuses_arrays_that_are_not_1d_integers(bad: np.ndarray) -> None:
    with pytest.raises(TypeError, match="1-D integer numpy array"):
        check_blocks("op", "blocks", bad, 8)


@pytest.mark.parametrize(
    ("bad", "worst"),
    [
        (np.array([0, -3, 2]), -3),
        (np.array([0, 8, 9], dtype=np.int32), 9),
        (np.array([1, 2**64 - 1], dtype=np.uint64), 2**64 - 1),
    ],
)
def test_check_blocks_refuses_array_entries_out_of_range(bad: np.ndarray, worst: int) -> None:
    with pytest.raises(LLMException) as err:
        check_blocks("op", "blocks", bad, 8)
    assert err.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert f"entry {worst} is out of range [0, 8)" in str(err.value)


@pytest.mark.parametrize("bad", [[0, -1], [2**63], [1, 2**64], [-(2**70), 1]])
def test_check_blocks_refuses_entries_outside_int64_range(bad: list[int]) -> None:
    # negative or too big: the one error and wording of an entry past the end
    with pytest.raises(LLMException, match="out of range") as err:
        check_blocks("op", "blocks", bad, MAX_BLOCK_INDEX + 1)
    assert err.value.status_code is LLMStatusCode.LLM_PARAM_INVALID


def test_check_blocks_names_the_entry_beyond_the_cache() -> None:
    with pytest.raises(LLMException) as err:
        check_blocks("op", "blocks", [0, 9, 8], 8)
    assert err.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert "entry 9" in str(err.value)


@pytest.mark.parametrize("pad", [0, 100])  # short lists in Python, long ones in numpy
@pytest.mark.parametrize("bad", [[-1], [2**63], [2**64, 3], [-(2**70), 2**70], [5, 8]])
def test_short_and_long_block_lists_are_refused_alike(pad: int, bad: list[int]) -> None:
    with pytest.raises(LLMException) as err:
        check_blocks("op", "blocks", [0] * pad + bad, 8)
    worst = min(bad) if min(bad) < 0 else max(bad)
    assert f"entry {worst} is out of range [0, 8)" in str(err.value)
    ok = check_blocks("op", "blocks", [0] * pad + [7, 1], 8)
    assert ok.dtype == np.int64 and ok.tolist()[-2:] == [7, 1] and not ok.flags.writeable


@pytest.mark.parametrize("pad", [0, 100])
def test_a_peer_block_list_takes_every_non_negative_int64(pad: int) -> None:
    """A peer's cache bounds nothing but the sign (it checks again): the largest
    int64 passes, a negative entry is refused, short list or long."""
    top = check_blocks("op", "blocks", [1] * pad + [MAX_BLOCK_INDEX], MAX_BLOCK_INDEX + 1)
    assert top.tolist()[-1] == MAX_BLOCK_INDEX
    with pytest.raises(LLMException, match="entry -2 is out of range"):
        check_blocks("op", "blocks", [1] * pad + [-2, MAX_BLOCK_INDEX], MAX_BLOCK_INDEX + 1)


@pytest.mark.parametrize("top", [10, 100_000, 2**62])  # counting and sorting branches
def test_duplicated_agrees_with_unique(top: int) -> None:
    rng = np.random.default_rng(top % 1000)
    for n in (0, 1, 2, 17, 4096):
        values = rng.integers(0, top, size=n, dtype=np.int64)
        assert duplicated(values) == (np.unique(values).size != n)
        distinct = np.unique(values)
        assert not duplicated(rng.permutation(distinct))
        if distinct.size:
            assert duplicated(np.append(distinct, distinct[-1]))


def test_check_unique_refuses_a_repeat() -> None:
    check_unique("op", "a block", np.array([5, 1, 3]))
    with pytest.raises(LLMException) as err:
        check_unique("op", "a block", np.array([5, 1, 5]))
    assert err.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert "a block appears twice: 5" in str(err.value)  # which one
    with pytest.raises(LLMException, match=r"appears twice: 2$"):  # the smallest of several
        check_unique("op", "a block", np.array([9, 2, 9, 2, 40_000]))


@pytest.mark.parametrize("bad", [{1, 2}, "12", 3, range(2), torch.tensor([1, 2])])
def test_check_blocks_names_what_a_block_list_may_be(bad: object) -> None:
    with pytest.raises(TypeError) as err:
        check_blocks("op", "blocks", bad, 8)
    assert "op: blocks must be a list or tuple of int or a 1-D integer numpy array" in str(
        err.value
    )
    assert ("t.tolist() or t.numpy()" in str(err.value)) == isinstance(bad, torch.Tensor)
    with pytest.raises(NoneArgumentError):
        check_blocks("op", "blocks", None, 8)


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (TimeoutError("slow"), LLMStatusCode.LLM_TIMEOUT),
        (MemoryError(), LLMStatusCode.LLM_OUT_OF_MEMORY),
        (ConnectionResetError("reset"), LLMStatusCode.LLM_LINK_FAILED),
        (OSError(errno.ENOMEM, "no memory"), LLMStatusCode.LLM_OUT_OF_MEMORY),
        (OSError(errno.EACCES, "denied"), LLMStatusCode.LLM_PARAM_INVALID),  # the default
        (RuntimeError("boom"), LLMStatusCode.LLM_PARAM_INVALID),
    ],
)
def test_map_errors_translates_foreign_errors(raised: Exception, code: LLMStatusCode) -> None:
    with pytest.raises(LLMException) as info, map_errors("op", LLMStatusCode.LLM_PARAM_INVALID):
        raise raised
    assert info.value.status_code is code
    assert info.value.__cause__ is raised
    assert str(info.value).startswith("op: ")


@pytest.mark.parametrize(
    "raised",
    [
        LLMException("ours", status_code=LLMStatusCode.LLM_LINK_BUSY),
        TypeError("t"),
        ValueError("v"),
        asyncio.CancelledError(),
        KeyboardInterrupt(),
    ],
)
def test_map_errors_lets_ours_and_cancellation_through(raised: BaseException) -> None:
    with pytest.raises(type(raised)) as info, map_errors("op"):
        raise raised
    assert info.value is raised
    with map_errors("op"):  # and a block that raises nothing is untouched
        pass
