"""Allocation programs (fit/programs, estimator/programs.py): extracted from committed traces, sizes solved
exactly, replayed to the byte, read back with a checksum, and predicting runs the fit never saw.

The references are the traces themselves (tracer.segments' per-segment delta and peak, the allocator's records),
never numbers typed here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from estimator import programs as P
from fit.programs.build import check_runs, documents, fit_runs, load_runs
from fit.programs.extract import run_programs
from fit.programs.sizes import SizeSolver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_compose")
SHIPPED = os.path.join(ROOT, "fit", "sets", "cpu_compose.json")


def _runs(prefixes):
    """The packed runs of the families the prefixes name (`gpt_moe_s`: the gpt_moe family, not gpt_moe_sqrelu)."""
    def family(name):
        return re.sub(r"_s\d+_b\d+_h\d+_a\d+$", "", name)

    wanted = {p: re.match(r"^(.*?)(_s\d.*|_s|_)?$", p).group(1) for p in prefixes}
    names = sorted(d for d in os.listdir(TRACES)
                   if any(d.startswith(p) and family(d) == f for p, f in wanted.items()))
    return [os.path.join(TRACES, d) for d in names]


@pytest.fixture(scope="module")
def base_runs():
    return load_runs(_runs(("gpt_base_", "gpt_bf16_s", "gpt_tp2sp_s")))


def test_program_replay_equals_segments():
    """A run's representative program replays to the delta and peak tracer.segments measures for the label."""
    from fit.segment_data import run_samples
    from tracer.parse import parse_run
    for path in _runs(("gpt_base_s48", "gpt_tp2sp_s32")):
        ranks = parse_run(path)
        progs = run_programs(path, ranks).programs
        samples = run_samples(path, ranks)
        assert progs
        for (phase, label), prog in progs.items():
            delta, peak = prog.delta_peak()
            want = samples[label].values
            assert (delta, peak) == (want[f"{phase}_delta"], want[f"{phase}_peak"]), (path, phase, label)


def test_frees_name_their_allocations():
    """Pointers pair frees with allocations: a layer's backward frees what its forward saved, by name."""
    from tracer.parse import parse_run
    path = _runs(("gpt_base_s48",))[0]
    progs = run_programs(path, parse_run(path)).programs
    refs = [e.ref for e in progs[("bwd", "layers.*.mlp.linear_fc2")].compute if e.op == "-"]
    assert any(r.startswith("fwd:layers.*.mlp@linear_fc1#") for r in refs)
    local = [e.ref for p in progs.values() for e in p.compute if e.ref.startswith("#")]
    assert local


def test_size_solver_exact_and_refuses():
    """Sizes that are one monomial are solved with their coefficient; sizes no sum fits are refused (None)."""
    pts = [{"s": s, "b": b, "h": h, "e": e, "st": 1, "t": 1}
           for s, b, h, e in ((16, 2, 64, 4), (32, 1, 96, 2), (48, 3, 128, 4), (40, 2, 80, 2))]
    solver = SizeSolver("layers.*.mlp.linear_fc2", pts)
    fit = solver.fit([p["e"] * p["s"] * p["b"] * p["h"] for p in pts])
    assert P.format_size(fit.terms) == "e*s*b*h/st" or P.format_size(fit.terms) == "e*s*b*h"
    assert solver.fit([7919, 104729, 1299709, 15485863]) is None


def test_fit_reproduces_its_runs(base_runs):
    cells = fit_runs(base_runs)
    doc, prov = documents(base_runs, cells, "t", "")
    fset = P.from_dict(json.loads(P.to_json(doc)))
    report = check_runs(fset, base_runs)
    assert report["exact"] > 100
    assert not report["bounded"] or all(got[1] > own[1] for *_, own, got in report["bounded"])
    # every run not reproduced is named in the provenance notes
    named = {n.split(":")[0] for n in prov["notes"]}
    assert {m[0] for m in report["missed"]} <= named


def test_held_out_run_predicted_exactly(base_runs):
    """Fit without one run, then predict that run's every label phase from the set: sizes are exact formulas of the
    shapes, so a run of a fitted structure is reproduced to the byte."""
    held = [r for r in base_runs if r.path.endswith("gpt_base_s80_b2_h96_a4")]
    assert held
    rest = [r for r in base_runs if r is not held[0]]
    doc, _ = documents(rest, fit_runs(rest), "t", "")
    report = check_runs(P.from_dict(doc), held)
    assert report["exact"] == len(held[0].programs) + len(held[0].firsts), report["missed"]


def test_checksum_detects_a_changed_coefficient(tmp_path):
    with open(SHIPPED, encoding="utf-8") as fh:
        doc = json.load(fh)
    P.from_dict(doc, SHIPPED)      # the shipped file loads
    for cell in doc["programs"]:
        for i, ev in enumerate(cell["events"]):
            if ev.startswith("+ e*"):
                cell["events"][i] = ev.replace("+ e*", "+ 2*e*", 1)
                break
        else:
            continue
        break
    with pytest.raises(P.ProgramError, match="checksum"):
        P.from_dict(doc, "changed.json")


@pytest.mark.parametrize("event, message", [
    ("+ e*s*q", "unknown variable 'q'"),
    ("* e*s", "malformed event"),
    ("- #3", "frees no allocation"),
    ("+ e*s*b extra words", "malformed event"),
    ("+ e*s*b fwd:l#0 xE/ep", "only a free of another segment's allocation repeats"),
    ("- #0 xE", "malformed event"),
    ("- e*s fwd:l#0 xE/q", "unknown variable 'q'"),
])
def test_malformed_events_refused(event, message):
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "x", "programs": [
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ e*s", event]}]}
    doc["checksum"] = P.content_checksum(doc)
    with pytest.raises(P.ProgramError, match=message):
        P.from_dict(doc)


def test_a_repeated_free_replays_once_per_repeat():
    """`- SIZE REF xCOUNT` (one free per local expert) reads back, writes back, and plays as COUNT frees of SIZE."""
    text = "- e*s*b*h*k*ep/E fwd:layers.*.mlp.experts.local_experts.*.linear_fc2#0 xE/ep"
    ev = P.parse_event(text, "t")
    assert P.format_event(ev.op, ev.terms, ev.ref, ev.count) == text
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "x", "programs": [
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ e*s", text]}]}
    doc["checksum"] = P.content_checksum(doc)
    (cell,) = P.from_dict(doc).cells
    env = {"e": 2, "s": 8, "b": 2, "h": 4, "k": 2, "E": 8, "ep": 2}
    one = 2 * 8 * 2 * 4 * 2 * 2 / 8
    assert cell.evaluated(env) == [("+", 16.0, "")] + [("-", one, ev.ref)] * 4
    assert cell.delta_peak(env) == (16.0 - 4 * one, 16.0)


def test_expert_frees_counted_per_local_expert():
    """A SequentialMLP's backward frees each local expert's share of the tokens: one free per local expert, a
    count fitted as E/EP from runs of 4 and 8 experts, so runs of an expert count and top-k no run had (E 4, top-k 2,
    one expert rank) are replayed to the byte."""
    train = load_runs(_runs(("gpt_moe_e8k1_", "gpt_moe_k3_s")))
    held = load_runs(_runs(("gpt_moe_s",)))
    assert {r.point["E"] // r.point["ep"] for r in train} == {4, 8} and all(r.point["k"] == 2 for r in held)
    doc, _ = documents(train, fit_runs(train), "moe", "")
    fset = P.from_dict(doc)
    counted = [c for c in fset.cells if c.label == "layers.*.mlp.experts" and c.phase == "bwd"
               and any(ev.count for ev in c.events)]
    assert counted and all(P.format_size(ev.count) == "E/ep" for c in counted for ev in c.events if ev.count)
    report = check_runs(fset, held)
    assert not [m for m in report["missed"] if "experts" in m[2]]
    assert report["exact"] > 100


def test_size_text_round_trip():
    for text in ("e*s*b*h/st", "2*e*h*f/t+e*h", "3*s*b/2", "-4*s*b+8", "e*s*b*h*k*ep*etp/E*st", "0"):
        assert P.format_size(P.parse_size(text)) == text
    assert P.parse_size("3*s*b/2")[0][0] == Fraction(3, 2)


def test_shipped_set_reproduces_a_sample_of_its_runs():
    """The shipped program set against a sample of its provenance runs, re-traced from the committed files."""
    with open(SHIPPED[:-5] + ".provenance.json", encoding="utf-8") as fh:
        prov = json.load(fh)
    paths = [t["path"] for t in prov["traces"]][::40]
    runs = load_runs([os.path.join(ROOT, p) for p in paths])
    report = check_runs(P.load(SHIPPED), runs)
    named = {n.split(":")[0] for n in prov["notes"]}
    assert report["exact"] > 0
    assert {m[0] for m in report["missed"]} <= named


def test_cli_bad_input_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "fit.programs", "--check", str(bad)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("fit.programs: error:") and "Traceback" not in out.stderr


# ---- the estimator's engine on program sets (estimator.program_cache)

@pytest.mark.parametrize("name", [
    "gpt_base_s64_b2_h64_a4", "llama_bf16_s48_b2_h64_a4", "llama_tp2sp_s48_b3_h128_a8",
    # recompute is never fitted: composed from the plain layer's programs, so these runs are held out
    "gpt_selective_s48_b3_h128_a8", "llama_selective_s80_b2_h96_a4"])
def test_estimate_from_the_shipped_program_set_matches_the_run(name):
    """The estimator walks the run's op structure with each segment's program replayed at its sizes: the rank's
    peak equals the tracing allocator's within 0.2% (4-byte optimizer scalars are left out on purpose)."""
    from estimator import formulas as F
    path = os.path.join(TRACES, name)
    fset = F.load(SHIPPED)
    assert fset.programs is not None
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, _ = rank_peaks(path, fset)
    for p, m in zip(predicted, measured):
        assert -0.002 <= (p - m) / m <= 0.002, (name, p, m)


@pytest.mark.parametrize("name", ["ho_mla_w1_noq_s112_b2", "ho_mlarope_tp4_sp_s128_b1", "ho_mla_pp2_l4_s80_b3",
                                  "ho_mlarope_moe_gg_tp2_sp_ep4_s128"])
def test_multi_latent_attention_runs_the_fit_never_saw(name):
    """Multi-latent attention on the GPU kernels' stand-ins, shapes and layouts outside the campaign
    (fit/grids/make_cpu_mla_heldout.py): within 1% of the tracing allocator's peak, the layers' own rotary caches
    (estimator.persistent_state.mla_rotary_bytes) included (without them the runs with unfused YaRN read 3-14%
    under)."""
    from estimator import formulas as F
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, _ = rank_peaks(os.path.join(ROOT, "fit", "traces", "cpu_mla_heldout", name), F.load(SHIPPED))
    for p, m in zip(predicted, measured):
        assert -0.01 <= (p - m) / m <= 0.01, (name, p, m)


def test_first_layer_programs_free_what_only_it_holds():
    """The model's first layer frees more than the layers after it (a bf16 RMSNorm model): the set keeps its own
    programs for it, and without them the walk would free too little there and too much after every layer."""
    runs = load_runs(_runs(("llama_bf16_s48_b2",)))
    differs = [k for k, p in runs[0].firsts.items() if p.compute != runs[0].programs[k].compute]
    assert differs
    fset = P.load(SHIPPED)
    assert any(c.first for c in fset.cells)
    report = check_runs(fset, runs)
    assert not report["missed"]


def test_alternatives_take_the_highest():
    """Two programs whose `when` both match (structures no switch separates) are alternatives: the estimate takes
    the one that peaks highest at the config's sizes, whichever comes first in the file."""
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "x", "programs": [
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ e*s*b", "- #0"]},
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ e*s*b", "+ s*s*b", "- #1", "- #0"]}]}
    doc["checksum"] = P.content_checksum(doc)
    fset = P.from_dict(doc)
    env = {"e": 2, "s": 64, "b": 2}
    cell, (delta, peak), measured = fset.answer("fwd", "l", {}, env)
    assert cell is fset.cells[1] and delta == 0 and peak == 2 * 64 * 2 + 64 * 64 * 2
    cells, _ = fset.select("fwd", "l", {})
    assert len(cells) == 2


def test_gpu_traces_fit_exactly():
    """The H100 campaign's traces fit as programs: every label phase of every run reproduced to the byte (the
    bias-dropout-add fusion is a switch of its own; structures of one switch combination are alternatives)."""
    from fit.dataset import header_kernels
    gpu = os.path.join(ROOT, "fit", "traces", "gpu_h100")
    with open(os.path.join(gpu, "gpt_nofusion_s512_b4_h1536_a12", "rank0.json"), encoding="utf-8") as fh:
        assert header_kernels(json.load(fh))["fuse_bda"] is False
    with open(os.path.join(gpu, "gpt_base_s512_b4_h1536_a12", "rank0.json"), encoding="utf-8") as fh:
        assert header_kernels(json.load(fh))["fuse_bda"] is True
    runs = load_runs([gpu])
    doc, prov = documents(runs, fit_runs(runs), "gpu", "")
    report = check_runs(P.from_dict(doc), runs)
    assert report["exact"] > 5000 and not report["missed"] and not report["bounded"]


def test_a_size_below_zero_is_clamped_and_the_fit_names_such_sizes():
    """A size fitted exactly on a few runs with a negative term can go below zero far from them: the estimate
    takes 0 bytes for it, and the provenance lists every such size of the shipped sets."""
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "x", "programs": [
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ 90*e-22*e*b", "+ e*s", "- #0"]}]}
    doc["checksum"] = P.content_checksum(doc)
    (cell,) = P.from_dict(doc).cells
    assert cell.signed({"e": 2, "b": 8, "s": 16}) == [0.0, 32.0, -0.0]
    for name in ("cpu_compose", "gpu_h100"):
        with open(os.path.join(ROOT, "fit", "sets", f"{name}.provenance.json"), encoding="utf-8") as fh:
            listed = json.load(fh)["negative_terms"]
        with open(os.path.join(ROOT, "fit", "sets", f"{name}.json"), encoding="utf-8") as fh:
            shipped = json.load(fh)
        negative = [e for c in shipped["programs"] for e in c["events"]
                    if e.startswith("+") and "-" in e.split()[1]]
        assert len(listed) == len(negative)


def test_worker_buffers_pair_by_allocation_order_across_runs():
    """gloo's worker allocates its buffers in a fixed order; a run's k-th worker pair is another run's k-th even
    where their sizes cross between runs (E 4 vs E 8 all-to-all under TP 2 + SP: a 128-byte buffer before a 96-byte
    one in one run, 64 before 192 in another), so the structure group's widest windows are taken pair by pair."""
    cover = os.path.join(ROOT, "fit", "traces", "cpu_moe_cover", "moecover46_s48_b1_h64_a8")
    runs = load_runs(_runs(("llama_moe_a2a_bf16_tp2sp_s48_b1_h64_a8",)) + [cover])
    progs = [r.programs[("fwd", "layers.*.mlp@router")] for r in runs]
    assert progs[0].shape == progs[1].shape
    windows = [[(a, u) for _, a, u in p.workers] for p in progs]
    sizes = [[size for size, _, _ in p.workers] for p in progs]
    assert windows[0] == windows[1] and all(w == sorted(w) for w in windows)
    assert sizes[0] != sorted(sizes[0]) or sizes[1] != sorted(sizes[1])   # ordered by allocation, not by size


def test_structure_is_the_whole_model_when_pipeline_stages_are_the_majority():
    """A pipeline stage runs part of the model: the first stage of PP 2 has no output layer or loss, the last no
    embedding. A run's structure is its traced ranks' together (fit.programs.build.run_children): three PP 2 runs
    (both stages traced) and one single-process run of the same switches (Megatron's GPU kernels on the stand-ins,
    fake process group) all read the whole model, in order, and so does the fitted `step`, so the estimator takes
    each stage's part of it; the first stage alone would drop the loss everywhere."""
    from fit.programs.switches import fit_structure
    d = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels")
    runs = load_runs([os.path.join(d, n) for n in sorted(os.listdir(d))
                      if n.startswith(("llama_pp2_", "llama_w1_s48"))])
    assert len(runs) == 4
    stages = {tuple(r.children["step"]) for r in runs}
    assert len(stages) == 1
    (whole,) = stages
    assert whole[-2:] == ("output_layer", "loss") and "embedding" in whole
    (step,) = [e for e in fit_structure(runs) if e["op"] == "step"]
    assert step["children"] == list(whole) and "note" not in step


def test_a_run_whose_loss_scaler_skipped_steps_is_refused(tmp_path):
    """fp16's dynamic loss scale starts at 2**32 unless told otherwise; a short run then skips its optimizer steps
    (the gradients overflow) and never makes the optimizer state: the fit refuses such a run, naming why."""
    import shutil
    from fit.dataset import DatasetError
    src = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels", "gpt_fp16_w1_s48_b1_h128")
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    load_runs([str(dst)])      # the committed run stepped every iteration (loss scale from 4096)
    head = json.load(open(dst / "rank0.json"))
    assert head["skipped_iterations"] == 0 and "--fp16" in head["argv"]
    head["skipped_iterations"] = 3
    (dst / "rank0.json").write_text(json.dumps(head))
    with pytest.raises(DatasetError, match="loss scaler skipped 3 of its optimizer steps"):
        load_runs([str(dst)])


def test_grouped_gemm_experts_are_a_structure_of_their_own():
    """MoE experts as TE's grouped GEMM (TEGroupedMLP: one linear_fc1 and one linear_fc2 over every local expert's
    tokens) and as megatron's SequentialMLP (one subtree per local expert) are different op structures: the fitted
    structure tells them apart by the `grouped_gemm` switch, from committed runs of both (the stand-ins, fake
    process group, EP 4 with the all-to-all dispatcher)."""
    from fit.programs.switches import fit_structure
    d = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels")
    runs = load_runs([os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith("llama_moe_ep4_a2a_")])
    assert sorted(r.switches["grouped_gemm"] for r in runs) == [False] * 3 + [True] * 3
    entries = [e for e in fit_structure(runs) if e["op"] == "layers.*.mlp.experts"]
    assert {e["when"]["grouped_gemm"]: e["children"] for e in entries} == {
        True: ["layers.*.mlp.experts.linear_fc1", "layers.*.mlp.experts.linear_fc2"],
        False: ["layers.*.mlp.experts.local_experts.*"]}


def test_a_variable_no_run_moved_leaves_its_labels_extrapolated(tmp_path):
    """A label whose runs all had one top-k (and one expert count and width) cannot say how its sizes depend on
    them: the set records those values (`fixed`), and a config with another top-k reads that label as extrapolated,
    not measured, while the runs' own top-k reads it measured. Committed grouped-GEMM runs of one expert variant."""
    from estimator import formulas as F
    from estimator.memory import estimate
    from fit.dataset import traced_config
    d = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels")
    runs = load_runs([os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith("llama_moe_ep4_a2a_gg_")])
    train = [r for r in runs if r.point["k"] == runs[0].point["k"] and r.point["E"] == runs[0].point["E"]]
    train += [r for r in load_runs([os.path.join(d, n) for n in sorted(os.listdir(d))
                                    if n.startswith(("llama_moe_ep4_ag_gg_", "llama_moe_tp2_sp_ep4_a2a_gg_"))])
              if r.point["k"] == train[0].point["k"] and r.point["E"] == train[0].point["E"]]
    assert len(train) >= 2 and len({(r.point["s"], r.point["b"], r.point["h"]) for r in train}) >= 2
    doc, _ = documents(train, fit_runs(train), "one_variant", "")
    label = "layers.*.mlp.experts.linear_fc1"
    assert {v: doc["fixed"][label][v] for v in ("k", "E", "fe")} == \
        {v: train[0].point[v] for v in ("k", "E", "fe")}
    assert "s" not in doc["fixed"][label]      # the sequence length moved
    path = tmp_path / "one_variant.json"
    path.write_text(P.to_json(doc))
    cfg, _, _ = traced_config(train[0].path)
    assert label not in estimate(cfg, F.load(str(path))).coverage["extrapolated"]
    cfg.moe_router_topk = 2 * train[0].point["k"]
    assert label in estimate(cfg, F.load(str(path))).coverage["extrapolated"]


def test_runs_are_split_first_by_the_kernel_switch_their_campaigns_differ_in():
    """The greedy cell tree pools runs of both kinds of norm kernels and picks whichever switch leaves fewest runs
    outside their part's structure (here `dtype`); with the switch named to split first, its values' runs are
    fitted apart wherever they hold different structures (SPLIT_FIRST; the shipped set's norm and decoder labels)."""
    from types import SimpleNamespace as NS

    from fit.programs.fit import cell_tree
    from fit.programs.switches import split_first

    def item(norm, dtype, shape):
        return NS(switches={"torch_norm": norm, "dtype": dtype}), NS(shape=shape)

    items = [item("cpu", "bf16", "frees its input")] * 2 + [item("cpu", "fp32", "keeps it")] * 2 + \
        [item("cuda", "bf16", "keeps it")]
    keys = ["torch_norm", "dtype"]
    assert [path[0][0] for path, _ in cell_tree(items, keys)] == ["dtype"] * 3
    split = cell_tree(items, keys, first=("torch_norm",))
    assert sorted(path for path, _ in split) == [
        (("torch_norm", "cpu"), ("dtype", "bf16")), (("torch_norm", "cpu"), ("dtype", "fp32")),
        (("torch_norm", "cuda"),)]
    assert split_first("decoder@layers.*") == ("torch_norm",) and split_first("layers.*.mlp") == ()
    shipped = json.load(open(SHIPPED, encoding="utf-8"))
    cells = [c for c in shipped["programs"] if c["label"] == "decoder@layers.*" and c["when"] != [{}]]
    assert cells and all("torch_norm" in w for c in cells for w in c["when"])
