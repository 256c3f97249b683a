"""The demo's figures agree with each other: what layer-wise sending "saved" is the
difference of the two medians of time to first token shown beside it, so a layer-wise
run slower than the serial one can never read as "99% of the transfer hidden"; and a run
whose rounds disagree is flagged as too noisy to say."""

from __future__ import annotations

from io import StringIO

import pytest
from rich.console import Console

from aiokv._demo import DemoOptions
from aiokv._demo._report import render
from aiokv._demo._run import DemoResult


def _result(serial: list[float], layerwise: list[float]) -> DemoResult:
    """Times in seconds; the serial rounds sent for 20 ms after a 80 ms prefill."""
    result = DemoResult(
        device="cpu",
        backend="tcp",
        tokens={0: [1, 2]},
        reference={0: [1, 2]},
        identical={0: True},
        prompt_lens={0: 8},
        decoder_of={0: 0},
        src_tables={0: [0]},
        dst_tables={0: [3]},
        bytes_moved=1 << 20,
        layers=2,
        compute=0.080,
        transfer=0.020,
        tail=0.0002,  # the sends ended right after the layer-wise prefill ...
        compute_layerwise=0.105,  # ... which itself ran slower
    )
    result.ttft_rounds = {"serial": serial, "layerwise": layerwise}
    result.ttft = {
        "serial": sorted(serial)[len(serial) // 2],
        "layerwise": sorted(layerwise)[len(layerwise) // 2],
        "colocated": 0.070,
    }
    return result


def _shown(result: DemoResult) -> str:
    out = StringIO()
    render(result, Console(file=out, width=200, color_system=None))
    return " ".join(out.getvalue().split())


def test_a_slower_layerwise_run_says_it_saved_nothing() -> None:
    # the run: 111.9 ms layer-wise vs 93.3 ms without overlap
    result = _result(serial=[0.0933, 0.0930, 0.0940], layerwise=[0.1119, 0.1110, 0.1125])
    assert result.saved < 0 and result.hidden < 0
    assert result.noise is None and result.faster_rounds == 0
    shown = _shown(result)
    assert "layer-wise 111.9 ms | without overlap 93.3 ms" in shown
    assert "layer-wise saved none: 18.6 ms slower" in shown
    assert "hidden" not in shown and "99%" not in shown
    assert "layer-wise slower in all 3 rounds" in shown


def test_a_faster_layerwise_run_shows_the_share_it_took_off_the_critical_path() -> None:
    result = _result(serial=[0.100, 0.101, 0.099], layerwise=[0.085, 0.084, 0.086])
    assert abs(result.saved - 0.015) < 1e-9 and abs(result.hidden - 0.75) < 1e-9
    shown = _shown(result)
    assert "15.0 ms of time to first token = 75% of the transfer time" in shown
    assert "layer-wise faster in all 3 rounds" in shown and "noisy" not in shown


def test_a_saving_larger_than_the_send_is_not_shown_as_a_share() -> None:
    """The layer-wise rounds' prefill ran shorter: what they "saved" exceeds the whole
    send, which says nothing of the overlap (seen as "530% of the transfer time")."""
    result = _result(serial=[0.100, 0.101, 0.099], layerwise=[0.060, 0.061, 0.059])
    result.compute_layerwise = 0.045
    assert result.hidden > 1
    shown = _shown(result)
    assert "%" not in shown.split("layer-wise saved")[1].split("verdict")[0]
    assert "40.0 ms of time to first token, more than the 20.0 ms send itself" in shown
    assert "prefill ran 35.0 ms shorter" in shown


def test_rounds_that_disagree_are_too_noisy_to_say() -> None:
    split = _result(serial=[0.100, 0.100, 0.100], layerwise=[0.090, 0.110, 0.095])
    assert split.noise == "layer-wise was faster in 2 of 3 rounds only"
    assert "too noisy to say: layer-wise was faster in 2 of 3 rounds only" in _shown(split)
    spread = _result(serial=[0.100, 0.200, 0.110], layerwise=[0.090, 0.180, 0.100])
    assert spread.noise is not None and "serial rounds' times to first token" in spread.noise
    assert "too noisy to say" in _shown(spread)


def test_rounds_is_an_option_in_range() -> None:
    assert DemoOptions().rounds == 3
    for bad in (1, 51):
        with pytest.raises(ValueError, match="--rounds"):
            DemoOptions(rounds=bad).check()
