"""GPU runtime buffers (estimator.gpu_runtime): sizes from their sources, placement per stage, the CPU view, the
512-byte rounding against a direct per-shard count, and how they enter the estimate (category, after-step level)."""
import json
import os

import pytest

from estimator import cli, gpu_runtime as G, memory as M
from estimator.static_memory import chunk_buffer

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --micro-batch-size 4 --global-batch-size 32 "
         "--seq-length 1024 --max-position-embeddings 1024 --bf16 --tokenizer-type GPT2BPETokenizer").split()


def report(*extra, nproc=8, env=None, monkeypatch=None):
    for k in G.ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return cli.build_report(["--nproc_per_node", str(nproc)] + SMALL + list(extra))


def items(rank):
    return {it.name: it.bytes for it in rank.gpu_runtime}


@pytest.mark.parametrize("config, want", [
    (None, 32 * MiB),                                   # torch's Hopper default (4096 KiB x 8)
    (":4096:8", 32 * MiB),                              # Megatron-LM's CI setting
    (":4096:2:16:8", 8 * MiB + 128 * 1024),             # every :SIZE:COUNT pair adds SIZE*COUNT KiB
    (":16:8", 128 * 1024),
    ("garbage", 32 * MiB),                              # unparsable: torch warns and takes the default
])
def test_cublas_workspace_config(config, want):
    assert G.cublas_workspace_bytes(config) == want


def test_cublas_pre_hopper_default():
    assert G.cublas_workspace_bytes(None, hopper=False) == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_te_stage_has_two_torch_and_one_te_workspace(monkeypatch):
    rep = report("--transformer-impl", "transformer_engine", "--use-distributed-optimizer", monkeypatch=monkeypatch)
    r = rep.estimate.ranks[0]
    assert items(r) == {"torch cuBLAS workspaces": 64 * MiB, "Transformer Engine GEMM workspace": 32 * MiB + 1024}
    assert r.bytes["gpu_runtime"] == 96 * MiB + 1024
    # persistent: the level after the optimizer step is the static memory plus the runtime buffers
    assert r.after_step_bytes == r.static.total_bytes + 96 * MiB + 1024
    assert abs(sum(r.bytes.values()) - r.peak_bytes) <= 1


def test_workspace_config_from_the_environment(monkeypatch):
    r = report("--transformer-impl", "local", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"},
               monkeypatch=monkeypatch).estimate.ranks[0]
    assert items(r) == {"torch cuBLAS workspaces": 2 * (8 * MiB + 128 * 1024)}   # no TE workspace on the local spec


def test_grouped_gemm_workspaces_and_allgather_dispatcher_buffer(monkeypatch):
    rep = report("--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--num-experts", "8", "--moe-router-topk", "2",
                 "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--moe-grouped-gemm",
                 "--disable-bias-linear", monkeypatch=monkeypatch)
    got = items(rep.estimate.ranks[0])
    assert got["TE grouped-GEMM workspaces"] == 4 * (32 * MiB + 1024)
    # allgather dispatcher: (s/t)*b tokens gathered over expert-TP x EP = 4 ranks, h wide, bf16; larger than the
    # output layer's sequence-parallel gather (s*b*h)
    assert got["megatron global memory buffer"] == 2 * (1024 // 2) * 4 * 4 * 512
    # alltoall dispatcher: only the output layer's gather
    rep = report("--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--num-experts", "8", "--moe-router-topk", "2",
                 "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall",
                 "--disable-bias-linear", monkeypatch=monkeypatch)
    got = items(rep.estimate.ranks[0])
    assert got["megatron global memory buffer"] == 2 * 1024 * 4 * 512 and "TE grouped-GEMM workspaces" not in got


def test_global_buffer_shared_with_the_local_attention(monkeypatch):
    # local spec: the attention's scores input (b*(a/t)*s*s) and the SP gathers share the "mpu" buffer; only what
    # the gathers add beyond it is a runtime item (here nothing: 4*4*1024*1024 elements > 1024*4*512)
    r = report("--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--sequence-parallel",
               monkeypatch=monkeypatch).estimate.ranks[0]
    assert "megatron global memory buffer" not in items(r)
    r = report("--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--num-attention-heads", "2", "--seq-length", "256", "--max-position-embeddings", "256",
               monkeypatch=monkeypatch).estimate.ranks[0]
    attn, gather = 2 * 4 * 1 * 256 * 256, 2 * 256 * 4 * 512
    assert items(r)["megatron global memory buffer"] == gather - attn


def test_cpu_view_keeps_only_what_a_cpu_run_allocates(monkeypatch):
    args = ["--nproc_per_node", "8"] + SMALL + ["--transformer-impl", "transformer_engine",
                                                  "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    gpu = cli.build_report(args).estimate.ranks[0]
    cpu = cli.build_report(args, device="cpu").estimate.ranks[0]
    assert [it.name for it in cpu.gpu_runtime] == ["megatron global memory buffer"]
    only = sum(it.bytes for it in gpu.gpu_runtime if it.gpu_only)
    assert only >= 96 * MiB and gpu.peak_bytes - cpu.peak_bytes == only


def _direct_padding(cfg, chunks, pp_rank):
    """Every bucket, every parameter, every shard window: the fp32 pieces (main copy + 2 Adam moments) rounded."""
    dp = cfg.data_parallel_size * cfg.context_parallel_size
    dpe = cfg.expert_data_parallel_size or cfg.data_parallel_size
    from estimator.static_memory import ddp_bucket_size
    best = 0
    for r in sorted({0, max(dp, dpe) - 1}):
        tot = 0
        for ci, ch in enumerate(chunks):
            bs = ddp_bucket_size(cfg) if (pp_rank == 0 and ci == 0) else None
            for is_exp, d in ((False, dp), (True, dpe)):
                _, lay = chunk_buffer(ch, is_exp, d, True, bs)
                if lay is None:
                    continue
                for b0, b1 in lay.buckets:
                    size = (b1 - b0) // d
                    lo, hi = b0 + (r % d) * size, b0 + (r % d + 1) * size
                    for p0, p1 in lay.param_ranges:
                        if p0 >= b0 and p1 <= b1 and p1 > lo and p0 < hi:
                            m = 4 * (min(p1, hi) - max(p0, lo))
                            tot += 3 * (-(-m // 512) * 512 - m)
        best = max(best, tot)
    return best


@pytest.mark.parametrize("extra", [
    ["--nproc_per_node", "6"],
    ["--nproc_per_node", "6", "--overlap-grad-reduce", "--ddp-bucket-size", "100000"],
    ["--nproc_per_node", "12", "--pipeline-model-parallel-size", "2", "--num-experts", "4",
     "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--ffn-hidden-size", "1000"],
])
def test_rounding_of_distributed_optimizer_shards(extra):
    base = ("--num-layers 4 --hidden-size 520 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
            "--micro-batch-size 1 --global-batch-size 12 --bf16 --use-distributed-optimizer --vocab-size 1000 "
            "--tokenizer-type NullTokenizer").split()
    cfg = cli.build_report(base + extra).cfg
    for r, chunks in M.all_param_chunks(cfg).items():
        got = G.rounding_bytes(cfg, chunks, r)
        assert got == _direct_padding(cfg, chunks, r) and got > 0


def test_rounding_without_distributed_optimizer():
    # every parameter is its own bf16 tensor plus three fp32 optimizer tensors; 520-wide tensors are not 512-byte
    # multiples (the 520 x 520 weights and the 1000 x 520 embedding are: 2 and 4 bytes x 8 x 520 x k)
    cfg = cli.build_report("--nproc_per_node 1 --num-layers 1 --hidden-size 520 --num-attention-heads 8 "
                           "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 1 "
                           "--bf16 --vocab-size 1000 --tokenizer-type NullTokenizer".split()).cfg
    chunks = M.all_param_chunks(cfg)[0]
    want = 0
    for ch in chunks:
        for p in ch:
            n = p[0]
            want += (-2 * n) % 512 + 3 * ((-4 * n) % 512)
    assert G.rounding_bytes(cfg, chunks, 0) == want > 0


def test_json_lists_the_items_and_the_after_step_level(monkeypatch):
    rep = report("--transformer-impl", "transformer_engine", monkeypatch=monkeypatch)
    from estimator.report_json import json_text
    doc = json.loads(json_text(rep))
    st = doc["stages"][0]
    assert sum(it["bytes"] for it in st["gpu_runtime"]) == st["bytes"]["gpu_runtime"] == 96 * MiB + 1024
    assert all(it["modelled"] and it["persistent"] for it in st["gpu_runtime"])
    assert st["after_step_bytes"] == round(rep.estimate.ranks[0].after_step_bytes)
    assert doc["ranks"][0]["bytes"]["gpu_runtime"] == 96 * MiB + 1024
    # outside PyTorch's allocator: its own lines in the budget, not in the allocated peak
    b = doc["memory_budget"]["stages"][0]
    assert b["allocated_peak_bytes"] == st["peak_bytes"] and b["cuda_context_bytes"] > 0 and b["nccl_bytes"] > 0


def _core_rows(args, formulas="modelled", env=None, monkeypatch=None):
    """The core-attention rows under a set (the modelled one: its fp32-softmax fallback row is the subject)."""
    if monkeypatch is not None:
        monkeypatch.delenv("NVTE_MASKED_SOFTMAX_FUSION", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
    base = ("--nproc_per_node 1 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 1 "
            "--global-batch-size 1 --bf16 --vocab-size 100 --tokenizer-type NullTokenizer --attention-dropout 0 "
            "--hidden-dropout 0").split()
    rep = cli.build_report(base + args + (["--formulas", formulas] if formulas else []))
    return {op: d["saved"] for op, d in rep.estimate.ranks[0].per_op.items() if "core_attention" in op}


@pytest.mark.parametrize("args, fallback", [
    (["--seq-length", "1024", "--max-position-embeddings", "1024"], False),        # the fused kernel runs
    (["--seq-length", "8192", "--max-position-embeddings", "8192"], True),         # sk > 4096: torch's fp32 path
    (["--seq-length", "1024", "--max-position-embeddings", "1024", "--no-masked-softmax-fusion"], True),
])
def test_fp32_softmax_fallback_row_local_spec(args, fallback, monkeypatch):
    rows = _core_rows(["--transformer-impl", "local", "--attention-softmax-in-fp32"] + args, monkeypatch=monkeypatch)
    s = int(args[1])
    extra = rows.get("layers.*.self_attention.core_attention_fp32_softmax", 0)
    assert extra == (4 * 4 * s * s * 2 if fallback else 0)   # 4 bytes x heads x s^2 x b=1, x 2 layers
    # without --attention-softmax-in-fp32 the fallback stays 16-bit: nothing added
    rows = _core_rows(["--transformer-impl", "local"] + args, monkeypatch=monkeypatch)
    assert "layers.*.self_attention.core_attention_fp32_softmax" not in rows


def test_fp32_softmax_fallback_row_te_unfused_and_fitted_sets(monkeypatch):
    te = ["--transformer-impl", "transformer_engine", "--attention-backend", "unfused", "--seq-length", "1024",
          "--max-position-embeddings", "1024"]
    assert "layers.*.self_attention.core_attention_fp32_softmax" not in _core_rows(te, monkeypatch=monkeypatch)
    rows = _core_rows(te, env={"NVTE_MASKED_SOFTMAX_FUSION": "0"}, monkeypatch=monkeypatch)
    assert rows["layers.*.self_attention.core_attention_fp32_softmax"] == 4 * 4 * 1024 * 1024 * 2
    # a fitted set measured torch's path on CPU already: no row
    local = ["--transformer-impl", "local", "--attention-softmax-in-fp32", "--no-masked-softmax-fusion",
             "--seq-length", "256", "--max-position-embeddings", "256"]
    assert "layers.*.self_attention.core_attention_fp32_softmax" not in _core_rows(local, formulas="cpu_compose",
                                                                                   monkeypatch=monkeypatch)
