"""CI slice of the accuracy benchmark (issue 4 item 6) on one small held-out CPU run.

Profiles `l3_h80_s40_m2` of benchmarks/accuracy_grid.json (1 process, 3 layers, h=80, s=40, 2 microbatches: no fit
grid uses 3 layers or h=80) with real megatron-core on CPU, then checks:
- the static memory the estimator predicts (weights, gradient buffers, optimizer states) equals what the parser
  finds live at the measured peak, byte for byte;
- the issue's target, the whole peak within 1% with the fitted CPU set (fit/sets/cpu_compose.json), and no
  under-prediction beyond 0.5%. This config meets it since the layer transients are fitted per allocation point
  (-0.09% on 2026-11-22); the benchmark as a whole does not yet (MoE, pipeline stages: see README "Accuracy").
"""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FITTED = os.path.join(ROOT, "fit", "sets", "cpu_compose.json")
CONFIG = "l3_h80_s40_m2"

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _need(mod: str):
    try:
        __import__(mod)
    except ImportError:
        pytest.skip(f"{mod} is not installed (make test installs the pinned test environment)")


@pytest.fixture(scope="module")
def held_out_run(tmp_path_factory):
    if not os.path.isfile(FITTED):
        pytest.skip("fit/sets/cpu_compose.json does not exist")
    _need("torch")
    _need("megatron.core")
    import accuracy as B

    with open(B.DEFAULT_GRID, encoding="utf-8") as fh:
        cfg = next(c for c in B.expand(json.load(fh)) if c["name"] == CONFIG)
    # Held out: not a config the fitted set was made from, nor one of the fit grids.
    prov, grids = B.training_configs(FITTED)
    key = B._config_key(cfg["argv"], cfg["nproc"])
    assert key not in prov and key not in grids
    out = str(tmp_path_factory.mktemp("accuracy"))
    B.profile(cfg, out, iterations=3, timeout=300)
    return B, cfg, os.path.join(out, CONFIG)


def test_held_out_static_memory_equals_measured(held_out_run):
    from tracer.parse import parse_run

    from estimator import cli

    B, cfg, run_dir = held_out_run
    measured = parse_run(run_dir)[0].peak_by_category
    predicted = B.predict(cfg, FITTED)[0]["bytes"]
    report = cli.build_report(["--nproc_per_node", str(cfg["nproc"])] + cfg["argv"])
    n_tensors = sum(op.count * len(op.shapes) for op in report.rank_params[0].ops)
    assert predicted["gradients"] == measured["gradient"]
    # CPU-only scalars the estimator leaves out on purpose (on a GPU they live in host memory): torch AdamW's
    # per-tensor `step` counter (4 B each) plus at most two optimizer-level scalars, and one 4-byte scalar the
    # model registers while it is built. Anything larger (a missing state or buffer) fails here.
    extra_optimizer = measured["optimizer"] - predicted["optimizer_states"]
    assert extra_optimizer % 4 == 0 and 4 * n_tensors <= extra_optimizer <= 4 * (n_tensors + 2), extra_optimizer
    assert measured["parameter"] - predicted["parameters"] == 4


def test_held_out_cpu_run_predicted_within_1_percent(held_out_run):
    B, cfg, run_dir = held_out_run
    measured = B.measured(run_dir, cfg["nproc"])[0]["allocator_peak_bytes"]
    predicted = B.predict(cfg, FITTED)[0]["peak_bytes"]
    err = 100.0 * (predicted - measured) / measured
    assert abs(err) <= B.TARGET_ABS and err >= -B.TARGET_UNDER, (
        f"{CONFIG}: measured {measured} B, predicted {predicted:.0f} B with the fitted set ({err:+.2f}%)")
