"""End to end on CPU: the CI grid is profiled with real megatron-core (local spec, gloo), parsed and fitted as
allocation programs.

A layer's saved bytes replayed from the fitted programs at shapes no run had must add up to the independently
measured fact in DESIGN.md section 7 (local spec, fp32, learned positions, no dropout: e*(16sbh + a s^2 b), plus
the fp32 layer-norm statistics), and a resumed campaign must not profile anything again. About two minutes on two
cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from fractions import Fraction as F

import pytest

from estimator.formulas import load as load_set
from estimator.formulas import variables

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    out = tmp_path_factory.mktemp("ci_tiny")
    r = subprocess.run([sys.executable, "-m", "fit.campaign", "fit/grids/ci_tiny.json", "--out", str(out),
                        "--pack", str(out / "packed")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


def _layer_saved(fset, cfg) -> F:
    """Bytes one layer (not the first) keeps for its backward: its segments' forward deltas, replayed from the
    set's programs at the config's sizes through the estimator's walk."""
    from estimator.activations import cache_for
    cache = cache_for(fset, cfg)
    total = 0.0

    def walk(items):
        nonlocal total
        for it in items:
            if it[0] in ("run", "ckpt"):
                walk(it[1])
            elif it[3] == 1:
                total += it[1][0]
    walk(cache.sequence([False, False], True, True))
    return F(total).limit_denominator(1)


def test_fitted_layer_matches_the_measured_reference(campaign):
    out, printed = campaign
    fset = load_set(str(out / "ci_tiny.json"))
    assert fset.kind == "fitted" and fset.programs is not None
    with open(out / "ci_tiny.provenance.json", encoding="utf-8") as fh:
        traces = json.load(fh)["traces"]
    # fitted from the xz-packed copy (python -m fit.pack), which the trace reader reads directly
    assert len(traces) == 6 and all("/packed/" in t["path"] for t in traces)
    assert sorted(os.listdir(out / "packed" / "base")) == ["campaign.json", "rank0.json", "rank0.names",
                                                           "rank0.trace.xz"]
    assert "label phases exact to the byte" in printed and ", 0 not reproduced" in printed
    # An unseen config (new shapes): Korthikanti's sbh(10 + 24/t) in fp32 units is e*16sbh here at t = 1, since
    # this local spec keeps no dropout masks; plus a*s^2*b*e scores and the fp32 layer-norm statistics.
    cfg = json.load(open(out / "base" / "rank0.json"))["config"] | dict(
        hidden_size=128, num_attention_heads=8, kv_channels=16, ffn_hidden_size=512, seq_length=96,
        micro_batch_size=3)
    v = variables(cfg)
    s, b, h, a, e = (F(v[k]) for k in "sbhae")
    assert _layer_saved(fset, cfg) == e * (16 * s * b * h + a * s * s * b) + 16 * s * b


def test_resume_skips_complete_configs(campaign):
    out, _ = campaign
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "fit.campaign", "fit/grids/ci_tiny.json", "--out", str(out),
                        "--resume", "--no-fit"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "6 config(s) traced" in r.stdout
    assert time.time() - t0 < 30     # nothing was profiled again
