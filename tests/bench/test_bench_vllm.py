"""``aiokv bench vllm``'s parts that run without vLLM (the run itself needs .venv-vllm)."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from aiokv._bench.vllm import _report
from aiokv.cli import app


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_command_says_where_to_run_it() -> None:
    result = CliRunner().invoke(app, ["bench", "vllm", "--quick"])
    assert result.exit_code == 1
    assert "setup_vllm.sh" in result.output


def test_report_gives_medians_and_ratios_per_prompt_length() -> None:
    times = {
        ("colocated", 128): [0.010, 0.030, 0.020],
        ("aiokv", 128): [0.004, 0.004, 0.100],
        ("nixl-connector", 128): [0.008, 0.008, 0.001],
        ("aiokv-nixl", 128): [0.002, 0.002, 0.002],
    }
    (row,) = _report(times, [128], 3, "m").as_dict()["first_token"]
    assert row["prompt tokens"] == 128
    assert row["colocated ms"] == pytest.approx(20.0)
    assert row["aiokv ms"] == pytest.approx(4.0)
    assert row["aiokv / nixl-connector"] == pytest.approx(0.5)
    assert row["aiokv-nixl / nixl-connector"] == pytest.approx(0.25)
    assert row["aiokv / colocated"] == pytest.approx(0.2)
    assert list(row)[1] == "colocated ms"


def test_report_compares_push_and_pull_as_the_client_sees_them() -> None:
    times = {("colocated", 64): [0.050], ("aiokv", 64): [0.010]}
    client = {
        ("colocated", 64): [0.050],
        ("aiokv", 64): [0.080, 0.060, 0.070],
        ("aiokv-push", 64): [0.035, 0.040, 0.030],
    }
    tables = _report(times, [64], 3, "m", client).as_dict()
    assert "aiokv-push ms" not in tables["first_token"][0]  # no decode-only figure for push
    (row,) = tables["client_first_token"]
    assert row["aiokv ms"] == pytest.approx(70.0)
    assert row["aiokv-push ms"] == pytest.approx(35.0)
    assert row["aiokv-push / aiokv"] == pytest.approx(0.5)
    assert list(row)[1] == "colocated ms"
    assert "client_first_token" not in _report(times, [64], 3, "m").as_dict()


def test_report_gives_the_kv_wait_alone_per_connector() -> None:
    times = {("aiokv", 256): [0.050], ("nixl-connector", 256): [0.040]}
    waits = {
        ("aiokv", 256): [0.030, 0.010, 0.020],
        ("aiokv-nixl", 256): [0.012, 0.012, 0.500],
        ("nixl-connector", 256): [0.010, 0.040, 0.030],
    }
    tables = _report(times, [256], 3, "m", None, waits).as_dict()
    (row,) = tables["kv_wait"]
    assert row["aiokv ms"] == pytest.approx(20.0)
    assert row["aiokv / nixl-connector"] == pytest.approx(20 / 30)
    assert row["aiokv-nixl / nixl-connector"] == pytest.approx(12 / 30)
    assert "kv_wait" not in _report(times, [256], 3, "m").as_dict()
