"""Composed formula sets (FORMATS 4.1): the loader's checks, and the estimator's replay of segments in the measured
op structure, on a set written here whose every number is known."""
from __future__ import annotations

import copy

import pytest

from estimator import formulas as F
from estimator.args import parse_args
from estimator.compose import ComposedCache, chunk_body, own_label
from estimator.memory import estimate

ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128",
        "--transformer-impl", "local", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--hidden-dropout", "0",
        "--attention-dropout", "0"]   # the CPU kernels: what the synthetic set below was "measured" with


def _seg(label, fd, fp, bd, bp, when=None, seen=None):
    c = lambda x: [{"coef": x, "vars": {"s": 1, "b": 1}}] if x else []   # noqa: E731  bytes per token
    return {"label": label, "per": "layer" if label.startswith("layers.*") else "model", "when": when or {},
            "seen": seen or {}, "fwd_delta": c(fd), "fwd_peak": c(fp), "bwd_delta": c(bd), "bwd_peak": c(bp)}


DOC = {
    "format": F.FORMAT, "version": F.COMPOSED_VERSION, "name": "toy", "kind": "fitted", "composed": True,
    "formulas": [],
    "segments": [
        _seg("step", 0, 0, 0, 0),
        _seg("embedding", 10, 10, -10, 5),
        _seg("step@embedding", 0, 0, 0, 0),
        _seg("layers.*.mlp", 20, 30, -20, 40),          # a leaf: one segment
        _seg("layers.*", 0, 0, 0, 0),
        _seg("layers.*@mlp", 5, 5, -5, 1),
        _seg("decoder@layers.*", 0, 0, 0, 0),
        _seg("loss", 3, 8, -3, 2),
        _seg("layers.*.mlp", 50, 50, -50, 50, when={"activation": "swiglu"}),
    ],
    "structure": [
        {"op": "step", "when": {}, "children": ["embedding", "decoder", "loss"]},
        {"op": "decoder", "when": {}, "children": ["layers.*"]},
        {"op": "layers.*", "when": {}, "children": ["layers.*.mlp"]},
    ],
}


def _cpu(argv):
    cfg = parse_args(argv)
    cfg.kernels = dict(F.CPU_KERNELS)     # the harness's CPU kernels, which the set below "measured"
    return cfg


def _cache(doc=DOC, argv=ARGV):
    cfg = _cpu(argv)
    return ComposedCache(F.from_dict(copy.deepcopy(doc)), cfg), cfg


def test_own_label_names_the_child_relative_to_its_op():
    assert own_label("layers.*.mlp", "layers.*.mlp.linear_fc1") == "layers.*.mlp@linear_fc1"
    assert own_label("step", "data.tokens") == "step@data.tokens"


def test_replay_follows_the_structure_forward_and_reversed_backward():
    cache, cfg = _cache()
    tokens = cfg.seq_length * cfg.micro_batch_size
    saved, fwd, bwd, rows, again = chunk_body(cache, (False, False), True, True)
    # forward: embedding 10, two layers of (mlp 20 peaking 30, own code 5), loss 3 peaking 8 (bytes per token)
    assert saved == (10 + 2 * 25 + 3) * tokens
    assert fwd == (10 + 2 * 25 + 8) * tokens  # the loss peaks 8 above all the rest
    # backward from all saved: loss (+2), layer 2 own (+1), its mlp (+40 above 63-3-5=55) ...
    assert bwd == (55 + 40 - 63) * tokens
    assert again is None                        # no MoE checkpoint: a backward leaves nothing behind
    assert {r[0] for r in rows} >= {"embedding", "layers.*.mlp", "loss"}
    assert cache.coverage()["measured_share"] == 1.0


def test_switch_specific_formula_wins_and_unseen_values_are_extrapolated_high():
    doc = copy.deepcopy(DOC)
    doc["segments"][3]["seen"] = {"activation": ["gelu"]}      # the plain mlp was measured with gelu only
    del doc["segments"][-1]
    cache, _ = _cache(doc, ARGV + ["--swiglu"])
    saved, *_ = chunk_body(cache, (False, False), True, True)
    cov = cache.coverage()
    assert "layers.*.mlp" in cov["extrapolated"] and cov["measured_share"] < 1
    cache2, _ = _cache(DOC, ARGV + ["--swiglu"])
    saved2, *_ = chunk_body(cache2, (False, False), True, True)
    assert saved2 > saved                                       # the swiglu formula (50 per token) is used


def test_estimate_reports_coverage_and_no_fallbacks():
    fset = F.from_dict(copy.deepcopy(DOC))
    est = estimate(_cpu(ARGV), fset)
    assert est.coverage["measured_share"] == 1.0 and not est.fallbacks
    assert est.max_peak_bytes > 0


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("segments"), "needs a non-empty 'segments'"),
    (lambda d: d.pop("structure"), "needs a non-empty 'structure'"),
    (lambda d: d["segments"][0].update(when={"nope": 1}), "unknown switch"),
    (lambda d: d["segments"].append(dict(d["segments"][0])), "duplicate segment formula"),
    (lambda d: d["segments"][0].update(seen=[1]), "'seen' maps switches"),
    (lambda d: d["structure"][0].update(children="embedding"), "list of 'children'"),
    (lambda d: d["segments"][1].update(fwd_delta=[{"coef": 1, "vars": {"zz": 1}}]), "unknown variable"),
])
def test_loader_rejects_malformed_composed_sets(mutate, message):
    doc = copy.deepcopy(DOC)
    mutate(doc)
    with pytest.raises(F.FormulaError, match=message):
        F.from_dict(doc)
