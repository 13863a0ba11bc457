"""The fit recovers known exact formulas from synthetic traces, and refuses what the data cannot determine.

Traces are written in the real file format (tracer.trace_reader.write_trace) with allocation sizes computed from
known formulas on a config grid, then go through the real parser, dataset, fit and formula-set writer; the
estimator's loader reads the result back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction as F

import numpy as np
import pytest

from estimator.formulas import kernels

from estimator.args import parse_args
from estimator.formulas import evaluate as set_evaluate
from estimator.formulas import load as load_set
from estimator.formulas import variables
from fit import basis, dataset, group, solve
from fit.__main__ import main as fit_main
from tracer.trace_reader import RECORD_DTYPE, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

mono = basis.parse_monomial


def _e(m: str, c) -> tuple:
    return (F(c), mono(m))


# Known per-op formulas (bytes). Mixed e-scaled and fixed-size terms, a rational coefficient, an s*s term.
LAYER_SAVED = [_e("s*b*h*e/st", 34), _e("s*s*b*a*e/t", 5)]
TMP = [_e("s*b*f*e/t", 2)]
FC1_SAVED = [_e("s*b*f*e/t", 1)]
BWD = [_e("s*b*h*e/st", F(1, 2)), _e("h*h/t", 4)]
OPTIM = [_e("Pstep", 4), (F(12), ())]   # CPU torch AdamW: fp32 temporaries of consecutive parameters, + 3 scalars


def value(terms, cfg) -> int:
    pt = {k: F(v) for k, v in variables(cfg).complete().items()}
    out = sum((c * basis.evaluate(m, pt) for c, m in terms), F(0))
    assert out.denominator == 1
    return int(out)


BASE = ("--num-layers 2 --hidden-size {h} --num-attention-heads {a} --seq-length {s} --max-position-embeddings {s} "
        "--micro-batch-size {b} --ffn-hidden-size {f} --vocab-size 128 --transformer-impl local "
        "--tensor-model-parallel-size {t} --nproc_per_node {t}")


def config(h=64, a=4, s=32, b=2, f=256, t=1, extra=""):
    argv = BASE.format(h=h, a=a, s=s, b=b, f=f, t=t).split() + extra.split()
    return parse_args(argv).to_dict(), argv


GRID = [dict(), dict(s=64), dict(b=1), dict(h=96), dict(a=8), dict(extra="--kv-channels 32"), dict(f=192),
        dict(t=2), dict(t=2, extra="--sequence-parallel"), dict(extra="--bf16"),
        dict(t=2, s=64, extra="--sequence-parallel --bf16")]


class _TraceWriter:
    """Builds a FORMATS 2.1 event stream: scopes, mallocs and frees, in file order."""

    def __init__(self):
        self.names, self.recs, self.stack, self.next_id, self.next_ptr = [""], [], [], 1, 4096

    def _tag(self, name):
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def _rec(self, kind, ptr=0, size=0, tag=0):
        self.recs.append((len(self.recs), ptr, size, 0, self.stack[-1] if self.stack else 0, tag, 0, -1, kind, 0))

    def push(self, name):
        self._rec(4, size=self.next_id, tag=self._tag(name))
        self.stack.append(self.next_id)
        self.next_id += 1

    def pop(self):
        self._rec(5)
        self.stack.pop()

    def malloc(self, size) -> int:
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + size + 64
        self._rec(1, ptr=ptr, size=size)
        return ptr

    def free(self, ptr, size):
        self._rec(2, ptr=ptr, size=size)

    def records(self):
        return np.array(self.recs, dtype=RECORD_DTYPE)


def write_run(path, cfg, argv, recompute_extra=0):
    """Two iterations x two microbatches x two layers; iteration 0 carries warm-up garbage the fit must skip."""
    w = _TraceWriter()
    saved, tmp, fc1 = value(LAYER_SAVED, cfg) + recompute_extra, value(TMP, cfg), value(FC1_SAVED, cfg)
    for it in range(2):
        w.push(f"iter:{it}")
        held = {}
        for mb in range(2):
            w.push(f"fwd:{mb}")
            for layer in range(2):
                w.push(f"mod:decoder.layers.{layer}")
                held[mb, layer] = [(w.malloc(saved + (1000 if it == 0 else 0)), saved + (1000 if it == 0 else 0))]
                p = w.malloc(tmp)
                w.free(p, tmp)
                w.push(f"mod:decoder.layers.{layer}.mlp.linear_fc1")
                held[mb, layer].append((w.malloc(fc1), fc1))
                w.pop()
                w.pop()
            w.pop()
            w.push(f"bwd:{mb}")
            for layer in (1, 0):
                w.push(f"bwdlayer:decoder.layers.{layer}")
                g = value(BWD, cfg)
                p = w.malloc(g)
                w.free(p, g)
                for ptr, size in held.pop((mb, layer)):
                    w.free(ptr, size)
                w.pop()
            w.pop()
        w.push("optim")
        o = value(OPTIM, cfg)
        p = w.malloc(o)
        w.free(p, o)
        w.pop()
        w.pop()
    path.mkdir(parents=True, exist_ok=True)
    header = {"format": "megatron-memtrace", "version": 1, "rank": 0, "world_size": 1, "config": cfg,
              "argv": argv, "device": "synthetic", "backend": "host",
              "versions": {"torch": "n/a", "megatron_core": "n/a"}, "iterations": 2, "target": "harness",
              "kernels": kernels(cfg),  # as a GPU run of these flags records them
              "allocator_peak_bytes": 0}  # present: the run ended (its value is not what the fit reads)
    write_trace(str(path / "rank0"), w.records(), w.names, header=header)


@pytest.fixture(scope="module")
def grid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    dirs = []
    for i, kw in enumerate(GRID):
        cfg, argv = config(**kw)
        write_run(root / f"c{i:02d}", cfg, argv)
        dirs.append(str(root / f"c{i:02d}"))
    return root, dirs


def _by_op(formulas):
    return {f.op: f for f in formulas}


def test_recovers_known_formulas_from_synthetic_traces(grid_dirs):
    _, dirs = grid_dirs
    runs, samples = dataset.load(dirs)
    assert len(runs) == len(GRID)
    fits = _by_op(group.fit_all(samples))
    layer = fits["layers.*"]
    assert layer.ok, layer.refused
    assert layer.fits["saved"].terms == LAYER_SAVED          # warm-up iteration 0 (+1000 B) was ignored
    # The layer op's transients are fitted per allocation point (FORMATS 4, point formulas): forward, the level
    # after the temporary (freed next) and after fc1's saved output (the scope's end), each above the level with
    # the sub-ops' saved bytes (fc1's) live; backward, one point: the gradient temporary.
    fwd, bwd = layer.fits["fwd_peak"], layer.fits["bwd_peak"]
    assert isinstance(fwd, group.PointsFit) and isinstance(bwd, group.PointsFit)
    assert [sorted(f.terms) for f in fwd.fits] == [sorted(LAYER_SAVED + [_e("s*b*f*e/t", 1)]), sorted(LAYER_SAVED)]
    assert [f.terms for f in bwd.fits] == [BWD]               # rational 1/2 and a bare (fp32-sized) term
    assert layer.per == "layer"
    # dtype and sp enter through e and st: one formula spans both values, so `when` does not pin them.
    assert "dtype" not in layer.when and "sp" not in layer.when
    assert layer.when["attention"] == "unfused"
    fc1 = fits["layers.*.mlp.linear_fc1"]
    assert fc1.fits["saved"].terms == FC1_SAVED and "bwd_peak" not in fc1.fits
    assert fits["optimizer"].fits["fwd_peak"].terms == OPTIM and fits["optimizer"].per == "model"
    for f in fits.values():
        for fit in f.fits.values():
            assert fit.exact and fit.max_abs_residual == 0
            assert fit.loo_max_rel_err is None or fit.loo_max_rel_err < 1e-9


def test_cli_writes_a_set_the_estimator_predicts_unseen_configs_with(grid_dirs, tmp_path, capsys):
    root, _ = grid_dirs
    out = tmp_path / "synthetic.json"
    assert fit_main([str(root), "-o", str(out), "--name", "synthetic", "--no-loo"]) == 0
    printed = capsys.readouterr().out
    assert "34*s*b*h*e/st + 5*s*s*b*a*e/t" in printed
    fset = load_set(str(out))
    assert fset.kind == "fitted" and fset.name == "synthetic"
    assert len(fset.provenance["traces"]) == len(GRID)
    # An unseen config: bigger everything, TP 4 with SP, bf16.
    cfg, _ = config(h=256, a=16, s=128, b=4, f=1024, t=4, extra="--sequence-parallel --bf16")
    saved, fwd, bwd = set_evaluate(fset, "layers.*", cfg)
    # The layer op's forward transient is above the level with its sub-ops' saved bytes (fc1's) live.
    assert (saved, fwd, bwd) == (value(LAYER_SAVED, cfg), value(LAYER_SAVED + TMP, cfg) - value(FC1_SAVED, cfg),
                                 value(BWD, cfg))


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fit", str(tmp_path / "missing"), "-o", str(tmp_path / "x.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not a directory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("module", ["fit", "fit.segment_fit"])
@pytest.mark.parametrize("damage", ["cut", "flip", "killed"])
def test_damaged_or_truncated_traces_are_refused_unless_accepted(grid_dirs, tmp_path, module, damage):
    import shutil
    _, dirs = grid_dirs
    run = tmp_path / "run"
    shutil.copytree(dirs[0], run)
    trace = run / "rank0.trace"
    data = bytearray(trace.read_bytes())
    if damage == "cut":
        data = data[:-100]
    elif damage == "flip":
        data[64 + 48 * 5 + 3] ^= 1
    else:  # the rank's header was written at the start and never completed
        hdr = json.loads((run / "rank0.json").read_text())
        del hdr["allocator_peak_bytes"]
        (run / "rank0.json").write_text(json.dumps(hdr))
    trace.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", module, str(run), "-o", str(tmp_path / "x.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--accept-damaged" in r.stderr
    assert {"cut": "truncated", "flip": "damaged", "killed": "cut short"}[damage] in r.stderr
    if module == "fit":   # accepted: read as far as it goes, with the problem named in a warning
        r = subprocess.run(cmd + ["--no-loo", "--accept-damaged"], capture_output=True, text=True, cwd=ROOT)
        assert "warning:" in r.stderr and "refusing" not in r.stderr, r.stderr
        assert r.returncode == (0 if damage != "flip" else 2)   # a flip in the first block leaves no records


def test_tp_never_varying_is_confined_or_refused(tmp_path):
    """Only t = 1: the formula is determined within tp=False (t pinned to 1) and claims nothing for t > 1.
    Only t = 2 (tp=True, t free in the domain): /t and /st terms cannot be told apart, so it is refused."""
    for t in (1, 2):
        dirs = []
        for i, kw in enumerate(g for g in GRID if "t" not in g):
            cfg, argv = config(**{**kw, "t": t})
            write_run(tmp_path / f"t{t}_c{i}", cfg, argv)
            dirs.append(str(tmp_path / f"t{t}_c{i}"))
        _, samples = dataset.load(dirs)
        layer = group.fit_op("layers.*", [s for s in samples if s.op == "layers.*"], loo=False)
        if t == 1:
            assert all(f.when.get("tp") is False for f in layer) and any(f.ok for f in layer)
        else:
            assert not any(f.ok for f in layer)
            assert "ambiguous" in layer[0].refused["saved"] and "vary t (always 2 here" in layer[0].refused["saved"]


def _pts(rows):
    """Points from (s, b, h, a, d, t, e) rows; the other variables at a dense fp32 layout's values."""
    keys = ("s", "b", "h", "a", "d", "t", "e")
    rest = dict(st=1, f=256, v=128, E=0, k=2, fe=256, fs=0, cp=1, ep=1)
    return [{**{k: F(v) for k, v in rest.items()}, **{k: F(v) for k, v in zip(keys, r)},
             "g": F(r[3]), "etp": F(r[5])} for r in rows]


def test_refuses_collinear_features_and_names_the_ratio():
    # kv_channels is always h/heads here, so a*d and h cannot be told apart.
    pts = _pts([(32, 2, 64, 4, 16, 1, 4), (64, 2, 64, 4, 16, 1, 4), (32, 1, 96, 4, 24, 1, 4),
                (32, 2, 64, 8, 8, 2, 4), (16, 4, 128, 2, 64, 1, 2)])
    cands = [mono("s*b*a*d*e/t"), mono("s*b*h*e/t")]
    ys = [int(3 * p["s"] * p["b"] * p["a"] * p["d"] * p["e"] / p["t"]) for p in pts]
    with pytest.raises(solve.FitRefused, match=r"ambiguous.*vary a\*d/h \(always 1 here\)"):
        solve.fit_group(pts, ys, cands)


def test_a_consensus_guess_takes_the_first_of_formulas_the_sample_cannot_tell_apart():
    """A consensus search's sample where b is 2 on every run cannot tell s*b*h*e from 2*s*h*e: fit_group refuses,
    and with `guess` gives the first in basis order, whose prediction the search's other runs then check."""
    pts = _pts([(32, 2, 64, 4, 16, 1, 2), (48, 2, 96, 4, 24, 1, 2), (40, 2, 128, 8, 16, 1, 2),
                (64, 2, 64, 8, 8, 1, 2), (24, 2, 96, 6, 16, 1, 2)])
    cands = [mono("s*b*h*e"), mono("s*h*e")]
    ys = [int(p["s"] * p["b"] * p["h"] * p["e"]) for p in pts]
    with pytest.raises(solve.FitRefused, match=r"ambiguous.*vary b \(always 2 here"):
        solve.fit_group(pts, ys, cands)
    fit = solve.fit_group(pts, ys, cands, guess=True)
    assert [str(m) for _, m in fit.terms] == [str(mono("s*b*h*e"))] and fit.exact
    three = {**pts[0], "b": F(3)}
    assert fit.predict(three) == 3 * pts[0]["s"] * pts[0]["h"] * pts[0]["e"]


def test_refuses_too_few_configs():
    rows = [(32, 2, 64, 4, 16, 1, 4), (64, 2, 64, 4, 16, 1, 4), (64, 1, 64, 4, 16, 1, 4)]
    pts = _pts(rows)
    cands = [mono("s*b*h*e"), mono("s*s*b*a*e")]
    ys = [int(p["s"] * p["b"] * p["h"] * p["e"] + p["s"] ** 2 * p["b"] * p["a"] * p["e"]) for p in pts]
    # Two terms need four configs; with three, only one-term formulas are tried, and none fits.
    with pytest.raises(solve.FitRefused, match=r"at most 1 term\(s\) from 3 config\(s\).*vary .*h \(--hidden-size\)"):
        solve.fit_group(pts, ys, cands, fixed={"e"})
    with pytest.raises(solve.FitRefused, match="underdetermined: 2 config"):
        solve.fit_group(pts[:2], ys[:2], cands)
    more = _pts(rows + [(16, 3, 64, 4, 16, 1, 4)])
    fit = solve.fit_group(more, ys + [int(16 * 3 * 64 * 4 + 256 * 3 * 4 * 4)], cands, fixed={"e"})
    assert fit.terms == [(F(1), mono("s*b*h*e")), (F(1), mono("s*s*b*a*e"))]


def test_rational_snapping_and_inexact_data():
    rows = [(30, 1, 64, 1, 4), (60, 2, 64, 1, 4), (90, 1, 96, 2, 2), (30, 4, 128, 2, 4), (60, 3, 32, 1, 2)]
    pts = _pts([(s, b, h, 4, h // 4, t, e) for s, b, h, t, e in rows])
    cands = basis.candidates("layers.*.mlp.linear_fc2")
    ys = [int(F(7, 3) * p["s"] * p["b"] * p["h"] * p["e"] + 12) for p in pts]
    # Without sequence parallelism (st pinned to 1), s*b*h*e/st and s*b*h*e are the same formula.
    fit = solve.fit_group(pts, ys, cands, fixed={"st"})
    assert fit.terms == [(F(7, 3), mono("s*b*h*e/st")), (F(12), ())] and fit.exact
    # One byte off on one config: no exact sparse formula exists; refused unless a tolerance is given.
    noisy = ys[:-1] + [ys[-1] + 1]
    with pytest.raises(solve.FitRefused, match="no exact fit"):
        solve.fit_group(pts, noisy, cands, fixed={"st"}, max_terms=4)
    approx = solve.fit_group(pts, noisy, cands, fixed={"st"}, max_terms=4, tolerance=1e-3)
    assert not approx.exact and 0 < approx.max_rel_residual < 1e-3


def test_switch_that_changes_the_formula_splits_it(tmp_path):
    dirs = []
    for i, kw in enumerate(GRID):
        for rc in ("", " --recompute-granularity selective"):
            cfg, argv = config(**{**kw, "extra": kw.get("extra", "") + rc})
            extra = value([_e("s*b*h*e/st", 2)], cfg) if rc else 0
            d = tmp_path / f"c{i}{'r' if rc else ''}"
            write_run(d, cfg, argv, recompute_extra=extra)
            dirs.append(str(d))
    _, samples = dataset.load(dirs)
    parts = group.fit_op("layers.*", [s for s in samples if s.op == "layers.*"], loo=False)
    by_rc = {f.when.get("recompute"): f.fits["saved"].terms for f in parts}
    assert by_rc == {"none": LAYER_SAVED, "selective": [_e("s*b*h*e/st", 36), _e("s*s*b*a*e/t", 5)]}


def test_transient_peak_falls_back_to_an_upper_bound_that_never_under_predicts():
    # A peak is a max over allocation patterns: here max(4*s*b*h*e, s*s*b*a*e) is no polynomial.
    rows = [(s, b, h, a, h // a, 1, e) for s, b, h, a, e in
            [(16, 2, 64, 4, 4), (32, 2, 64, 4, 4), (64, 1, 64, 4, 2), (128, 1, 96, 4, 4), (48, 3, 128, 8, 2),
             (96, 2, 64, 2, 4)]]
    pts = _pts(rows)
    ys = [int(max(4 * p["s"] * p["b"] * p["h"] * p["e"], p["s"] ** 2 * p["b"] * p["a"] * p["e"])) for p in pts]
    cands = basis.candidates("layers.*.self_attention.core_attention")
    with pytest.raises(solve.FitRefused, match="no exact fit"):
        solve.fit_group(pts, ys, cands, fixed={"st"})
    fit = solve.fit_group(pts, ys, cands, fixed={"st"}, bound=1.0)
    assert not fit.exact and any("upper bound" in n for n in fit.notes)
    assert all(fit.predict(p) >= y for p, y in zip(pts, ys))
    assert all(c > 0 and c.denominator <= 1024 for c, _ in fit.terms)


@pytest.mark.parametrize("grid", ["ci_tiny", "cpu_local"])
def test_shipped_grids_are_valid_megatron_configs(grid):
    from fit.campaign import load_grid
    spec, configs = load_grid(f"fit/grids/{grid}.json")
    assert spec["name"] == grid and len({c.name for c in configs}) == len(configs)
    for c in configs:
        cfg = parse_args(c.argv + ["--nproc_per_node", str(c.nproc)])   # Megatron's validation, our parser
        assert c.nproc % (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size) == 0
    if grid == "cpu_local":  # the design varies every dense shape variable and every switch the set covers
        pts = [variables(parse_args(c.argv + ["--nproc_per_node", str(c.nproc)]).to_dict()) for c in configs]
        for v in ("s", "b", "h", "f", "a", "g", "d", "v", "t", "st", "e", "E", "k", "ep"):
            assert len({p[v] for p in pts}) > 1, v


def test_campaign_refuses_to_mix_into_an_existing_run_without_resume(tmp_path):
    from fit.campaign import GridError, run_campaign
    (tmp_path / "base").mkdir()
    with pytest.raises(GridError, match="pass --resume"):
        run_campaign("fit/grids/ci_tiny.json", str(tmp_path), resume=False)
    with pytest.raises(GridError, match="incomplete"):
        run_campaign("fit/grids/ci_tiny.json", str(tmp_path), resume=True)


# --- transients per allocation point whose count changes with the shapes (MoE: one block per local expert) ------
MOE_SW = {"attention": "unfused", "recompute": "none", "moe": True, "moe_comm": False, "sp": False, "tp": False,
          "dtype": "fp32"}


def _moe_sample(i, s, b, h, E, middle_peak=False, flaky=None):
    """A layer backward: two points before the expert loop (the second one the peak), one point per expert, two
    after; `flaky` adds a point after the head whose level is not a function of the shapes."""
    pt = {v: F(0) for v in basis.VARIABLES}
    a = 8 if i % 2 else 4       # heads vary apart from h, so s*b*h and s*b*a*d are told apart
    pt.update({k: F(x) for k, x in dict(s=s, b=b, h=h, f=4 * h, a=a, g=a, d=h // 8, v=128, E=E, k=1 + i % 3, fe=4 * h,
                                          t=1, st=1, cp=1, ep=1, etp=1, e=4, L=2).items()})
    tok = s * b * h * 4
    head = [tok, 3 * tok] + ([flaky] if flaky is not None else [])
    experts = [tok // 2 + (4 * tok if middle_peak and j == E - 1 else 0) for j in range(E)]
    vals = head + experts + [2 * tok, tok // 4]
    return dataset.Sample(f"run{i}", "layers.*", "layer", pt, dict(MOE_SW), {"saved": 0, "fwd_peak": None,
                          "bwd_peak": max(vals)}, 1, {}, {"bwd_peak": (tuple(vals), tuple([True] * len(vals)))})


MOE_SHAPES = [(32, 2, 64, 4), (64, 1, 64, 8), (32, 3, 96, 4), (48, 2, 128, 6), (16, 4, 80, 8), (40, 1, 64, 2)]


def test_points_matched_from_both_ends_when_the_count_changes():
    samples = [_moe_sample(i, *c) for i, c in enumerate(MOE_SHAPES)]
    fitter = group._OpFitter("layers.*", samples)
    fit = fitter.fit_points(samples, "bwd_peak", samples)
    assert isinstance(fit, group.PointsFit) and fit.ends == [6, 8, 10, 12]
    assert {f.point_index for f in fit.fits} >= {1}               # the peak point, matched from the start
    assert all(fit.predict(s.point) == max(s.points["bwd_peak"][0]) for s in samples)
    assert any("matched from both ends" in n for n in fit.notes)


def test_points_matched_from_both_ends_refused_when_the_middle_holds_a_peak():
    samples = [_moe_sample(i, *c, middle_peak=(i == 2)) for i, c in enumerate(MOE_SHAPES)]
    fitter = group._OpFitter("layers.*", samples)
    out = fitter.fit_points(samples, "bwd_peak", samples)
    assert isinstance(out, str) and out.startswith(group.NOT_ALIGNED) and "miss the peak of 1 config" in out


def test_unfittable_point_is_left_out_only_below_the_fitted_peak():
    # One point takes one of two levels at random (a buffer another thread may or may not have freed first).
    rng = np.random.default_rng(0)
    shapes = [(s, b, h, 4) for s, b, h, _ in MOE_SHAPES]
    below = [_moe_sample(i, *c, flaky=int(rng.choice([1, 2])) * c[0] * c[1] * c[2] * 4 + 4 * i)
             for i, c in enumerate(shapes)]
    fit = group._OpFitter("layers.*", below).fit_points(below, "bwd_peak", below)
    assert isinstance(fit, group.PointsFit) and 2 in fit.dropped
    assert all(fit.predict(s.point) == max(s.points["bwd_peak"][0]) for s in below)
    above = [_moe_sample(i, *c, flaky=(5 + i % 2) * c[0] * c[1] * c[2] * 4 + 4 * i) for i, c in enumerate(shapes)]
    out = group._OpFitter("layers.*", above).fit_points(above, "bwd_peak", above)
    assert isinstance(out, str) and out.startswith("point 3:")


def test_unfittable_point_that_sets_a_peak_gets_an_upper_bound_with_a_peak_bound():
    # The flaky level is the peak on every config: no exact formula, but with --peak-bound an upper bound of that
    # point keeps the transient, never under a traced config and over by at most the bound (of its peak).
    shapes = [(s, b, h, 4) for s, b, h, _ in MOE_SHAPES]
    above = [_moe_sample(i, *c, flaky=(5 + i % 2) * c[0] * c[1] * c[2] * 4 + 4 * i) for i, c in enumerate(shapes)]
    fit = group._OpFitter("layers.*", above, peak_bound=0.25).fit_points(above, "bwd_peak", above)
    assert isinstance(fit, group.PointsFit) and not fit.exact
    bound = next(f for f in fit.fits if f.point_index == 2)
    assert any("upper bound" in n for n in bound.notes)
    for s in above:
        peak = max(s.points["bwd_peak"][0])
        assert peak <= fit.predict(s.point) <= peak * 1.25


def test_peak_reduction_takes_the_level_most_rows_show():
    # Four layer rows of one iteration: a gloo thread shifted two of them by two hidden states, one each way.
    assert dataset.reduce_values([179968, 204544, 188160, 188160], peak=True) == 188160
    assert dataset.reduce_values([3, 1, 2], peak=True) == 3              # no level shared: cover every row
    assert dataset.reduce_values([5, 5, 7, 7], peak=True) == 7           # a tie: cover every row
    assert dataset.reduce_values([3, 1, 2, 2], peak=False) == 2          # saved bytes: the low median


def test_fits_differing_only_at_tp_without_sequence_parallelism_take_the_largest_there():
    """A part whose TP runs all have sequence parallelism (the bf16 runs of linear_fc1's backward) cannot tell
    `s*b*h*e/st` from `s*b*h*e/t`: st = t on every run, TP 2 or not. Both fit every run; they differ only at TP
    without SP, which the part never traced, so the composed fit takes the larger there instead of refusing."""
    rows = [(64, 2, 64, 4, 16, 1, 2), (32, 3, 128, 4, 32, 2, 2), (80, 2, 96, 4, 24, 2, 2), (128, 1, 64, 8, 8, 1, 2),
            (48, 3, 128, 8, 16, 2, 2), (96, 2, 64, 4, 16, 1, 2)]
    pts = [{**p, "st": p["t"]} for p in _pts(rows)]
    ys = [int(-3 * p["s"] * p["b"] * p["h"] * p["e"] / p["st"] + 4 * p["s"] * p["b"] * p["h"] * p["e"]) for p in pts]
    cands = [mono("s*b*h*e/st"), mono("s*b*h*e/t"), mono("s*b*h*e")]
    with pytest.raises(solve.FitRefused, match="ambiguous"):
        solve.fit_group(pts, ys, cands)
    fit = solve.fit_group(pts, ys, cands, largest_untraced=True)
    assert fit.exact and all(fit.predict(p) == y for p, y in zip(pts, ys))
    no_sp = {**pts[1], "st": F(1)}
    sbhe = no_sp["s"] * no_sp["b"] * no_sp["h"] * no_sp["e"]
    assert fit.predict(no_sp) == max(sbhe, -3 * sbhe / 2 + 4 * sbhe)   # -3/t kept: 2.5 hidden states, not 1
    assert "st = t" in fit.notes[0]
    # Where some TP run had no sequence parallelism, the two differ at a traced point and only one fits.
    mixed = pts[:-1] + [no_sp]
    ys = [int(-3 * p["s"] * p["b"] * p["h"] * p["e"] / p["st"] + 4 * p["s"] * p["b"] * p["h"] * p["e"]) for p in mixed]
    fit = solve.fit_group(mixed, ys, cands, largest_untraced=True)
    assert sorted(m for _, m in fit.terms) == sorted([mono("s*b*h*e"), mono("s*b*h*e/st")]) and not fit.notes


def test_input_batch_atoms_prefer_fixed_dtypes():
    cands = basis.candidates("data.mask")
    assert basis.family("data.tokens") == "data"
    assert cands[0] == basis.parse_monomial("s*b") and cands[1] == basis.parse_monomial("s*s*b")
    assert basis.parse_monomial("s*b*e") in cands


def test_fits_differing_only_at_an_untraced_parallel_size_take_the_largest_there():
    """Under sequence parallelism on TP 2 (the most a CPU campaign traces), the embedding frees two full-size
    [s, b, h] tensors: `-2*s*b*h*e` and `-4*s*b*h*e/st` fit every run exactly and differ only at TP > 2. The composed
    fit takes the one that is larger (frees less) there, so that extrapolation errs high, and says so; the per-op
    fit still refuses."""
    pts = [{**p, "st": F(2), "t": F(2), "etp": F(2)} for p in
           _pts([(64, 2, 64, 4, 16, 2, 4), (32, 3, 128, 4, 32, 2, 4), (80, 2, 96, 4, 24, 2, 4),
                 (128, 1, 64, 8, 8, 2, 4), (48, 3, 128, 8, 16, 2, 4)])]
    ys = [int(-2 * p["s"] * p["b"] * p["h"] * p["e"]) for p in pts]
    cands = [mono("s*b*h*e/st"), mono("s*b*h*e")]
    with pytest.raises(solve.FitRefused, match="ambiguous"):
        solve.fit_group(pts, ys, cands, ties={"st": "t"})
    fit = solve.fit_group(pts, ys, cands, ties={"st": "t"}, largest_untraced=True)
    assert fit.exact and all(fit.predict(p) == y for p, y in zip(pts, ys))
    at4 = {**pts[0], "t": F(4), "st": F(4)}
    assert fit.predict(at4) == -pts[0]["s"] * pts[0]["b"] * pts[0]["h"] * pts[0]["e"]   # -4/4, not -2
    assert "parallel sizes never traced" in fit.notes[0]
    # Fits that differ at a traced size as well (h varies only with a here) are still refused.
    same_h = [{**p, "h": p["a"] * 16} for p in pts]
    with pytest.raises(solve.FitRefused, match="ambiguous"):
        solve.fit_group(same_h, [int(-2 * p["s"] * p["b"] * p["h"] * p["e"]) for p in same_h],
                        [mono("s*b*a*e"), mono("s*b*h*e")], largest_untraced=True)


def test_a_fit_within_a_few_bytes_keeps_its_terms_and_drops_the_ones_that_fit_the_noise():
    """A level a stray scalar moved by a few bytes on some runs has no exact fit. The near fit recovers the true
    formula: coefficients as small rationals, no term that only fits the noise (such a term grows with the config
    where the noise does not). Where another candidate fits as well but predicts otherwise in the domain (k is 2
    on every run, so `s*b*k*h*e` and `2*s*b*h*e` cannot be told apart), it is refused as ambiguous."""
    rows = [(64, 2, 64, 4, 16, 1, 4), (32, 3, 128, 4, 32, 2, 4), (80, 2, 96, 4, 24, 2, 4), (128, 1, 64, 8, 8, 1, 4),
            (48, 3, 128, 8, 16, 2, 4), (96, 2, 64, 4, 16, 1, 4), (64, 1, 128, 8, 16, 2, 4), (112, 2, 96, 6, 16, 1, 4)]
    pts = [{**p, "E": F(4 + 4 * (i % 3)), "ep": F(1 + i % 2)} for i, p in enumerate(_pts(rows))]
    true = [_e("s*b*h*e", F(3, 2)), _e("E*h*e/ep", 2)]
    noise = [0, 8, 0, 16, 4, 0, 12, 8]
    ys = [int(sum(c * basis.evaluate(m, p) for c, m in true)) + d for p, d in zip(pts, noise)]
    cands = [mono("s*b*h*e"), mono("E*h*e/ep"), mono("e"), mono("s*b*e"), mono("h*e"), mono("E*s*b*e")]
    with pytest.raises(solve.FitRefused):
        solve.fit_group(pts, ys, cands)
    fit = solve.near_fit(pts, ys, cands, slack=64, fixed={"e"})
    assert {m: c for c, m in fit.terms} == {m: c for c, m in true} and not fit.exact
    assert 0 < fit.max_abs_residual <= 16 and "within 16 B" in fit.notes[-1]
    with pytest.raises(solve.Ambiguous, match="ambiguous.*within 64 B"):
        solve.near_fit(pts, ys, cands + [mono("s*b*h*k*e")], slack=64, fixed={"e"})
