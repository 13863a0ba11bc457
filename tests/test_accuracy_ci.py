"""CI slice of the accuracy benchmark (issue 4 item 6): one small held-out CPU run predicted within 1%.

Profiles `l3_h80_s40_m2` of benchmarks/accuracy_grid.json (1 process, 3 layers, h=80, s=40, 2 microbatches: no fit
grid uses 3 layers or h=80) with real megatron-core on CPU, and compares the allocator's exact peak with the
estimator's prediction from the fitted CPU set (fit/sets/cpu_local.json). Targets as in the benchmark: |error| <= 1%,
under-prediction <= 0.5%.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FITTED = os.path.join(ROOT, "fit", "sets", "cpu_local.json")
CONFIG = "l3_h80_s40_m2"

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _need(mod: str):
    try:
        __import__(mod)
    except ImportError:
        pytest.skip(f"{mod} is not installed (make test installs the pinned test environment)")


def test_held_out_cpu_run_predicted_within_1_percent(tmp_path):
    if not os.path.isfile(FITTED):
        pytest.skip("fit/sets/cpu_local.json does not exist yet (made by `python -m fit.campaign fit/grids/cpu_local.json`)")
    _need("torch")
    _need("megatron.core")
    import accuracy as B

    with open(B.DEFAULT_GRID, encoding="utf-8") as fh:
        cfg = next(c for c in B.expand(json.load(fh)) if c["name"] == CONFIG)
    # Held out: not a config the fitted set was made from, nor one of the fit grids.
    prov, grids = B.training_configs(FITTED)
    key = B._config_key(cfg["argv"], cfg["nproc"])
    assert key not in prov and key not in grids

    B.profile(cfg, str(tmp_path), iterations=3, timeout=120)
    head = B.measured(os.path.join(tmp_path, CONFIG), cfg["nproc"])[0]
    measured = head["allocator_peak_bytes"]
    predicted = B.predict(cfg, FITTED)[0]["peak_bytes"]
    err = 100.0 * (predicted - measured) / measured
    assert abs(err) <= B.TARGET_ABS and err >= -B.TARGET_UNDER, (
        f"{CONFIG}: measured {measured} B, predicted {predicted:.0f} B with the fitted set ({err:+.2f}%)")
