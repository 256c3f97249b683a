"""Block-pair planning: ``coalesce`` reconstructs its input exactly."""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from aiokv._copy import coalesce

pair_lists = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40))
    | st.integers(0, 30).map(lambda i: (i, i + 5)),
    max_size=60,
)


def expand(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(s + k, d + k) for s, d, n in runs for k in range(n)]


@settings(max_examples=300, deadline=None)
@given(pairs=pair_lists, seed=st.integers(0, 2**16))
def test_coalesce_reconstructs_pairs_exactly(pairs: list[tuple[int, int]], seed: int) -> None:
    runs = coalesce(pairs)
    assert sorted(expand(runs)) == sorted(pairs)
    assert all(n >= 1 for _, _, n in runs)
    assert [(s, d) for s, d, _ in runs] == sorted((s, d) for s, d, _ in runs)
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    assert coalesce(shuffled) == runs
    for (s0, d0, n0), (s1, d1, _) in itertools.pairwise(runs):
        assert (s1, d1) != (s0 + n0, d0 + n0), "adjacent runs should have merged"


def test_coalesce_examples() -> None:
    assert coalesce([]) == []
    assert coalesce([(5, 9), (3, 7), (4, 8)]) == [(3, 7, 3)]
    # a duplicate stays a separate entry and never extends a run twice
    assert coalesce([(1, 2), (2, 3), (2, 3)]) == [(1, 2, 2), (2, 3, 1)]
    # consecutive on one side only is not a run
    assert coalesce([(0, 0), (1, 5)]) == [(0, 0, 1), (1, 5, 1)]
    big = 1 << 40  # beyond the packed-key fast path
    assert coalesce(iter([(big + 1, 2), (big, 1)])) == [(big, 1, 2)]
