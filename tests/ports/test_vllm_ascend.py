"""vLLM-Ascend's LLMDataDistCMgrConnectorWorker on ``aiokv.sync`` (clients/
vllm_ascend_cmgr_worker.py): prefill and decode worker processes, metadata over TCP, a
two-sided link from two threads at once, pull_blocks on the executor thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from port_harness import assert_all_ok
from port_harness import free_ports
from port_harness import run_parties

SCRIPT = "vllm_ascend_cmgr_worker.py"


def rank_table(path: Path) -> str:
    """The DISAGGREGATED_PREFILL_RANK_TABLE_PATH file: one prefill, one decode device."""

    def device(device_id: str, cluster_id: str) -> dict[str, str]:
        return {
            "server_id": "127.0.0.1",
            "device_id": device_id,
            "device_ip": "127.0.0.1",
            "cluster_id": cluster_id,
        }

    path.write_text(
        json.dumps(
            {
                "prefill_device_list": [device("0", "1")],
                "decode_device_list": [device("1", "2")],
            }
        )
    )
    return str(path)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_cmgr_connector_worker_prefill_to_decode(tmp_path: Path, mla: bool) -> None:
    p_meta, d_meta, device_port = free_ports(3)
    env = {
        "DISAGGREGATED_PREFILL_RANK_TABLE_PATH": rank_table(tmp_path / "ranktable.json"),
        "VLLM_ASCEND_LLMDD_RPC_IP": "127.0.0.1",
        "AIOKV_DEVICE_PORT": str(device_port),
    }
    flags = ["--mla"] if mla else []
    # a worker's metadata port is VLLM_ASCEND_LLMDD_RPC_PORT + tp_size + tp_rank (tp=1)
    results = run_parties(
        {
            "prefill": [SCRIPT, "--kv_role", "kv_producer", *flags],
            "decode": [SCRIPT, "--kv_role", "kv_consumer", "--remote_port", str(p_meta), *flags],
        },
        env,
        25,
        party_env={
            "prefill": {"VLLM_ASCEND_LLMDD_RPC_PORT": str(p_meta - 1)},
            "decode": {"VLLM_ASCEND_LLMDD_RPC_PORT": str(d_meta - 1)},
        },
    )
    assert_all_ok(results)
    assert "kv_consumer finished request req-0" in results["decode"].output
    assert "kv_producer finished request req-0" in results["prefill"].output


def test_older_llmdatadist_connector_pulls_by_cache_ids_1_to_4(ports_env: dict[str, str]) -> None:
    """vLLM-Ascend's older LLMDataDistConnector (clients/vllm_ascend_llmdatadist_connector.py):
    legacy mode, the decode side pulls ``CacheKeyByIdAndIndex(cid, 1..4, 0)`` — the literal
    ids of the prefill side's four caches — with no remote-access option set."""
    script = "vllm_ascend_llmdatadist_connector.py"
    results = run_parties(
        {
            "prefill": [script, "--kv_role", "kv_producer"],
            "decode": [script, "--kv_role", "kv_consumer"],
        },
        ports_env,
        25,
    )
    assert_all_ok(results)
    assert "Successfully received all KVs" in results["decode"].output
    assert "Sample end" in results["prefill"].output
