"""fit.switch_terms: per-part formulas of one segment quantity merged into one formula over switch indicators, and
the estimator's reading of such a formula (values per switch combination, measured vs predicted)."""
from __future__ import annotations

import itertools
from fractions import Fraction

from estimator import formulas as F
from estimator.args import parse_args
from estimator.compose import ComposedCache
from fit.basis import evaluate, parse_monomial
from fit.switch_terms import merge

SBH = parse_monomial("s*b*h*e")
SSBA = parse_monomial("s*s*b*a*e/t")
KEYS = ("recompute", "dropout")


def _value(terms, env):
    return sum(c * evaluate(m, env) for c, m in terms)


def _env(recompute, dropout, s=64, b=2, h=96, a=6, t=2):
    sw = {"recompute": recompute, "dropout": dropout}
    return {"s": s, "b": b, "h": h, "a": a, "t": t, "e": 4, **F.indicators(sw)}


def test_merged_formula_reproduces_every_part_and_adds_effects_of_switches_traced_apart():
    # dropout keeps its mask (s*s*b*a/t), selective recompute frees one hidden state: traced alone, never together.
    parts = {("none", False): [(Fraction(2), SBH)],
             ("none", True): [(Fraction(2), SBH), (Fraction(1), SSBA)],
             ("selective", False): [(Fraction(1), SBH)]}
    merged = merge(KEYS, parts)
    assert merged is not None
    for (rc, dr), terms in parts.items():
        for shape in ({}, {"s": 128, "b": 1}, {"h": 64, "a": 8, "t": 1}):
            assert _value(merged, _env(rc, dr, **shape)) == _value(terms, _env(rc, dr, **shape))
    both = _env("selective", True)
    assert _value(merged, both) == evaluate(SBH, both) + evaluate(SSBA, both)


def test_an_interaction_of_two_switches_gets_a_product_term():
    parts = {("none", False): [(Fraction(2), SBH)], ("none", True): [(Fraction(2), SBH)],
             ("selective", False): [(Fraction(2), SBH)], ("selective", True): [(Fraction(3), SBH)]}
    merged = merge(KEYS, parts)
    names = {tuple(n for n, _ in m if n.startswith("x_")) for _, m in merged}
    assert ("x_dropout", "x_sel") in names
    for (rc, dr), terms in parts.items():
        assert _value(merged, _env(rc, dr)) == _value(terms, _env(rc, dr))


def test_an_effect_confined_to_one_corner_of_four_switches_is_one_product_of_complements():
    """Bytes only where four switches are all off (a copy made only without dropout, bias, tied embeddings and with
    more than one sequence): no sum of indicator products of up to three switches reproduces that on all 16 parts;
    the product of the four complements does, written out as the indicator products it expands to."""
    keys = ("dropout", "bias", "tied", "mb1")
    parts = {}
    for values in itertools.product((False, True), repeat=4):
        parts[values] = [(Fraction(2), SBH)] + ([(Fraction(1), SSBA)] if not any(values) else [])
    merged = merge(keys, parts)
    assert merged is not None
    shape = lambda m: tuple((k, v) for k, v in m if not k.startswith("x_"))  # noqa: E731
    assert sum(shape(m) == SSBA for _, m in merged) == 16     # (1 - x)^4 expanded
    for values, terms in parts.items():
        sw = dict(zip(keys, values))
        env = {"s": 64, "b": 2, "h": 96, "a": 6, "t": 2, "e": 4, **F.indicators(sw)}
        assert _value(merged, env) == _value(terms, env), values


def test_one_part_merges_to_its_own_terms():
    assert merge((), {(): [(Fraction(3), SBH)]}) == [(Fraction(3), SBH)]


def _set(entry):
    return F.from_dict({"format": F.FORMAT, "version": F.COMPOSED_VERSION, "name": "t", "kind": "fitted",
                        "composed": True, "formulas": [], "segments": [entry],
                        "structure": [{"op": "step", "when": {}, "children": []}]})


def test_estimator_evaluates_indicators_and_tells_measured_parts_from_predicted_ones():
    entry = {"label": "layers.*.self_attention@core_attention", "per": "layer", "when": {},
             "seen": {"position": ["learned_absolute", "rope"], "dropout": [False, True]},
             "fwd_delta": [{"coef": 2, "vars": {"s": 1, "b": 1, "h": 1, "e": 1}},
                           {"coef": -1, "vars": {"s": 1, "b": 1, "h": 1, "e": 1, "x_rope": 1}}],
             "measured": {"fwd_delta": [{"position": "learned_absolute", "dropout": False},
                                        {"position": "rope", "dropout": False}]}}
    fset = _set(entry)
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128",
            "--transformer-impl", "local", "--hidden-dropout", "0", "--attention-dropout", "0"]
    label = entry["label"]
    plain = ComposedCache(fset, parse_args(base))
    fd, fp, bd, bp, measured = plain.values(label, plain.sw)
    assert (fd, fp, bd, bp, measured) == (2 * 32 * 2 * 64 * 4, 0.0, 0.0, 0.0, True)   # quantities not given: 0
    rope = ComposedCache(fset, parse_args(base + ["--position-embedding-type", "rope"]))
    assert rope.values(label, rope.sw)[0] == 32 * 2 * 64 * 4 and rope.values(label, rope.sw)[4]
    both = ComposedCache(fset, parse_args(base + ["--position-embedding-type", "rope", "--hidden-dropout", "0.1"]))
    fd, *_, measured = both.values(label, both.sw)
    assert fd == 32 * 2 * 64 * 4 and not measured     # predicted from the parts around it


def test_a_combination_whose_every_pair_of_switch_values_was_measured_counts_as_measured():
    """A quantity merged over three switches adds up their effects and pairwise interactions: a combination never
    traced whose every pair of values some part had is measured; one with a pair no part had is predicted."""
    parts = [{"position": "learned_absolute", "dropout": False, "gqa": False},
             {"position": "rope", "dropout": True, "gqa": False},
             {"position": "rope", "dropout": False, "gqa": True},
             {"position": "learned_absolute", "dropout": True, "gqa": True}]
    entry = {"label": "layers.*.self_attention@core_attention", "per": "layer", "when": {},
             "seen": {"position": ["learned_absolute", "rope"], "dropout": [False, True], "gqa": [False, True]},
             "fwd_delta": [{"coef": 2, "vars": {"s": 1, "b": 1, "h": 1, "e": 1}}], "measured": {"fwd_delta": parts}}
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128",
            "--transformer-impl", "local", "--attention-dropout", "0", "--position-embedding-type", "rope",
            "--hidden-dropout", "0.1", "--group-query-attention", "--num-query-groups", "2"]
    label = entry["label"]

    def measured(doc):
        cache = ComposedCache(_set(doc), parse_args(base))
        assert (cache.sw["position"], cache.sw["dropout"], cache.sw["gqa"]) == ("rope", True, True)
        return cache.values(label, cache.sw)[4]

    assert measured(entry)                      # (rope, dropout), (rope, gqa), (dropout, gqa): each in a part
    assert not measured(dict(entry, measured={"fwd_delta": parts[:3]}))   # dropout with GQA: never measured


def test_a_combination_never_traced_is_predicted_from_real_runs_of_its_parts():
    """layers.*.input_layernorm fitted on GPT-style runs with LayerNorm and with RMSNorm, on Llama-style runs with
    LayerNorm and on Llama-style runs with RMSNorm and tied embeddings predicts the Llama-style runs with RMSNorm
    and untied embeddings (a combination held out) to the byte: the norm's segments depend on the norm type only,
    whatever else the model does."""
    import os

    import pytest

    from fit.segment_data import QUANTITIES
    from fit.segment_fit import Run, fit_label
    from estimator.formulas import switches, variables
    packed = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "traces", "cpu_compose")
    names = sorted(os.listdir(packed)) if os.path.isdir(packed) else []
    pick = lambda prefix: [Run(os.path.join(packed, n)) for n in names if n.startswith(prefix + "_s")]  # noqa: E731
    fitted = pick("gpt_base") + pick("gpt_rms") + pick("llama_ln") + pick("llama_tied")
    held_out = pick("llama_base")
    if not fitted or not held_out:
        pytest.skip("packed cpu_compose traces absent")
    label = "layers.*.input_layernorm"
    fset = _set_of(fit_label(label, fitted, {}))
    for run in held_out:
        sw = switches(run.config)
        env = variables(run.config)
        cache = ComposedCache.__new__(ComposedCache)
        cache.fset, cache.env, cache._by_label, cache._parts = fset, env, {label: list(fset.segments)}, {}
        got = cache._evaluate(label, sw)
        for i, q in enumerate(QUANTITIES):
            assert got[i] == run.samples[label].values.get(q, 0), (run.path, q)


def _packed_runs(*prefixes):
    import os

    import pytest

    from fit.segment_fit import Run
    packed = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "traces", "cpu_compose")
    names = sorted(os.listdir(packed)) if os.path.isdir(packed) else []
    out = [[Run(os.path.join(packed, n)) for n in names if n.startswith(p + "_s")] for p in prefixes]
    if not all(out):
        pytest.skip("packed cpu_compose traces absent")
    return [r for group in out for r in group]


def _predict(fset, label, run):
    cache = ComposedCache.__new__(ComposedCache)
    cache.fset, cache.env, cache._by_label, cache._parts = fset, F.variables(run.config), {label: list(fset.segments)}, {}
    return cache._evaluate(label, F.switches(run.config))


def test_embedding_free_composes_position_dropout_and_a_micro_batch_of_one():
    """What the embedding frees once its dropout returns depends on the position type (the position lookup and the
    sum), on dropout (its input) and on b = 1, where [b, s, h] -> [s, b, h] is a view and not a copy (the `mb1`
    switch). Fitted on runs with rope or dropout but never both, it predicts GPT- and Llama-style runs with both,
    b = 1 among them, to the byte; and the fit splits only on the switches that can change the embedding
    (fit.segment_fit.RELEVANT), never on one the campaign happens to vary alongside (the activation, the norm)."""
    from fit.segment_data import QUANTITIES
    from fit.segment_fit import fit_label, relevant
    label = "embedding@embedding_dropout"
    fitted = _packed_runs("gpt_base", "gpt_dropout", "gpt_rope", "llama_base", "llama_learned")
    held_out = _packed_runs("gpt_dropout_rope", "llama_dropout")
    assert any(F.switches(r.config)["mb1"] for r in held_out) and not all(F.switches(r.config)["mb1"] for r in held_out)
    entries = fit_label(label, fitted, {})
    for e in entries:
        used = set(e["when"]) | {k for parts in e.get("measured", {}).values() for p in parts for k in p}
        assert used and all(relevant(label, k) for k in used), used
        # and its runs' values are recorded for those switches only: what the activation was does not matter here
        assert "position" in e["seen"] and all(relevant(label, k) for k in e["seen"]), e["seen"]
    fset = _set_of(entries)
    for run in held_out:
        got = _predict(fset, label, run)
        for i, q in enumerate(QUANTITIES[:2]):      # the forward: what the embedding keeps
            assert got[i] == run.samples[label].values.get(q, 0), (run.path, q)


def _set_of(entries):
    return F.from_dict({"format": F.FORMAT, "version": F.COMPOSED_VERSION, "name": "t", "kind": "fitted",
                        "composed": True, "formulas": [], "segments": entries,
                        "structure": [{"op": "step", "when": {}, "children": []}]})


def test_update_refits_only_the_named_labels_in_place(tmp_path, capsys):
    """fit.segment_fit --update SET --labels PREFIX: the labels with the prefix are refitted from the runs given, every
    other entry, the structure and the provenance stay as they were and where they were; the refit is recorded."""
    import json
    import os

    from fit.segment_fit import main
    runs = _packed_runs("gpt_base", "gpt_rope")
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "sets",
                           "cpu_compose.json")
    out = tmp_path / "set.json"
    assert main([r.path for r in runs] + ["-o", str(out), "--update", shipped, "--labels", "embedding@"]) == 0
    old, new = json.load(open(shipped)), json.load(open(out))
    label_of = lambda doc: [e["label"] for e in doc["segments"]]  # noqa: E731
    assert [x for x in label_of(new) if not x.startswith("embedding@")] == \
        [x for x in label_of(old) if not x.startswith("embedding@")]
    first = label_of(old).index(next(x for x in label_of(old) if x.startswith("embedding@")))
    assert label_of(new)[first].startswith("embedding@")      # in place
    assert [e for e in new["segments"] if not e["label"].startswith("embedding@")] == \
        [e for e in old["segments"] if not e["label"].startswith("embedding@")]
    assert new["structure"] == old["structure"]
    assert new["provenance"]["refits"][-1] == {"labels": ["embedding@"], "traces": [r.path for r in runs]}
    refitted = {e["label"] for e in new["segments"] if e["label"].startswith("embedding@")}
    assert "embedding@embedding_dropout" in refitted and all(
        e["runs"] == len(runs) for e in new["segments"] if e["label"] == "embedding@embedding_dropout")
    F.load(str(out))      # the estimator's loader takes it
    from fit.segment_fit import selected     # a trailing $: the label itself, not its subtree
    assert selected("embedding@x", ("embedding@",)) and selected("embedding", ("embedding$",))
    assert not selected("embedding@x", ("embedding$",)) and not selected("embedding.word", ("embedding@",))
    capsys.readouterr()
    assert main([runs[0].path, "-o", str(out), "--labels", "embedding@"]) == 2
    assert main([runs[0].path, "-o", str(out), "--update", shipped, "--labels", "no_such_op"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("fit.segment_fit: error: ") for line in err), err


def test_update_with_runs_the_set_never_saw_adds_them_to_its_provenance(tmp_path, capsys):
    """A run the set was not fitted on joins its provenance (what the estimator counts as traced); its op structure
    is kept unless the runs include every run the set was fitted on."""
    import json
    import os

    import pytest

    from fit.segment_fit import main
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "sets",
                           "cpu_compose.json")
    old = json.load(open(shipped))
    known = {t["path"] for t in old["provenance"]["traces"]}
    runs = _packed_runs("gpt_base", "gpt_moe_e8k1")
    new_runs = [r.path for r in runs if r.path not in known]
    if not new_runs:
        pytest.skip("every packed run is already in the set's provenance")
    out = tmp_path / "set.json"
    assert main([r.path for r in runs] + ["-o", str(out), "--update", shipped, "--labels", "embedding@"]) == 0
    new = json.load(open(out))
    paths = [t["path"] for t in new["provenance"]["traces"]]
    assert paths[:len(old["provenance"]["traces"])] == [t["path"] for t in old["provenance"]["traces"]]
    assert paths[len(old["provenance"]["traces"]):] == new_runs
    assert new["structure"] == old["structure"]
    assert "op structure kept" in capsys.readouterr().err


def test_a_transient_of_two_patterns_is_fitted_as_their_maximum_and_extrapolates():
    """Core attention's backward holds three score tensors (3*a*b*s^2*e/t) on every traced run except the short
    sequences, where another point of its backward holds more. No single formula fits; an upper bound fitted on
    small runs trades the s^2 coefficient for terms that do not grow. Fitted as the larger of two patterns (FORMATS
    4.1 `{"max": ...}`) on runs with s <= 96, it predicts every s = 128 run exactly, and the loader reads it back."""
    from fractions import Fraction as Fr

    from fit.segment_fit import MaxFit, fit_label, split_quantity
    label = "layers.*.self_attention.core_attention"
    runs = _packed_runs("gpt_base", "gpt_tp2", "llama_base", "llama_tp2", "gpt_gqa", "gpt_rope", "gpt_swiglu")
    small = [r for r in runs if r.point["s"] <= 96]
    large = [r for r in runs if r.point["s"] > 96]
    assert large and any(r.point["s"] == 32 for r in small)
    cache: dict = {}   # the label's fit below reuses this quantity's
    keys, fits, _ = split_quantity(label, "bwd_peak", small, cache)
    assert keys == () and isinstance(fits[()], MaxFit)
    first = fits[()].alternatives[0]
    assert first.terms == [(Fr(3), parse_monomial("s*s*b*a*e/t"))]
    fset = _set_of([e for e in fit_label(label, small, cache) if not e["when"]])
    assert any(isinstance(t, F.MaxTerm) for sf in fset.segments for t in (sf.quantities[3] or ()))
    for run in large:
        assert _predict(fset, label, run)[3] == run.samples[label].values["bwd_peak"], run.path


def test_the_loader_reads_a_maximum_only_where_it_belongs():
    """A segment quantity may be {"max": [terms, terms, ...]} (two alternatives at least); a version-1 formula's may
    not. The estimator evaluates it as the larger alternative."""
    import pytest

    seg = {"label": "x", "when": {}, "seen": {}, "fwd_delta": [], "fwd_peak": [], "bwd_delta": [],
           "bwd_peak": {"max": [[{"coef": 3, "vars": {"s": 2}}], [{"coef": 40, "vars": {"s": 1}}]]}}
    fset = _set_of([seg])
    (term,) = fset.segments[0].quantities[3]
    assert term.value({"s": 8}) == 320 and term.value({"s": 32}) == 3072
    for bad in ({"max": [[{"coef": 3, "vars": {"s": 2}}]]}, {"max": [[{"coef": 3}], None]}, {"max": "x"}):
        with pytest.raises(F.FormulaError, match="max"):
            _set_of([dict(seg, bwd_peak=bad)])
    v1 = {"format": F.FORMAT, "version": 1, "name": "t", "kind": "fitted", "description": "", "provenance": {},
          "formulas": [{"op": "x", "per": "layer", "when": {}, "saved": [], "fwd_peak": [],
                        "bwd_peak": {"max": [[{"coef": 1}], [{"coef": 2}]]}}]}
    with pytest.raises(F.FormulaError):
        F.from_dict(v1)


def test_a_part_left_undetermined_is_split_on_its_own_by_the_switch_that_matters_only_there():
    """What SelfAttention frees after linear_proj under MQA without rope: the query/key/value views are copied by
    their reshape unless the micro-batch is one sequence. The common split leaves that part undetermined (b = 1 and
    b > 1 runs differ; without the split of its own, all ten MQA runs without rope are mispredicted); split on its own
    by `mb1`, every run is reproduced to the byte, and the part's both halves count as measured."""
    from fit.segment_fit import fit_label
    label = "layers.*.self_attention@linear_proj"
    runs = _packed_runs("gpt_base", "gpt_gqa", "gpt_mqa", "gpt_tp2_g4", "llama_base", "llama_mqa_learned", "llama_mqa")
    mqa = [r for r in runs if r.point["g"] == 1 and F.switches(r.config)["position"] != "rope"]
    assert {r.samples[label].values.get("fwd_delta", 0) == 0 for r in mqa} == {True, False}
    assert {F.switches(r.config)["mb1"] for r in mqa} == {True, False}
    entries = fit_label(label, runs, {})
    fset = _set_of(entries)
    for run in runs:
        assert _predict(fset, label, run)[0] == run.samples[label].values.get("fwd_delta", 0), run.path
    (entry,) = entries
    assert any("mb1" in part for part in entry["measured"]["fwd_delta"])


def test_bf16_linear_forward_peak_is_its_output_as_in_fp32():
    """With 16-bit GEMMs kept off oneDNN (tracer/megatron_compat.py), a bf16 matmul on CPU allocates only its output,
    as an fp32 one does: linear_proj's forward peak is its output (`s*b*h*e/st`) without SP on fp32 and bf16 runs
    alike, and SP adds the reduce-scatter's buffers: one formula over dtypes and SP (`4*s*b*h*e - 3*s*b*h*e/st`), no
    dtype split and no bound. Traces taken with oneDNN's scratchpad (AVX-512 BF16 machines) needed a split by dtype
    and a bound for bf16."""
    from fit.segment_fit import _is_bound, split_quantity
    label, q = "layers.*.self_attention.linear_proj", "fwd_peak"
    runs = _packed_runs("gpt_base", "gpt_bf16", "llama_base", "llama_bf16", "gpt_tp2sp", "llama_tp2sp", "gpt_tp2")
    assert {F.switches(r.config)["dtype"] for r in runs} == {"fp32", "bf16"}
    assert {F.switches(r.config)["sp"] for r in runs if F.switches(r.config)["tp"]} == {False, True}
    keys, _, leaves = split_quantity(label, q, runs, {})
    assert "dtype" not in keys and all(not isinstance(fit, str) and not _is_bound(fit) for _, _, fit in leaves)
    for _, rs, fit in leaves:
        for r in rs:
            assert fit.predict(r.point) == r.samples[label].values[q], r.path
    for r in runs:
        if not F.switches(r.config)["sp"]:
            p = r.point
            assert r.samples[label].values[q] == p["s"] * p["b"] * p["h"] * p["e"], r.path


def test_core_attention_backward_after_dropout_is_one_exact_formula_over_dtypes():
    """Core attention's backward after its dropout peaks at `a*b*s^2*e/t + s*b*a*d*e/t` on fp32 and bf16 runs alike
    (bf16 GEMMs off oneDNN: no scratchpad transient). Pooled over both, without a split, it predicts held-out longer
    fp32 sequences to the byte."""
    from fit.segment_fit import _is_bound, fit_label, split_quantity
    label, q = "layers.*.self_attention.core_attention@attention_dropout", "bwd_peak"
    runs = _packed_runs("gpt_base", "llama_base", "gpt_bf16", "llama_bf16", "gpt_tp2", "llama_tp2")
    held = [r for r in runs if r.point["s"] == 128]
    fitted = [r for r in runs if r.point["s"] < 128]
    assert held and all(F.switches(r.config)["dtype"] == "fp32" for r in held)
    assert {F.switches(r.config)["dtype"] for r in fitted} == {"fp32", "bf16"}
    cache = {}   # the split's part fits, reused by the whole label's fit below
    keys, _, leaves = split_quantity(label, q, fitted, cache)
    assert keys == ()
    ((_, _, pooled),) = leaves
    assert not _is_bound(pooled)
    assert sorted(pooled.terms) == sorted([(Fraction(1), parse_monomial("s*s*b*a*e/t")),
                                           (Fraction(1), parse_monomial("s*b*a*d*e/t"))])
    fset = _set_of([e for e in fit_label(label, fitted, cache) if not e["when"]])
    for run in held:
        assert _predict(fset, label, run)[3] == run.samples[label].values[q], run.path


def test_a_part_the_greedy_search_misses_gets_its_exact_formula_of_four_terms():
    """The MoE dispatch's backward on the all-to-all runs without SP frees k - 1 copies of the tokens' hidden
    states, the routing map (one byte per token and expert) and the probabilities: four terms, none a good fit
    alone, so the greedy search beyond three terms misses them. Searched through every formula of four terms
    (fit.segment_fit._deep) on runs of top-1 to top-3 with 2 to 8 experts, it predicts held-out top-3 runs with 8
    experts over two expert ranks to the byte."""
    from fit.segment_fit import _deep, _fit, _problem, candidates
    label, q = "layers.*.mlp@router", "bwd_delta"
    fitted = _packed_runs("gpt_moe_a2a", "gpt_moe_a2a_ep2", "gpt_moe_a2a_k3", "gpt_moe_a2a_e2k2_ep2",
                          "llama_moe_a2a_e8k2", "llama_moe_a2a_e8k1", "llama_moe_a2a_ep2")
    held = _packed_runs("gpt_moe_a2a_e8k3_ep2")
    pts, ys, fixed, ties = _problem(label, q, fitted)
    reason = _fit(list(zip(pts, ys)), candidates(label), fixed, ties)
    assert isinstance(reason, str) and reason.startswith("no exact fit"), reason
    fit = _deep(label, q, fitted, reason)
    assert not isinstance(fit, str) and len(fit.terms) == 4, fit
    for run in held:
        assert run.point["k"] == 3 and run.point["E"] == 8 and run.point["ep"] == 2
        assert fit.predict(run.point) == run.samples[label].values[q], run.path


def test_routing_by_softmax_before_the_top_k_is_a_switch_of_the_router_only():
    """--moe-router-pre-softmax keeps the probabilities of every expert, not of the k picked (`pre_softmax`, a
    switch of the router alone: the dispatch sees k tokens either way). The router's forward fitted on top-1 and
    top-2 runs of both orders with the allgather dispatcher on one rank predicts top-2 pre-softmax runs with 8
    experts, the all-to-all dispatcher and two expert ranks to the byte."""
    from fit.segment_fit import fit_label, relevant
    assert relevant("layers.*.mlp.router", "pre_softmax") and not relevant("layers.*.mlp@router", "pre_softmax")
    label = "layers.*.mlp.router"
    fitted = _packed_runs("gpt_moe", "gpt_moe_k3", "gpt_moe_e8k1", "gpt_moe_presoft", "llama_moe_e8k3")
    held = _packed_runs("llama_moe_a2a_presoft_ep2")
    assert {F.switches(r.config)["pre_softmax"] for r in fitted} == {True, False}
    fset = _set_of([e for e in fit_label(label, fitted, {}) if not e["when"]])
    for run in held:
        assert F.switches(run.config)["pre_softmax"] and run.point["k"] == 2
        assert _predict(fset, label, run)[0] == run.samples[label].values["fwd_delta"], run.path


def test_output_layer_backward_is_the_larger_of_two_patterns_merged_over_dtypes():
    """The untied output layer's backward under TP + SP peaks at the larger of two allocation patterns: its input
    gathered, the input gradient before and after the reduce-scatter and the weight gradient
    (`(5/2)*s*b*h*e + v*h*e/t` at TP 2), or, in bf16 once the logits' gradient is freed, the weight gradient with its
    fp32 copy for the main gradient (`3*v*h*e/t - s*b*v*e/t`). Fitted on bf16 runs (the first pattern the larger
    on 5 of 15) and fp32 runs (the first only), the parts merge pattern by pattern (`{"max": [...]}`), and held-out
    longer bf16 runs at other shapes are predicted to the byte."""
    import os
    from fit.segment_fit import MaxFit, _split_fit, fit_label
    label, q = "output_layer", "bwd_peak"
    long = _packed_runs("llama_bf16_tp2sp_long")
    fitted_long = ("llama_bf16_tp2sp_long_s128_b1_h64_a4", "llama_bf16_tp2sp_long_s96_b2_h64_a4")
    bf16 = _packed_runs("llama_bf16_tp2sp") + [r for r in long if os.path.basename(r.path) in fitted_long]
    held = [r for r in long if os.path.basename(r.path) not in fitted_long]
    fp32 = _packed_runs("llama_tp2sp")
    assert held and all(F.switches(r.config)["dtype"] == "fp32" for r in fp32)
    larger = _split_fit(label, q, bf16, {})
    assert isinstance(larger, MaxFit)
    assert sorted(str(alt) for alt in larger.alternatives) == ["(5/2)*s*b*h*e + h*v*e/t", "-1*s*b*v*e/t + 3*h*v*e/t"]
    (entry,) = [e for e in fit_label(label, bf16 + fp32, {}) if not e["when"]]
    assert set(entry[q]) == {"max"} and entry["measured"][q]
    fset = _set_of([entry])
    for run in held + fp32 + bf16:
        assert _predict(fset, label, run)[3] == run.samples[label].values[q], run.path


def test_word_embedding_backward_is_the_larger_of_two_patterns_once_micro_batches_vary():
    """The tied word embedding's bf16 backward (no TP, micro-batches of more than one sequence) peaks at the larger
    of two allocation patterns: the weight gradient's fp32 copy for the main gradient once the output gradient is
    freed (`2*v*h*e - s*b*h*e - 4*s*b*e`: the shared weight's gradient from the output layer is held until then), or
    the weight gradient beside the output gradient's transposed copy (`v*h*e + s*b*h*e`), the larger at long
    sequences. On short runs of two sequences alone the first cannot be told from `... - 2*s*h*e ...`, so a
    consensus sample of them is a guess the other runs check; runs of three and four sequences determine it. Fitted
    so, held-out runs (a longer sequence, the Llama-style base tied) are predicted to the byte."""
    import os

    from fit.segment_fit import MaxFit, _split_fit
    label, q = "embedding.word_embeddings", "bwd_peak"
    runs = [r for r in _packed_runs("gpt_bf16", "gpt_bf16_rms", "gpt_bf16_swiglu", "gpt_bf16_gqa", "gpt_bf16_nobias",
                                    "gpt_bf16_dropout", "gpt_bf16_batch", "gpt_bf16_long", "llama_bf16_tied")
            if r.point["b"] > 1]
    held_names = ("gpt_bf16_long_s144_b2_h64_a4", "llama_bf16_tied_s48_b2_h64_a4")
    held = [r for r in runs if os.path.basename(r.path) in held_names]
    fitted = [r for r in runs if r not in held]
    assert len(held) == 2 and all(F.switches(r.config)["dtype"] == "bf16" and F.switches(r.config)["tied"]
                                  for r in runs)
    larger = _split_fit(label, q, fitted, {})
    assert isinstance(larger, MaxFit)
    assert sorted(str(alt) for alt in larger.alternatives) == \
        ["-1*s*b*h*e/st - 4*s*b*e + 2*h*v*e/t", "s*b*h*e/st + h*v*e/t"]
    for run in held + fitted:
        assert larger.predict(run.point) == run.samples[label].values[q], run.path
    # Both patterns are the larger on some runs, held-out ones included.
    sides = {max(range(2), key=lambda j: larger.alternatives[j].predict(r.point)) for r in held}
    assert sides == {0, 1}


def test_a_robust_fit_that_leaves_runs_above_it_gives_way_to_the_larger_of_two_patterns():
    """The untied word embedding's bf16 backward (no TP, more than one sequence) is the weight gradient with its fp32
    copy (`3*v*h*e - s*b*h*e - 4*s*b*e`) on all but the longest runs, where the weight gradient beside the output
    gradient's copy (`s*b*h*e + v*h*e`) is larger. The robust fit (exact on all but a few runs) takes the first and
    leaves those runs out as deviating; as they lie above it, they are the other pattern, and the part's fit is the
    larger of the two, reproducing every run."""
    from fit.segment_fit import MaxFit, _fit_part, _split_fit
    label, q = "embedding.word_embeddings", "bwd_peak"
    runs = [r for r in _packed_runs("llama_bf16", "llama_bf16_gelu", "llama_bf16_ln", "llama_bf16_mha",
                                    "llama_bf16_bias", "llama_bf16_learned", "llama_bf16_dropout", "gpt_bf16_untied",
                                    "llama_gk_default_bf16", "llama_gk_fsm", "llama_gk_fsm_off", "llama_moe_a2a_bf16",
                                    "llama_bf16_batch", "llama_bf16_long") if r.point["b"] > 1]
    robust = _fit_part(label, q, runs, {}, robust=True)
    under = [r for r in runs if robust.predict(r.point) < r.samples[label].values[q]]
    assert str(robust) == "-1*s*b*h*e/st - 4*s*b*e + 3*h*v*e/t" and len(under) >= 4
    assert all("_long_" in r.path for r in under)
    larger = _split_fit(label, q, runs, {})
    assert isinstance(larger, MaxFit)
    assert sorted(str(alt) for alt in larger.alternatives) == \
        ["-1*s*b*h*e/st - 4*s*b*e + 3*h*v*e/t", "s*b*h*e/st + h*v*e/t"]
    for run in runs:
        assert larger.predict(run.point) == run.samples[label].values[q], run.path


def test_a_leaf_too_small_for_its_formula_takes_the_one_its_siblings_share_across_a_switch():
    """The tied word embedding's fp32 backward under TP is the output gradient at full sequence and the weight's
    gradient, with or without SP. Split by SP (which changes other parts of the label), the four runs without SP
    cannot determine that formula of three terms; pooled across SP, one exact formula reproduces every run, and the
    part takes it. The part with SP, determined on its own, keeps its own fit."""
    from fit.segment_fit import SLACK_BYTES, _parts, _pooled, _split_fit
    label, q = "embedding.word_embeddings", "bwd_peak"
    runs = [r for r in _packed_runs("gpt_tp2", "gpt_tp2_g4", "gpt_tp2sp", "gpt_moe_tp2sp") if r.point["b"] > 1]
    cache: dict = {}
    leaves = [({"sp": part[0]}, rs, _split_fit(label, q, rs, cache)) for part, rs in _parts(runs, ("sp",)).items()]
    alone = {c["sp"]: v for c, _, v in leaves}
    assert isinstance(alone[False], str) and str(alone[True]) == "s*b*h*e + (-1/4)*s*b*e + h*v*e/t"
    pooled = {c["sp"]: v for c, _, v in _pooled(label, q, leaves, cache)}
    assert pooled[True] is alone[True]
    fit = pooled[False]
    assert str(fit) == "s*b*h*e + (-1/4)*s*b*e + h*v*e/t" and any(n.startswith("pooled over sp") for n in fit.notes)
    for run in runs:
        assert abs(float(fit.predict(run.point)) - run.samples[label].values[q]) <= SLACK_BYTES, run.path


def test_a_transient_leaf_no_pool_fits_exactly_takes_a_bound_that_errs_high():
    """The untied word embedding's fp32 backward under SP at b = 1 holds a hidden state less with learned positions
    than with rope; the two runs with learned positions cannot determine it alone. No pool has one exact formula,
    so the leaf takes the pool's bound: never under a run, and over by at most PEAK_BOUND of each run's peak."""
    from fit.segment_fit import PEAK_BOUND, _parts, _pooled, _split_fit
    label, q = "embedding.word_embeddings", "bwd_peak"
    runs = [r for r in _packed_runs("llama_tp2sp", "llama_tp2sp_g4", "llama_tp2sp_ln", "llama_moe_tp2sp",
                                    "llama_tp2sp_learned", "gpt_tp2sp_untied") if r.point["b"] == 1]
    keys = ("position",)
    cache: dict = {}
    leaves = [(dict(zip(keys, part)), rs, _split_fit(label, q, rs, cache)) for part, rs in _parts(runs, keys).items()]
    learned = next((rs, v) for c, rs, v in leaves if c["position"] == "learned_absolute")
    assert isinstance(learned[1], str) and len(learned[0]) == 2
    fit = next(v for c, _, v in _pooled(label, q, leaves, cache) if c["position"] == "learned_absolute")
    assert not isinstance(fit, str)
    for run in runs:
        over = float(fit.predict(run.point)) - run.samples[label].values[q]
        assert -64 <= over <= PEAK_BOUND * max(run.peaks), run.path
    assert any(float(fit.predict(r.point)) > r.samples[label].values[q] + 64 for r in learned[0])


def test_linear_fc1_bf16_backward_is_the_fp32_pattern_or_the_weight_gradient_with_its_fp32_copy():
    """linear_fc1's bf16 backward (GPT-style, no dropout) peaks at the fp32 runs' pattern (input gathered, input
    gradient before and after the reduce-scatter, weight gradient: `4*s*b*h*e - 3*s*b*h*e/t + h*f*e/t`) at long
    sequences, and at the weight gradient with its fp32 copy once the output gradient is freed
    (`3*h*f*e/t - s*b*f*e/t`) at short ones: 28 and 25 of its 53 runs. Every TP run here has sequence parallelism,
    so `/st` and `/t` are the same on these runs (the larger at TP without SP is taken); a consensus guess from five
    runs that misses a few runs of its own pattern is refitted on the runs it agreed with before the rest are the
    second pattern's. The maximum reproduces every run."""
    from fit.segment_fit import MaxFit, _max_fit
    label, q = "layers.*.mlp.linear_fc1", "bwd_peak"
    runs = [r for r in _packed_runs("gpt_bf16", "gpt_bf16_batch", "gpt_bf16_gqa", "gpt_bf16_long", "gpt_bf16_rms",
                                    "gpt_bf16_rope", "gpt_bf16_untied", "gpt_bf16_tp2sp", "gpt_bf16_tp2sp_batch",
                                    "gpt_bf16_tp2sp_long") if F.switches(r.config)["activation"] == "gelu"]
    sw = [F.switches(r.config) for r in runs]
    assert len(runs) >= 40 and all(s["dtype"] == "bf16" and not s["dropout"] and s["bias"] and s["recompute"] == "none"
                                   for s in sw)
    assert all(s["sp"] == s["tp"] for s in sw) and {s["tp"] for s in sw} == {False, True}
    larger = _max_fit(label, q, runs, "no exact fit")
    assert isinstance(larger, MaxFit)
    assert sorted(str(alt) for alt in larger.alternatives) == \
        ["-1*s*b*f*e/t + 3*h*f*e/t", "4*s*b*h*e - 3*s*b*h*e/t + h*f*e/t"]
    for run in runs:
        assert larger.predict(run.point) == run.samples[label].values[q], run.path
    sides = [max(range(2), key=lambda j: larger.alternatives[j].predict(r.point)) for r in runs]
    assert sides.count(0) >= 10 and sides.count(1) >= 10
