"""The predicted allocation stream (estimator.alloc_stream) and the modelled reserved memory in the report: the
stream carries the estimate's bytes (static exactly, the peak to within the 512 B rounding of its tensors), a real
trace's stream is extracted exactly (tracer.reserved), the synthesized stream fragments like the real one on the
packed CPU traces (benchmarks/reserved_model.py has the full table), and the report, JSON and verdict carry the
modelled reserved figure under the allocator settings in force."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator import alloc_stream as AS
from estimator import persistent_state
from estimator import verdict as V
from estimator.caching_allocator import parse_alloc_conf, replay
from estimator.cli import build_report
from estimator.report import to_json

ROOT = Path(__file__).resolve().parents[1]
PACKED = ROOT / "fit" / "traces" / "cpu_compose"
BASE = "--nproc_per_node 8 --micro-batch-size 1 --global-batch-size 64 --bf16 "
CASES = [
    "--preset llama2_7b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer",
    "--preset llama2_7b --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--preset mixtral_8x7b --expert-model-parallel-size 8 --use-distributed-optimizer --num-layers 4",
    # a composed set: a checkpoint holds its output's gradient in its backward (compose._replay_backward)
    "--preset llama2_7b --tensor-model-parallel-size 2 --sequence-parallel --recompute-activations "
    "--formulas cpu_compose",
    # a program set's own tensors under interleaved pipelining: a chunk before the last holds its output's gradient
    # to its backward's end, then frees it with its other tensors
    "--preset llama2_7b --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 --formulas gpu_h100",
    "--preset mixtral_8x7b --expert-model-parallel-size 8 --num-layers 4 --formulas cpu_compose",
]


def _live(events) -> tuple:
    """(peak, end) of the unrounded live bytes of an event list."""
    size, live, peak = {}, 0, 0
    for e in events:
        if e[0] == "a":
            size[e[1]] = e[2]
            live += e[2]
            peak = max(peak, live)
        else:
            live -= size.pop(e[1])
    return peak, live


@pytest.mark.parametrize("args", CASES)
def test_stream_carries_the_estimate(args):
    rep = build_report(shlex.split(BASE + args))
    cfg, est = rep.cfg, rep.estimate
    for r in est.ranks:
        events = AS.stage_stream_events(cfg, rep.formula_set, est, r.pp_rank)
        peak, end = _live(events)
        # After the iterations only the static memory is live: weights, grads, optimizer states, exactly (the
        # stream's tensors are whole bytes; the static figures are integers), and the pipeline's p2p tensors that
        # the model chunks keep across iterations (an input and its gradient per receiving chunk).
        hidden = int(AS._context(cfg, rep.formula_set)[0].hidden)
        vpp = cfg.virtual_pipeline_model_parallel_size or 1
        kept = 0 if cfg.pipeline_model_parallel_size == 1 else 2 * (vpp - (r.pp_rank == 0))
        runtime = sum(n for n, _ in AS.runtime_tensors(r))     # GPU runtime buffers, persistent once allocated
        # the rotary cache and the MoE layers' routing state (estimator.persistent_state)
        kept_state = persistent_state.stage_bytes(cfg, AS._context(cfg, rep.formula_set)[1][r.pp_rank])
        assert end == r.static.total_bytes + kept * hidden + runtime + kept_state
        # The peak is the estimate's less the 512-byte block rounding (the stream holds requested sizes; the replay
        # rounds each block), up to rounding each of the stream's tensors up to a byte.
        rounding = sum(it.bytes for it in r.gpu_runtime if it.count == 0)
        n_alloc = sum(1 for e in events if e[0] == "a")
        assert r.peak_bytes - rounding - 1 <= peak <= r.peak_bytes - rounding + n_alloc
        # allocated_bytes counts blocks: 512 B multiples, and a cached block handed out whole when the rest would
        # be too small to split (<= 1 MiB in the large pool).
        rounded = replay(events)["peak_allocated_bytes"]
        assert peak <= rounded <= 1.005 * r.peak_bytes


def test_static_tensors_as_megatron_makes_them():
    # Distributed optimizer: per chunk and dense|expert group one param buffer and one grad buffer (torch.zeros of
    # the padded numel), the parameters' own storage freed once copied in; bf16 params: fp32 master shards.
    rep = build_report(shlex.split(BASE + CASES[0]))
    r = rep.estimate.ranks[0]
    st = AS.Stream()
    made = AS._init_static(rep.cfg, st, AS._context(rep.cfg, rep.formula_set)[1][0], 0, r.static)
    _, live = _live(st.events)
    assert live == made == r.static.weights_bytes + r.static.grad_buffer_bytes + r.static.optimizer_detail[
        "master_params_bytes"]
    sizes = sorted((e[2] for e in st.events if e[0] == "a"), reverse=True)
    assert sizes[0] == r.static.grad_buffer_bytes and sizes[1] == r.static.weights_bytes   # 4 B vs 2 B per elem


def test_master_copies_are_cloned_then_converted():
    # megatron-core makes each fp32 master copy as `param.detach().clone().float()` (the shard's, with the
    # distributed optimizer): a 16-bit clone, the fp32 copy, then the clone is freed
    for args in ("--preset llama2_7b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                 CASES[0]):
        rep = build_report(shlex.split(BASE + args))
        r = rep.estimate.ranks[0]
        st = AS.Stream()
        AS._init_static(rep.cfg, st, AS._context(rep.cfg, rep.formula_set)[1][0], 0, r.static)
        ev = st.events
        masters = [i for i, e in enumerate(ev) if e[0] == "a" and i + 2 < len(ev) and ev[i + 2] == ("f", e[1])]
        assert masters and len(masters) == len(AS._step_order(rep.cfg, AS._context(rep.cfg, rep.formula_set)[1][0], 0))
        for i in masters:
            assert ev[i + 1][2] == 2 * ev[i][2]      # bf16 clone, then its fp32 copy


def test_cublas_workspaces_come_with_the_first_gemms():
    # torch allocates a thread's cuBLAS workspace at its first GEMM (measured on H100: the allocator's own request
    # stream); the training loop's thread in the first forward, autograd's in the first backward
    from estimator.gpu_runtime import TORCH_WORKSPACES
    rep = build_report(shlex.split(BASE + "--preset llama2_7b --tensor-model-parallel-size 2 --formulas gpu_h100"))
    r = rep.estimate.ranks[0]
    ws = next(it for it in r.gpu_runtime if it.name == TORCH_WORKSPACES)
    st = AS._stage_events(rep.cfg, AS._context(rep.cfg, rep.formula_set), r, 1, labelled=True)
    allocs = [(k, e) for k, e in enumerate(st.events) if e[0] == "a"]
    at = [j for j, (_, e) in enumerate(allocs) if st.tags[e[1]] == "gpu runtime" and e[2] == ws.bytes / ws.count]
    assert len(at) == 2
    first = {phase: k for k, phase in reversed(st.marks)}
    for j, phase in zip(at, ("F", "B")):
        k, _ = allocs[j]
        assert k > first[phase]
        nxt = st.tags[allocs[j + 1][1][1]]
        assert AS._is_gemm(nxt.removesuffix(" (backward)")), nxt


@pytest.mark.parametrize("args", CASES[:2] + CASES[4:5])
def test_repeated_iterations_are_the_generated_ones(args):
    # the third iteration is a copy of the second (fresh ids, p2p tensors carried across): the same events as
    # generating it
    rep = build_report(shlex.split(BASE + args))
    ctx = AS._context(rep.cfg, rep.formula_set)
    for r in rep.estimate.ranks:
        copied = AS._stage_events(rep.cfg, ctx, r, 4, labelled=True)
        made = AS._stage_events(rep.cfg, ctx, r, 4, labelled=True, repeat=False)
        assert copied.events == made.events and copied.tags == made.tags and copied.marks == made.marks


def test_microbatches_replayed_cover_the_schedule():
    assert AS.replayed_microbatches(7, 4) == 7
    assert AS.replayed_microbatches(512, 8) == AS.MAX_GROUPS * 8 + 8
    assert AS.replayed_microbatches(515, 8) == AS.MAX_GROUPS * 8 + 3


def test_trace_stream_is_the_trace():
    from tracer.parse import parse_run
    from tracer.reserved import allocation_events
    pr = parse_run(str(PACKED / "gpt_base_s64_b2_h64_a4"))[0]
    events = allocation_events(pr)
    peak, end = _live(events)
    assert peak == pr.peak_bytes and end == int(pr.live[-1])
    kinds = np.asarray(pr.trace.records["kind"])
    assert sum(1 for e in events if e[0] == "a") == int(((kinds == 1) & (pr.trace.records["size"] > 0)).sum())


RUNS = ["gpt_base_s64_b2_h64_a4", "llama_tp2sp_s48_b3_h128_a8", "gpt_selective_s48_b3_h128_a8",
        "gpt_dropout_s64_b2_h64_a4", "llama_moe_s96_b1_h96_a6", "gpt_bf16_s48_b2_h64_a4"]


def test_synthesized_stream_fragments_like_the_real_one():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reserved_model import compare
    runs = [n for n in RUNS if (PACKED / n).is_dir()]
    if not runs:
        pytest.skip("no packed traces")
    rows = [r for n in runs for r in compare(n, [1, 4096], [("default", parse_alloc_conf(""))])]
    small = [r for r in rows if r["scale"] == 1]
    # Kilobyte tensors: both streams fit the same 2 MiB small-pool segments.
    assert sum(r["synth_reserved_bytes"] == r["real_reserved_bytes"] for r in small) >= len(small) - 1
    big = [r for r in rows if r["scale"] == 4096]
    errs = sorted(abs(r["synth_reserved_bytes"] / r["real_reserved_bytes"] - 1) for r in big)
    # At GPU scale (sizes x 4096) within 10% each, 6% at the median (benchmark, 176 ranks: median +3.4%).
    assert errs[-1] < 0.10 and errs[len(errs) // 2] < 0.06, errs


def test_report_json_and_verdict_carry_the_modelled_reserved():
    # the modelled set's stream: expandable segments' gain below is a property of the stream replayed
    args = shlex.split(BASE + CASES[0]) + ["--formulas", "modelled"]
    rep = build_report(args + ["--gpu-memory", "H100"])
    doc = to_json(rep)
    model = doc["reserved_model"]
    assert model["label"].startswith("modelled") and "caching-allocator model" in model["label"]
    assert model["allocator_settings"]["source"] in ("defaults", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    for s, b in zip(doc["stages"], doc["memory_budget"]["stages"]):
        assert s["reserved_bytes"] == s["peak_bytes"] + b["fragmentation_bytes"] > s["peak_bytes"]
    assert doc["memory_budget"]["allowances"]["fragmentation_percent"] is None
    # expandable_segments: one growing segment per pool, far less reserved beyond allocated.
    exp = build_report(args + ["--cuda-alloc-conf", "expandable_segments:True"])
    for a, b in zip(exp.reserved.stages, rep.reserved.stages):
        assert a.fragmentation_bytes < b.fragmentation_bytes / 4
    assert exp.reserved.settings()["expandable_segments"] and exp.reserved.source == "--cuda-alloc-conf"
    # An explicit percent wins over the model.
    pct = build_report(args + ["--fragmentation-percent", "5"]).budget
    assert [s.fragmentation for s in pct.stages] == pytest.approx([0.05 * r.peak_bytes for r in rep.estimate.ranks])
    assert V.DEFAULTS["fragmentation_percent"] == 5.0


def test_launch_environment_sets_the_allocator():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env.pop("PYTORCH_ALLOC_CONF", None)
    argv = [sys.executable, "get_training_info.py", *shlex.split(BASE + CASES[0]), "--json"]
    doc = json.loads(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout)
    assert doc["reserved_model"]["allocator_settings"]["source"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert doc["reserved_model"]["allocator_settings"]["expandable_segments"] is True
    bad = subprocess.run(argv[:-1] + ["--cuda-alloc-conf", "max_split_size_mb:4"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --cuda-alloc-conf: max_split_size_mb too small, must be >= 20"]


def test_tracer_report_shows_the_modelled_reserved(capsys):
    from tracer import report
    from tracer.parse import parse_run
    from tracer.reserved import modelled_reserved
    run = str(PACKED / "gpt_base_s64_b2_h64_a4")
    assert report.main([run, "--json", "--cuda-alloc-conf", "expandable_segments:True"]) == 0
    got = json.loads(capsys.readouterr().out)["ranks"][0]["modelled_reserved"]
    want = modelled_reserved(parse_run(run)[0], parse_alloc_conf("expandable_segments:True"))
    assert got["reserved_peak_bytes"] == want["peak_reserved_bytes"] == 4 << 20   # two 2 MiB small-pool pages
    assert got["settings"] == "expandable_segments:True" and "H100 runs" in got["label"]
    assert report.main([run]) == 0
    assert "reserved had PyTorch's caching allocator served this stream: 4.0000 MiB" in capsys.readouterr().out
    assert report.main([run, "--cuda-alloc-conf", "max_split_size_mb:1"]) == 2
