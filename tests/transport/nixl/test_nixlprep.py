"""NIXL descriptor rows without per-block Python: layout views' address runs, pairing,
grant decoding, region look-up; and NIXL's default log level."""

from __future__ import annotations

import ctypes
import importlib
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from aiokv import LLMException
from aiokv._layout import ByteLayout
from aiokv._layout import LayoutViews
from aiokv._layout import address_of
from aiokv.testing import requires_transport
from aiokv.testing import skip_unless_transport
from aiokv.transport._base import flatten_views

needs_nixl = requires_transport("nixl")


def _descs():  # type: ignore[no-untyped-def]
    skip_unless_transport("nixl")
    return importlib.import_module("aiokv.transport.nixl._descs")


def _per_view(views: list[memoryview]) -> list[list[int]]:
    """The reference: one address look-up per view, neighbours merged."""
    out: list[list[int]] = []
    for v in views:
        a = address_of(v)
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += len(v)
        else:
            out.append([a, len(v)])
    return out


@pytest.mark.parametrize("seed", range(40))
def test_layout_views_know_their_runs(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([1, 16, 4096])
    nblocks = rng.randint(1, 80)
    stride = block + rng.choice([0, 0, 3])
    arena = bytearray(3 * (nblocks * stride + block))
    whole = memoryview(arena)
    ext = nblocks * stride + block
    # buffers: disjoint pieces of one arena, sometimes back to back (runs merge across)
    offs = [0, ext, 2 * ext] if rng.random() < 0.5 else [2 * ext, 0]
    buffers = [whole[o : o + ext] for o in offs]
    count = rng.randint(1, 2 * nblocks)
    blocks = np.array([rng.randrange(nblocks) for _ in range(count)], dtype=np.int64)
    if rng.random() < 0.5:
        blocks = np.arange(rng.randrange(nblocks), nblocks, dtype=np.int64)  # one run
    layout = ByteLayout.of_blocks(blocks, block, stride=stride)
    views = layout.views(buffers)
    assert isinstance(views, LayoutViews)
    assert views.total == sum(len(v) for v in views)
    assert views.runs().tolist() == _per_view(views)
    assert _descs().runs_of(list(views)).tolist() == _per_view(views)  # the plain path


def test_flatten_views_passes_layout_views_through() -> None:
    buf = memoryview(bytearray(64))
    views = ByteLayout.of_span(8, 16).views([buf, buf[32:]])
    assert isinstance(views, LayoutViews)
    out, total = flatten_views("op", views, writable=True)
    assert out is views and total == 32
    ro = ByteLayout.of_span(0, 8).views([memoryview(bytes(16))])
    assert isinstance(ro, LayoutViews) and ro.readonly
    assert flatten_views("op", ro, writable=False)[1] == 8
    with pytest.raises(LLMException, match="read-only"):
        flatten_views("op", ro, writable=True)
    # a buffer shorter than the layout's extent: no LayoutViews, the usual checks
    assert not isinstance(ByteLayout.of_span(0, 8).views([memoryview(bytearray(4))]), LayoutViews)


def _bytes_of(runs: np.ndarray) -> list[int]:
    return [a + i for a, n in runs.tolist() for i in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_pair_splits_at_common_boundaries(seed: int) -> None:
    d = _descs()
    rng = random.Random(seed)
    total = rng.randint(1, 300)

    def cut() -> np.ndarray:
        points = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 12))))
        lens = np.diff([0, *points, total])
        addrs = [rng.randrange(1 << 40) for _ in lens]
        return np.array(list(zip(addrs, lens, strict=True)), dtype=np.uint64)

    a, b = cut(), cut()
    la, lb = d.pair(a, b)
    assert la[:, 1].tolist() == lb[:, 1].tolist() and not la[:, 2].any()
    assert _bytes_of(la[:, :2]) == _bytes_of(a)  # byte i of one side meets byte i of the other
    assert _bytes_of(lb[:, :2]) == _bytes_of(b)


def test_grant_decoding_refuses_what_does_not_add_up() -> None:
    d = _descs()

    def meta(*runs: tuple[int, int]) -> bytes:
        return d.encode_grant(("DRAM", 0, np.array(runs, dtype=np.uint64).reshape(-1, 2)))

    assert d.decode_grant(meta((5, 10), (100, 6)), 16)[2].tolist() == [[5, 10], [100, 6]]
    assert d.decode_grant(meta((5, 10), (100, 0), (9, 6)), 16) is None  # an empty run
    assert d.decode_grant(meta((5, 2**64 - 1), (9, 17)), 16) is None  # wraps around
    assert d.decode_grant(meta((5, 10)), 11) is None
    assert d.decode_grant(meta((5, 10))[:8], 0) is None  # no run
    assert d.decode_grant(meta((5, 10))[:-3], 10) is None


@needs_nixl
def test_regions_cover_only_registered_ranges() -> None:
    from aiokv.transport.nixl._regions import Regions

    regions = Regions()

    def covers(*runs: tuple[int, int]) -> bool:
        return regions.covers(np.array(runs, dtype=np.uint64).reshape(-1, 2))

    assert not covers((10, 1))
    regions.add(100, 50, None)
    regions.add(200, 10, None)
    assert covers((100, 50), (200, 10), (120, 5))
    assert not covers((99, 2))  # starts before
    assert not covers((140, 11))  # runs past the end
    assert not covers((150, 50))  # the gap between two ranges
    assert not covers((100, 60))  # two ranges are not one
    assert not covers((100, 10), (160, 5))  # the lowest row inside a range, another not
    assert not covers((100, 10), (205, 6))  # ... nor past the end of the other range
    assert covers(*[(100 + i, 1) for i in range(50)])  # all inside one range
    assert not covers(*[(100 + i, 2) for i in range(50)])  # the last runs past its end
    regions.remove(200, 10)
    assert not covers((200, 10))


@needs_nixl
def test_nixl_is_quiet_unless_asked() -> None:
    """NIXL logs INFO lines to stdout; aiokv sets WARN unless the user chose a level."""
    code = (
        "from aiokv.transport.nixl._agent import Agent; Agent('quiet-test'); import os; "
        "print('level', os.environ['NIXL_LOG_LEVEL'])"
    )
    children = {}
    for level in (None, "INFO"):  # both at once: each child imports torch
        env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
        if level is not None:
            env["NIXL_LOG_LEVEL"] = level
        children[level] = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
        )
    for level, child in children.items():
        out, _ = child.communicate(timeout=60)
        assert f"level {level or 'WARN'}" in out
        assert ("NIXL INFO" in out) is (level == "INFO")


def test_address_of_reads_the_buffer_address() -> None:
    buf = (ctypes.c_char * 32)()
    mv = memoryview(buf).cast("B")
    assert address_of(mv) == ctypes.addressof(buf)
    assert address_of(mv[8:]) == ctypes.addressof(buf) + 8


@needs_nixl
@pytest.mark.parametrize("seed", range(8))
def test_a_few_paired_rows_are_described_as_the_numpy_path_does(seed: int) -> None:
    """A one-sided transfer of a few paired rows (a leased transfer of a few blocks) is
    described from Python ints: the same descriptors, kinds and byte count as the numpy
    path, which still decides (and raises for) everything else."""
    from types import SimpleNamespace

    from aiokv.transport import DeviceRuns
    from aiokv.transport.nixl import _plane
    from aiokv.transport.nixl._regions import Regions

    dram, vram = Regions(), Regions("VRAM", 1)
    for table in (dram, vram):
        table.add(1 << 20, 1 << 20, None)
        table.add(4 << 20, 1 << 20, None)
    tables = {"cpu": dram, "cuda:1": vram}
    owner = SimpleNamespace(agent=object(), _table=lambda device: tables.get(device))
    plane = _plane.NixlPlane(owner)  # type: ignore[arg-type]
    plane._link = SimpleNamespace(broken=False)  # type: ignore[assignment]
    plane.peer_agent = "peer"
    rng = random.Random(seed)
    described = 0
    for _ in range(300):
        count = rng.choice([1, 2, 3, rng.randint(1, _plane._FEW_ROWS + 8)])
        base = rng.choice([1 << 20, 4 << 20, 3 << 20])  # in a range, or in none
        lens = [rng.randint(1, 4096) for _ in range(count)]
        mine = [(base + rng.randrange(1 << 19), n) for n in lens]
        if rng.random() < 0.1:  # one row of another length: the numpy path pairs them
            mine[-1] = (mine[-1][0], mine[-1][1] + 1)
        theirs = [(rng.randrange(1 << 40), n) for n in lens]
        local = DeviceRuns(rng.choice(["cpu", "cuda:1"]), np.array(mine, dtype=np.uint64))
        remote = DeviceRuns(rng.choice(["cpu", "cuda:0"]), np.array(theirs, dtype=np.uint64))
        few = plane._few(local, remote)
        table = tables[local.device]
        expected = (
            count <= _plane._FEW_ROWS
            and [n for _, n in mine] == lens
            and table.covers(local.runs)
            and base != 3 << 20
        )
        assert (few is not None) == expected, (count, base, mine, lens)
        try:
            at = plane._at(local, remote)
        except LLMException:
            assert few is None
            continue
        if few is None:
            continue
        described += 1
        total, mems, local_rows, far_rows = few
        assert total == at[0] == sum(lens)
        assert mems == at[1]
        assert local_rows == [tuple(r) for r in at[2].tolist()]
        assert far_rows == [tuple(r) for r in at[3].tolist()]
        assert {d for *_, d in local_rows} == {table.dev}
    assert described > 50
