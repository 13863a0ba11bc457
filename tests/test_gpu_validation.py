"""The caching-allocator model against real H100 runs: the request streams PyTorch's own allocator recorded during
the committed validation runs (fit/validation/h100, python -m fit.gpu_validate --events), replayed through
estimator.caching_allocator, give torch.cuda.max_memory_allocated() and max_memory_reserved() of those runs."""
import json
from pathlib import Path

import pytest

from estimator.caching_allocator import replay
from fit.gpu_campaign import CampaignError
from fit.gpu_validate import read_events, snapshot_events, write_events

H100 = Path(__file__).resolve().parent.parent / "fit" / "validation" / "h100"
RUNS = sorted(p.parent.name for p in H100.glob("*/measured.json"))


def test_the_twelve_validation_runs_are_committed():
    assert len(RUNS) == 12
    assert {c["config"] for c in json.loads((H100 / "validation.json").read_text())["rows"]} == set(RUNS)


@pytest.mark.parametrize("name", RUNS)
def test_allocator_model_gives_the_gpu_peaks_to_the_byte(name):
    meas = json.loads((H100 / name / "measured.json").read_text())
    events = read_events(str(H100 / name / "allocator_events.txt.xz"))
    st = replay(events)
    assert st["peak_allocated_bytes"] == meas["peak_allocated"]
    assert st["peak_reserved_bytes"] == meas["peak_reserved"]
    # Not a trivial stream: thousands of requests, and the cache holds more than is allocated at its peak.
    assert len(events) > 3000 and meas["peak_reserved"] > meas["peak_allocated"]


def test_snapshot_events_round_trip(tmp_path):
    trace = [{"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0},
             {"action": "alloc", "addr": 100, "size": 1792, "stream": 0},
             {"action": "alloc", "addr": 200, "size": 3 << 20, "stream": 0},
             {"action": "free_requested", "addr": 100, "size": 1792, "stream": 0},
             {"action": "free_completed", "addr": 100, "size": 1792, "stream": 0},
             {"action": "alloc", "addr": 100, "size": 512, "stream": 0},     # an address reused: a new id
             {"action": "free_completed", "addr": 999, "size": 4, "stream": 0}]   # allocated before recording
    ev = snapshot_events({"device_traces": [trace], "segments": []})
    assert ev == [("a", 0, 1792), ("a", 1, 3 << 20), ("f", 0), ("a", 2, 512)]
    path = str(tmp_path / "e.txt.xz")
    write_events(path, ev)
    assert read_events(path) == ev

    with pytest.raises(CampaignError, match="more than one device or stream"):
        snapshot_events({"device_traces": [trace + [{"action": "alloc", "addr": 5, "size": 8, "stream": 7}]]})
    import lzma
    with lzma.open(path, "wt") as fh:
        fh.write("a 0 512\nx 1\n")
    with pytest.raises(CampaignError, match=r"e.txt.xz:2: not an allocator event"):
        read_events(path)


def test_default_estimate_meets_the_gpu_target_on_the_held_out_runs():
    """The estimate (default set, with what the install implies: --torch-adam, no TE workspace; with the kernel
    families each run recorded, as the benchmark does) against each run's max_memory_allocated: within 2% and under
    by at most 1% (the target of the published dev set), on all 12."""
    from benchmarks.gpu_validation import GRID, allocator_check, estimate, recorded_kernels
    from fit.campaign import load_grid
    from fit.gpu_validate import install_adjustments
    adjust = install_adjustments(json.loads((H100 / "validation.json").read_text())["install"])
    assert adjust[0] == ["--torch-adam"]     # that H100 had no Transformer Engine
    flags = {c.name: c.argv for c in load_grid(GRID)[1]}
    for name in RUNS:
        meas = allocator_check(str(H100 / name))["meas_allocated"]
        err = estimate(flags[name], "default", adjust, recorded_kernels(str(H100 / name)))["allocated"] / meas - 1
        assert -0.01 <= err <= 0.02, (name, err)
