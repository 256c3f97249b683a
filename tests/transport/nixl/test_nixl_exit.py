"""A process that used the NIXL transport exits cleanly (status 0, no SIGSEGV at exit).

The ``nixl-cu12`` 1.5.1 wheel crashed every such process in ``_dl_fini`` on hosts with
rdma-core's ``ibverbs-providers`` (two ``libnl-route`` copies, see ``docs/api.md``
"NIXL"); on a host without them these tests pass either way. The program also reports
the UCX defaults the transport sets (``UCX_MODULES``, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``),
and that a value the user set wins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from aiokv.testing import requires_transport

needs_nixl = requires_transport("nixl")

_PROGRAM = textwrap.dedent(
    """
    import asyncio, os
    from aiokv import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig,
                       LLMDataDist, LLMRole, LLMStatusCode)

    DESC = CacheDesc(2, [8, 16, 4, 64], DataType.DT_FLOAT16)

    def cfg():
        return LLMConfig(device_type="cpu", enable_cache_manager=True,
                         listen_ip_info="127.0.0.1:0", transfer_backend="nixl",
                         mem_pool_cfg='{"memory_size": 16777216, "page_shift": 16}',
                         sync_kv_timeout=10_000)

    async def main():
        async with LLMDataDist(LLMRole.PROMPT, 1, cfg()) as p, \\
                LLMDataDist(LLMRole.DECODER, 2, cfg()) as d:
            src = await p.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1))
            for t in src.tensors:
                t.fill_(3)
            dst = await d.cache_manager.allocate_blocks_cache(DESC)
            info = LLMClusterInfo(
                remote_cluster_id=1,
                remote_ip_info=[p.listen_address],
                local_ip_info=[("127.0.0.1", 0)],
            )
            code, _ = await d.link_clusters([info], timeout=10_000)
            assert code == LLMStatusCode.LLM_SUCCESS, code
            await d.cache_manager.pull_blocks(BlocksCacheKey(1), dst, [0, 1], [2, 3])
            assert all(bool((t[2:4] == 3).all()) for t in dst.tensors)
        print("pulled", os.environ.get("UCX_MODULES"),
              os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"), flush=True)

    asyncio.run(main())
    """
)


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    unset = ("UCX_MODULES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )


@needs_nixl
def test_a_process_that_pulled_over_nixl_exits_zero() -> None:
    from aiokv.transport.nixl._agent import _has_cuda_driver

    done = _run({})
    assert "pulled " in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    # the defaults aiokv set: CUDA IPC GETs on where UCX can load its CUDA transports;
    # elsewhere none, or UCX warns on stderr that the variable is unused
    assert f"pulled ^efa {'y' if _has_cuda_driver() else None}" in done.stdout
    assert "unused environment variable" not in done.stderr, done.stderr[-2000:]


@needs_nixl
def test_ucx_settings_of_the_user_win() -> None:
    done = _run({"UCX_MODULES": "^efa,cuda", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"})
    assert "pulled ^efa,cuda auto" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
