"""End to end on CPU: the CI grid is profiled with real megatron-core (local spec, gloo), parsed and fitted.

The fitted per-layer saved bytes must add up to the independently measured fact in DESIGN.md section 7
(local spec, fp32, learned positions, no dropout: e*(16sbh + a s^2 b), plus the fp32 layer-norm statistics),
and a resumed campaign must not profile anything again. About two minutes on two cores.
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
from estimator.formulas import select
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


def _saved(fset, op, cfg):
    fo = select(fset, op, cfg)   # the estimator's own choice among an op's formulas
    assert fo is not None, f"no formula for {op}"
    return F(sum(t.value(variables(cfg)) for t in fo.saved)).limit_denominator(1)


def test_fitted_layer_matches_the_measured_reference(campaign):
    out, printed = campaign
    fset = load_set(str(out / "ci_tiny.json"))
    assert fset.kind == "fitted" and len(fset.provenance["traces"]) == 6
    # fitted from the xz-packed copy (python -m fit.pack), which the trace reader reads directly
    assert all(t["dir"].startswith("packed") for t in fset.provenance["traces"])
    assert sorted(os.listdir(out / "packed" / "base")) == ["campaign.json", "rank0.json", "rank0.names",
                                                           "rank0.trace.xz"]
    assert fset.provenance["versions"][0]["megatron_core"] == "0.16.1"
    # (point formulas `<op>#<k>` carry transients only: FORMATS 4)
    layer_ops = sorted({f.op for f in fset.formulas if f.per == "layer" and "#" not in f.op})
    # An unseen config (new shapes, TP 2 without SP): Korthikanti's sbh(10 + 24/t) in fp32 units is
    # e*sbh(4 + 12/t) here, since this local spec keeps no dropout masks; plus a*s^2*b*e/t scores.
    cfg = json.load(open(out / "base" / "rank0.json"))["config"] | dict(
        hidden_size=128, num_attention_heads=8, kv_channels=16, ffn_hidden_size=512, seq_length=96,
        micro_batch_size=3, tensor_model_parallel_size=2)
    v = variables(cfg)
    s, b, h, a, t, e = (F(v[k]) for k in "sbhate")
    total = sum(_saved(fset, op, cfg) for op in layer_ops)
    assert total == e * (16 * s * b * h + a * s * s * b) / t + 4 * e * s * b * h * (1 - 1 / t) + 16 * s * b
    assert "REFUSED" in printed or "refused" in printed  # the L-dependent whole-model op cannot be a formula


def test_resume_skips_complete_configs(campaign):
    out, _ = campaign
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "fit.campaign", "fit/grids/ci_tiny.json", "--out", str(out),
                        "--resume", "--no-fit"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "6 config(s) traced" in r.stdout
    assert time.time() - t0 < 30     # nothing was profiled again
