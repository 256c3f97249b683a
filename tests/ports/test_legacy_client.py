"""A legacy-mode client (``kv_cache_manager``, no memory pool, no enable_cache_manager)
in the shape of llm_datadist's basic prompt.py / decoder.py, on ``aiokv.sync``."""

from __future__ import annotations

from port_harness import assert_all_ok
from port_harness import run_parties

SCRIPT = "legacy_kv_cache_manager_sample.py"


def test_legacy_prompt_decoder_pull_copy_get_tensors(ports_env: dict[str, str]) -> None:
    results = run_parties(
        {"prompt": [SCRIPT, "--role", "p"], "decoder": [SCRIPT, "--role", "d"]}, ports_env, 25
    )
    assert_all_ok(results)
    assert "[pull_cache] success" in results["decoder"].output
    assert "Sample end" in results["decoder"].output
    assert "Sample end" in results["prompt"].output
