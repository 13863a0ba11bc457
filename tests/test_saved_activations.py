"""Key validation: real megatron-core CPU runs (fp32, learned positions, no dropout, local spec) traced by the
real CPU allocator hook through `python -m tracer.profile`, parsed by tracer.parse.

Per transformer layer and microbatch, the bytes saved for backward must equal the closed form of DESIGN.md
section 7, e*(16sbh + a s^2 b) (divided by t with TP+SP), within 1%; selective recompute drops the a s^2 b
term (e*16sbh); full recompute keeps only the layer's output, which is the next layer's input (e*sbh). The parser's
peak must equal the allocator's own peak counter (`allocator_peak_bytes` in the header), exactly.

RNG states: megatron's RNG tracker fork keeps the previous generator state alive until the next fork, and
recompute's CheckpointFunction keeps more. On GPU these are host tensors the CUDA allocator never sees; the CPU
compat layer keeps its stand-ins out of the traced allocator too, and this test checks that no RNG-state-sized
(5056 B) tensor is left among the saved bytes.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tracer.parse import normalise_op, parse_run, saved_mask

pytestmark = pytest.mark.megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, B, H, A, V, L = 32, 2, 64, 4, 128, 2
E = 4                                                     # fp32
RNG_STATE_BYTES = torch.get_rng_state().nbytes            # 5056 on this torch
BASE = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(A), "--seq-length", str(S),
        "--max-position-embeddings", str(S), "--micro-batch-size", str(B), "--vocab-size", str(V),
        "--position-embedding-type", "learned_absolute", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local"]
FULL = E * (16 * S * B * H + A * S * S * B)

# name -> (nproc, extra flags, expected saved bytes per layer per microbatch on every rank)
CASES = {
    "tp1": (1, ["--global-batch-size", "4"], FULL),
    "tp2_sp": (2, ["--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
               FULL // 2),
    "pp2": (2, ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2"], FULL),
    "dist_opt": (2, ["--global-batch-size", "4", "--use-distributed-optimizer"], FULL),
    "selective": (1, ["--global-batch-size", "4", "--recompute-granularity", "selective"], E * 16 * S * B * H),
    "full": (1, ["--global-batch-size", "4", "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"], E * S * B * H),
}


def profile(out, nproc, extra):
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--nproc", str(nproc), "--out", str(out),
           "--iterations", "2", "--", *BASE, *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return parse_run(str(out))


def per_layer_saved(pr):
    """{(layer, microbatch): (saved bytes per the parser, of which RNG-state-sized tensors)} for the last iteration."""
    it = max(r["iteration"] for r in pr.op_stats)
    out = {}
    for r in pr.op_stats:
        if r["iteration"] == it and r["layer"] is not None:
            k = (r["layer"], r["microbatch"])
            out[k] = out.get(k, 0) + r["saved_bytes"]
    a = pr.allocs
    m = saved_mask(pr) & (a["size"] == RNG_STATE_BYTES)
    rng = dict.fromkeys(out, 0)
    for j in np.flatnonzero(m):
        path = pr.scope_path(int(a["op_row"][j]))
        _, layer = normalise_op(path[-1].split(":", 1)[1])
        it_j = next(int(p.split(":")[1]) for p in path if p.startswith("iter:"))
        mb_j = next(int(p.split(":")[1]) for p in path if p.startswith("fwd:"))
        if it_j == it and layer is not None:
            rng[(layer, mb_j)] += RNG_STATE_BYTES
    return {k: (v, rng[k]) for k, v in out.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            nproc, extra, _ = CASES[name]
            cache[name] = profile(tmp_path_factory.mktemp(name), nproc, extra)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CASES))
def test_scopes_nest_fwd_bwd_inside_iterations(runs, name):
    """Every fwd:/bwd:/bwdlayer: scope lies inside an iter: scope (unmatched pops would close them early)."""
    for pr in runs(name):
        for row in range(len(pr.scopes.open)):
            path = pr.scope_path(row)
            if path[-1].split(":")[0] in ("fwd", "bwd", "bwdlayer"):
                assert path[0].startswith("iter:"), f"rank {pr.rank}: {' > '.join(path)} is outside any iteration"


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_per_layer_match_closed_form(runs, name):
    nproc, _, expected = CASES[name]
    ranks = runs(name)
    assert len(ranks) == nproc
    seen_layers = set()
    for pr in ranks:
        got = per_layer_saved(pr)
        assert got, f"rank {pr.rank}: no layer ops in the trace"
        for (layer, mb), (saved, rng) in sorted(got.items()):
            seen_layers.add(layer)
            print(f"{name} rank {pr.rank} layer {layer} mb {mb}: saved {saved} B, closed form {expected} B, "
                  f"ratio {saved / expected:.5f}")
            assert rng == 0, f"RNG-state tensors leaked into the trace: {rng} B on layer {layer}"
            assert abs(saved - expected) <= 0.01 * expected, (name, pr.rank, layer, mb, saved, expected)
    assert seen_layers == set(range(L))


@pytest.mark.parametrize("name", list(CASES))
def test_parser_peak_equals_allocator_counter(runs, name):
    for pr in runs(name):
        assert pr.header["allocator_peak_bytes"] == pr.counter_peak_bytes
        assert pr.header.get("allocator_live_bytes", int(pr.live[-1])) == int(pr.live[-1])
        assert sum(pr.peak_by_category.values()) == pr.peak_bytes


def test_report_and_exports_on_a_real_run(runs, tmp_path):
    """The CLI, the snapshot (through torch's memory_viz) and the PNG on the real TP=1 megatron trace."""
    import json
    import pickle

    from torch.cuda import _memory_viz as mv

    pr = runs("tp1")[0]
    run_dir = os.path.dirname(pr.trace.path)
    r = subprocess.run([sys.executable, "-m", "tracer.report", run_dir, "--json", "--snapshot",
                        str(tmp_path / "s.pickle"), "--png", str(tmp_path / "t.png")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)["ranks"][0]
    assert j["peak_bytes"] == j["allocator_peak_bytes"] == pr.peak_bytes
    assert j["peak_phase"].startswith(("forward", "backward", "optimizer"))
    assert j["peak_by_category"]["saved"] > 0 and j["peak_by_category"]["parameter"] > 0
    total = [s for s in j["op_summary"] if s["op"].startswith("layer total")][0]
    assert abs(total["saved_min_bytes"] - FULL) <= 0.01 * FULL
    snap = pickle.load(open(tmp_path / "s.pickle", "rb"))
    assert "total_allocated" in mv.segsum(snap) and "Device 0" in mv.trace(snap)
    level = peak = 0
    for e in snap["device_traces"][0]:
        level += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, level)
    assert peak == pr.peak_bytes
    assert open(tmp_path / "t.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_static_categories_at_the_peak(runs):
    """Weights and DDP grad buffers are equal-sized fp32 buffers; with the distributed optimizer (DP=2) the param
    buffer DDP allocates is a parameter, not a gradient, and Adam's state is halved."""
    def cats(name):
        return [pr.peak_by_category for pr in runs(name)]
    for name in ("tp1", "dist_opt"):
        for c in cats(name):
            assert c["parameter"] > 0 and abs(c["parameter"] - c["gradient"]) <= 64, (name, c)
    full_adam = cats("tp1")[0]["optimizer"]
    assert full_adam >= 2 * cats("tp1")[0]["gradient"]
    for c in cats("dist_opt"):
        assert abs(c["optimizer"] - full_adam / 2) <= 0.01 * full_adam, c
