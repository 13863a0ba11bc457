"""Real megatron-core training on CPU through `python -m tracer.profile --cpu` (built-in harness, gloo, the CPU
allocator hook): every layout trains, the loss falls, TP=2+SP matches TP=1, and each rank leaves a readable trace
with the FORMATS 2.3 scope names and a FORMATS 2.4 header.

All runs start at once in one fixture: they are dominated by process start (imports), which overlaps well.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
import torch  # noqa: E402
from tracer.trace_reader import MARK, SCOPE_POP, SCOPE_PUSH, read_trace  # noqa: E402

pytestmark = pytest.mark.megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128",
        "--make-vocab-size-divisible-by", "64",   # same padded vocab (128) for TP=1 and TP=2
        "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local", "--lr", "1e-3"]

# name -> (nproc, extra Megatron flags)
CASES = {
    "tp1": (1, []),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_1f1b": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    "dp2_distopt": (2, ["--use-distributed-optimizer"]),
    "selective": (1, ["--recompute-granularity", "selective"]),
    "full": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "moe_alltoall": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                         "--expert-model-parallel-size", "2"]),
}


def _cmd(out, nproc, extra):
    return [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--nproc", str(nproc),
            "--out", str(out), "--iterations", str(ITERS), "--", *BASE, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every case, wait for all; {name: (returncode, output, out_dir)}."""
    base = tmp_path_factory.mktemp("harness")
    procs = {}
    for name, (nproc, extra) in CASES.items():
        out = base / name
        procs[name] = (subprocess.Popen(_cmd(out, nproc, extra), cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True), out)
    results, deadline = {}, time.time() + 600
    for name, (p, out) in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        results[name] = (p.returncode, text, out)
    return results


def _ranks(runs, name):
    rc, text, out = runs[name]
    assert rc == 0, f"{name} failed:\n{text[-4000:]}"
    nproc = CASES[name][0]
    traces = [read_trace(str(out / f"rank{r}")) for r in range(nproc)]
    return traces


def _scope_paths(trace):
    """Every SCOPE_PUSH as the tuple of open scope names (outermost first); checks the stack balances."""
    rec = trace.records
    paths, stack = [], []
    for kind, tag in zip(rec["kind"], rec["tag"]):
        if kind == SCOPE_PUSH:
            stack.append(trace.name(int(tag)))
            paths.append(tuple(stack))
        elif kind == SCOPE_POP:
            assert stack, "SCOPE_POP without an open scope"
            stack.pop()
    assert stack == [], f"scopes left open at the end: {stack}"
    return paths


def _names(paths):
    return {p[-1] for p in paths}


def _replay_peak(trace):
    """A plain replay by the FORMATS rule: a MALLOC of a pointer still live replaces the old allocation (the core's
    counter does the same; a free torch made outside the hook, rare under gloo's threads, leaves such a pair)."""
    rec = trace.records
    live, peak, sizes, replaced = 0, 0, {}, 0
    for kind, ptr, size in zip(rec["kind"].tolist(), rec["ptr"].tolist(), rec["size"].tolist()):
        if kind == 1:
            replaced += ptr in sizes
            live += size - sizes.get(ptr, 0)
            sizes[ptr] = size
            peak = max(peak, live)
        elif kind == 2 and ptr in sizes:
            live -= sizes.pop(ptr)
    return peak, live, replaced


@pytest.mark.parametrize("name", list(CASES))
def test_trace_header_and_common_scopes(runs, name):
    traces = _ranks(runs, name)
    nproc = CASES[name][0]
    for r, t in enumerate(traces):
        h = t.header
        assert h["format"] == "megatron-memtrace" and h["version"] == 1
        assert h["rank"] == r and h["world_size"] == nproc and h["target"] == "harness"
        assert h["backend"] == "cpu-hook" == t.backend and h["device"] == "cpu" and h["iterations"] == ITERS
        assert set(h["coords"]) == {"tp", "cp", "ep", "dp", "pp"}
        assert h["config"]["hidden_size"] == 64 and h["config"]["world_size"] == nproc
        assert h["versions"]["megatron_core"] == "0.16.1" and h["versions"]["torch"]
        assert h["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        peak, live, replaced = _replay_peak(t)
        # The message says enough to tell a lost free from a lost record if this ever fails in CI.
        assert h["allocator_peak_bytes"] == peak > 0, (f"rank {r}: counter peak/live {h['allocator_peak_bytes']}/"
                                                       f"{h['allocator_live_bytes']}, replay {peak}/{live}, "
                                                       f"{replaced} MALLOC(s) of a live pointer, "
                                                       f"{len(t.records)} records, {t.truncated_bytes} B truncated")
        assert h["allocator_live_bytes"] == live
        paths = _scope_paths(t)
        names = _names(paths)
        assert {f"iter:{i}" for i in range(ITERS)} <= names
        assert {"fwd:0", "bwd:0", "optim", "grad_sync"} <= names
        assert any(n.startswith("bwdlayer:decoder.layers.") for n in names)
        marks = {t.name(int(g)) for g in t.records["tag"][t.records["kind"] == MARK]}
        assert {"start", "setup_done"} | {f"iter_end:{i}" for i in range(ITERS)} <= marks
        # fwd/bwd/bwdlayer/mod always sit inside an iteration; bwdlayer inside its microbatch's bwd.
        for p in paths:
            if p[-1].split(":")[0] in ("fwd", "bwd", "bwdlayer", "optim", "grad_sync"):
                assert p[0].startswith("iter:"), p
            if p[-1].startswith("bwdlayer:"):
                assert any(x.startswith("bwd:") for x in p), p
        if h["coords"]["pp"] == 0:
            assert {"mod:embedding", "mod:decoder.layers.0.self_attention.linear_qkv",
                    "mod:decoder.layers.0.mlp"} <= names


def _losses(runs, name):
    traces = _ranks(runs, name)
    last = [t for t in traces if t.header["losses"] and t.header["losses"][0] is not None]
    assert last, f"{name}: no rank reported losses"
    return last[0].header["losses"]


@pytest.mark.parametrize("name", list(CASES))
def test_loss_decreases(runs, name):
    losses = _losses(runs, name)
    assert len(losses) == ITERS and all(np.isfinite(losses))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert abs(losses[0] - np.log(128)) < 0.5, losses   # starts near uniform over the vocabulary


def test_tp2_with_sequence_parallel_matches_tp1(runs):
    tp1, tp2 = _losses(runs, "tp1"), _losses(runs, "tp2_sp")
    np.testing.assert_allclose(tp2, tp1, rtol=1e-5)
    traces = _ranks(runs, "tp2_sp")
    assert [t.header["coords"]["tp"] for t in traces] == [0, 1]
    # Same losses on both TP ranks, and each holds about half of TP=1's peak.
    assert traces[0].header["losses"] == traces[1].header["losses"]
    peak1 = _ranks(runs, "tp1")[0].header["allocator_peak_bytes"]
    assert all(t.header["allocator_peak_bytes"] < 0.75 * peak1 for t in traces)


def test_recompute_does_not_change_the_loss(runs):
    tp1 = _losses(runs, "tp1")
    for name in ("selective", "full"):
        np.testing.assert_allclose(_losses(runs, name), tp1, rtol=1e-5)


def test_pp2_1f1b_scopes(runs):
    traces = _ranks(runs, "pp2_1f1b")
    assert [t.header["coords"]["pp"] for t in traces] == [0, 1]
    first, last = (_names(_scope_paths(t)) for t in traces)
    assert {f"fwd:{m}" for m in range(4)} <= first and {f"bwd:{m}" for m in range(4)} <= first
    assert "pp_send" in first and "pp_recv" in first and "pp_send" in last and "pp_recv" in last
    # Global layer indices: stage 0 runs layer 0, stage 1 runs layer 1; the loss is on the last stage.
    assert "mod:decoder.layers.0" in first and "mod:decoder.layers.1" not in first
    assert "mod:decoder.layers.1" in last and "mod:decoder.layers.0" not in last
    assert "loss" in last and "loss" not in first
    assert traces[0].header["losses"] == [None] * ITERS


def test_dp2_distributed_optimizer(runs):
    traces = _ranks(runs, "dp2_distopt")
    assert [t.header["coords"]["dp"] for t in traces] == [0, 1]
    assert traces[0].header["config"]["use_distributed_optimizer"] is True
    for t in traces:
        paths = _scope_paths(t)
        assert any(p[-1] == "param_gather" and "optim" in p for p in paths)
    # The loss is averaged over DP ranks, so both report the same value.
    assert traces[0].header["losses"] == traces[1].header["losses"]


def test_selective_recompute_scopes(runs):
    paths = _scope_paths(_ranks(runs, "selective")[0])
    rec = [p for p in paths if p[-1].startswith("recompute:")]
    assert {p[-1] for p in rec} == {f"recompute:decoder.layers.{i}.self_attention.core_attention" for i in (0, 1)}
    assert all(any(x.startswith("bwd:") for x in p) for p in rec)


def test_full_recompute_scopes(runs):
    paths = _scope_paths(_ranks(runs, "full")[0])
    rec = {p[-1] for p in paths if p[-1].startswith("recompute:")}
    assert rec == {"recompute:decoder.layers.0", "recompute:decoder.layers.1"}
    # The re-run forward's modules nest inside the recompute scope.
    assert any(p[-1] == "mod:decoder.layers.0.mlp.linear_fc1" and "recompute:decoder.layers.0" in p for p in paths)


def test_moe_alltoall(runs):
    traces = _ranks(runs, "moe_alltoall")
    assert [t.header["coords"]["ep"] for t in traces] == [0, 1]
    for t in traces:
        names = _names(_scope_paths(t))
        assert "mod:decoder.layers.0.mlp.router" in names
        assert any(n.startswith("mod:decoder.layers.0.mlp.experts") for n in names)


def test_parser_reads_harness_traces(runs):
    """The project's parser agrees with the allocator's own peak on a harness trace."""
    from tracer.parse import parse_run
    _, _, out = runs["tp1"]
    pr = parse_run(str(out))[0]
    assert pr.peak_bytes == pr.header["allocator_peak_bytes"]
    assert {r["op"] for r in pr.op_stats} >= {"layers.*.mlp.linear_fc1", "embedding"}


# ---- per-op segments (tracer.segments): the forward and backward of every microbatch attributed op by op

def _phases(traces):
    from tracer.parse import parse_trace
    from tracer.segments import rank_segments
    for t in traces:
        pr = parse_trace(t)
        by: dict = {}
        for s in rank_segments(pr):
            by.setdefault((s.phase, s.iteration, s.microbatch, s.chunk), []).append(s)
        yield pr, by


@pytest.mark.parametrize("name", list(CASES))
def test_segments_partition_every_phase(runs, name):
    """Segments tile each fwd:/bwd: scope and replaying their deltas and peaks gives its exact levels and peak."""
    for pr, by in _phases(_ranks(runs, name)):
        assert {k[0] for k in by} == {"fwd", "bwd"}
        for key, segs in by.items():
            scope_row = next(i for i in range(len(pr.scopes.open)) if pr.scopes.open[i] == segs[0].start)
            assert segs[-1].end == pr.scopes.close[scope_row], key
            level, top = int(pr.live[segs[0].start]), 0
            for a, b in zip(segs, segs[1:]):
                assert a.end == b.start, key
            for s in segs:
                top = max(top, level + s.peak)
                level += s.delta
                assert level == pr.live[s.end], (key, s.label)
            assert top == pr.live[segs[0].start:segs[-1].end + 1].max(), key


@pytest.mark.parametrize("name", [n for n in CASES if n != "full"])
def test_backward_segments_mirror_forward(runs, name):
    """A microbatch's backward visits its ops' segments in the reverse of their forward order (so an estimator can
    replay a backward from the forward's op structure), and every layer op's backward is bracketed by its marks."""
    for pr, by in _phases(_ranks(runs, name)):
        for (phase, it, mb, chunk), bwd in by.items():
            if phase != "bwd" or it < 1:
                continue
            fwd = [(s.label, s.layer) for s in reversed(by[("fwd", it, mb, chunk)])]
            pos = 0
            for s in bwd:
                if s.delta == 0 and s.peak == 0:
                    continue
                assert (s.label, s.layer) in fwd[pos:], (name, mb, s.label, s.layer, fwd[pos:pos + 5])
                pos = fwd.index((s.label, s.layer), pos)
            labels = {s.label for s in bwd}
            assert "layers.*.self_attention.linear_qkv" in labels and any(
                lb.endswith("linear_fc1") for lb in labels), labels


def test_report_lists_segments(runs, capsys):
    """`python -m tracer.report --segments --json`: microbatch 0's segments, forward then backward, levels summed."""
    from tracer import report
    _, _, out = runs["tp1"]
    assert report.main([str(out), "--segments", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"][0]["segments"]
    for phase in ("fwd", "bwd"):
        run = [r for r in rows if r["phase"] == phase]
        assert run and all(r["peak_bytes"] >= max(0, r["delta_bytes"]) for r in run)
        assert [r["level_bytes"] for r in run] == list(np.cumsum([r["delta_bytes"] for r in run]))
    assert {r["label"] for r in rows if r["phase"] == "bwd"} >= {"layers.*.mlp.linear_fc1", "loss", "output_layer"}


def test_cpu_shims_keep_16_bit_gemms_off_onednn():
    """Where oneDNN would run bf16 GEMMs (AVX-512 BF16, AMX) its per-call scratchpad comes from c10's allocator and
    the same config would trace differently per machine; the CPU shims turn it off for the traced process."""
    code = ("import torch; from tracer import megatron_compat; assert torch.backends.mkldnn.enabled; "
            "megatron_compat.install(); print(torch.backends.mkldnn.enabled)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
