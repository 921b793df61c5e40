"""`convert --dry-run`'s memory estimate for a calibration on CUDA against what the H100 run measured
(benchmarks/gpu/measured/h100-2026-11-26.json: Llama-3.2-1B and Llama-3-8B-shaped layouts, the calibrated kinds):
the estimate must not promise less host memory than a run took. Before the CUDA runtime term it was 1.2-2.2x short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from surgery.estimate import Throughput
from surgery.kinds import get_kind, options_for

MEASURED = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "measured"
                       / "h100-2026-11-26.json").read_text())


def estimate(row: dict):
    kind, values = MEASURED["kinds"][row["kind"]]
    rate = Throughput("cuda", 5e13, 5e13)  # the seconds are not under test: no device to probe here
    return get_kind(kind).calibration_estimate(MEASURED["layouts"][row["layout"]], options_for(kind, **values),
                                               dtype="bfloat16", device="cuda", throughput=rate)


@pytest.mark.parametrize("row", MEASURED["conversions"], ids=lambda r: r["step"])
def test_the_host_estimate_covers_the_measured_peak(row):
    e = estimate(row)
    assert e.host_bytes >= row["peak_host_rss_bytes"], (e.host_bytes, row["peak_host_rss_bytes"])
    assert e.memory["cuda runtime (host)"] > 0


@pytest.mark.parametrize("row", MEASURED["conversions"], ids=lambda r: r["step"])
def test_the_device_estimate_is_within_a_fifth_of_the_measured_peak(row):
    """The device side, after counting the tensor being cast on the device: the 8B-shaped aligned merge still peaked
    above it (the rest is not yet explained without a profile), so this asserts closeness, not an upper bound."""
    e = estimate(row)
    assert 0.6 <= row["peak_device_bytes"] / e.device_bytes <= 1.2, row["peak_device_bytes"] / e.device_bytes
