"""GPU runtime buffers: memory a GPU run's caching allocator counts (`allocated_bytes`) that no formula set holds,
per pipeline stage: all but the global memory buffer are GPU-only (a CPU trace of the same run lacks them). Modelled
from the sources cited per item, all persistent (allocated on first use, kept for the rest of training), in the
report's `gpu_runtime` category (JSON: each stage's `gpu_runtime` items).

- torch cuBLAS workspaces: aten/src/ATen/cuda/CublasHandlePool.cpp (getCurrentCUDABlasHandle ->
  setWorkspaceForHandle) allocates one workspace through the caching allocator per (cuBLAS handle, stream), and
  each thread reserves its own handle from the pool: the training loop's thread and autograd's CUDA device thread
  (torch/csrc/autograd/engine.cpp runs a device's backward on its own worker thread) each get one. (Measured
  support: Megatron-LM's published H100 run gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files holds 96 MiB
  + 4.5 KiB beyond weights, gradients and optimizer states after its step: these two and TE's below.) Size
  getChosenWorkspaceSize(): every `:SIZE:COUNT` of CUBLAS_WORKSPACE_CONFIG adds SIZE*COUNT KiB; unset, 4096 KiB x 8
  = 32 MiB on Hopper (and Blackwell in newer torch), else 4096 KiB x 2 + 16 KiB x 8. Counted on every stage (conservative: a Transformer Engine stage without Megatron's own output layer, a MoE
  router or the unfused attention may run no torch GEMM). The cuBLASLt workspace (getCUDABlasLtWorkspace, 1 MiB by
  default) is taken only by torch's Lt paths (addmm with a bias epilogue, scaled_mm), which megatron-core's GPT
  layers do not call: not counted.
- Transformer Engine GEMM workspace: transformer_engine/pytorch/cpp_extensions/gemm.py get_cublas_workspace
  (module/base.py get_workspace before TE 2.11): one per process, get_cublas_workspace_size_bytes() = 32 MiB + 1 KiB
  on compute capability >= 9 (32 MiB before TE 2.8), 4 MiB below; whenever a TE linear runs (TE spec).
- TE grouped-GEMM workspaces: the same function with grouped_gemm=True, one per compute stream
  (nvte_get_num_compute_streams() = 4): TE GroupedLinear, i.e. MoE layers with --moe-grouped-gemm on the TE spec.
- Megatron's global memory buffer (megatron/core/utils.py GlobalMemoryBuffer, parallel_state
  .get_global_memory_buffer()): one tensor per (name, dtype), grown to the largest request, never freed. Name "mpu"
  is shared by the local spec's attention scores input (static_memory.attention_buffer_bytes, counted under
  `other` as before), the sequence-parallel all-gather of megatron-core's own linears
  (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication: every column-parallel linear of the
  local spec, the output layer on either spec; (s/cp)*b*h elements) and the allgather MoE token dispatcher's
  hidden-state gather over the expert tensor x expert model parallel group (transformer/moe/token_dispatcher.py
  token_dispatch, use_global_buffer=True; (s/cp)*b/(t if SP) * etp*ep*h elements), and multi-token prediction's
  projection (2*(s/cp)*b*h elements under SP). Counted here: what the buffer holds beyond the attention part.
- Block rounding: the caching allocator hands out blocks of 512-byte multiples and allocated_bytes counts the
  blocks (c10/cuda/CUDACachingAllocator.cpp round_size, kMinBlockSize = 512). Buffers above are rounded one by
  one; the optimizer's per-parameter tensors (Megatron's fp32 main copies, one per parameter or, with the
  distributed optimizer, per parameter shard; Adam's exp_avg / exp_avg_sq likewise; the parameters themselves
  without the distributed optimizer's contiguous param buffer) add their rounding up.

Not counted here: CUDA RNG tracker states (tensor_parallel/random.py CudaRNGStatesTracker.add keeps
torch.cuda.get_rng_state(), a CPU ByteTensor, unless CUDA-graph-safe RNG is on), memory outside PyTorch's allocator
(CUDA context, NCCL: estimator.verdict's allowances), and blocks the caching allocator hands out unsplit (a cached
block up to 1 MiB larger than the request is not split: allocated_bytes then counts the whole block; a replay of
the allocation stream is needed for that).
"""
from __future__ import annotations

from typing import Optional

import os
import re
from bisect import bisect_left, bisect_right

from .static_memory import DTYPE_BYTES, attention_buffer_bytes, chunk_buffer, local_spec, precision

# The items only Transformer Engine allocates: a run of the TE spec on stand-ins (no TE installed) has none.
TE_ITEMS = ("Transformer Engine GEMM workspace", "TE grouped-GEMM workspaces")

BLOCK = 512
MiB = 1 << 20
TE_STREAMS = 4   # transformer_engine/common/util/multi_stream.cpp get_num_compute_streams
TORCH_THREADS = 2  # the training loop's thread and autograd's CUDA device thread: one cuBLAS handle each
TORCH_WORKSPACES = "torch cuBLAS workspaces"
ENV_VARS = ("CUBLAS_WORKSPACE_CONFIG",)
_CONFIG = re.compile(r":([0-9]+):([0-9]+)")


def round_block(n: int) -> int:
    """Bytes the caching allocator counts for an n-byte tensor: 512-byte multiples (0 for an empty tensor)."""
    return -(-n // BLOCK) * BLOCK if n > 0 else 0


def cublas_workspace_bytes(config: Optional[str], hopper: bool = True) -> int:
    """torch's getChosenWorkspaceSize(): CUBLAS_WORKSPACE_CONFIG (':SIZE:COUNT' KiB pairs, summed) or the default."""
    default = 4096 * 8 * 1024 if hopper else 4096 * 1024 * 2 + 16 * 1024 * 8
    if not config:
        return default
    pairs = _CONFIG.findall(config)
    if not pairs:
        return default  # torch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and takes the default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def te_workspace_bytes(hopper: bool = True) -> int:
    """TE's get_cublas_workspace_size_bytes() (TE >= 2.8: + 1 KiB for alignment and scales on Hopper)."""
    return 32 * MiB + 1024 if hopper else 4 * MiB


class Item:
    """One modelled runtime buffer of a stage: `bytes` as allocated_bytes counts them (512-byte blocks); gpu_only:
    a CPU run of the same code does not allocate it (the global memory buffer it does: the CPU harness maps
    device='cuda' to the CPU)."""
    __slots__ = ("name", "bytes", "count", "persistent", "source", "gpu_only")

    def __init__(self, name: str, nbytes: int, count: int, source: str, persistent: bool = True,
                 gpu_only: bool = True):
        self.name, self.bytes, self.count, self.persistent, self.source = name, nbytes, count, persistent, source
        self.gpu_only = gpu_only

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "count": self.count, "persistent": self.persistent,
                "gpu_only": self.gpu_only, "modelled": True, "source": self.source}


def _g(cfg, name, default=None):
    return getattr(cfg, name, default) if not isinstance(cfg, dict) else cfg.get(name, default)


def environment() -> dict:
    """The variables of this process's environment that size a runtime buffer (the launch script exports them for
    the training run and for this estimate alike)."""
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def global_buffer_bytes(cfg, has_layers: bool, has_output: bool, has_moe: bool, _c: Optional["_Config"] = None) -> int:
    """Bytes of the "mpu" global memory buffer (largest request) on a stage; 0 when nothing on it uses it."""
    c = _c or _Config(cfg)
    sizes = [c.attn if has_layers else 0]
    if c.sp and (has_output or (has_layers and not c.te)):
        sizes.append(c.e * c.s * c.b * c.h)
    if has_moe and c.moe_gather:
        sizes.append(c.e * c.s * c.b // (c.t if c.sp else 1) * c.moe_gather * c.h)
    if c.sp and has_output and c.mtp:
        # multi-token prediction's projection of [embedding, hidden] (2h wide) gathers its input over SP: in the
        # buffer as megatron's ColumnParallelLinear does (the local spec, and the TE spec's CPU stand-ins); TE's
        # own linear gathers into a tensor of its own per call instead (counted here, it errs high by one hidden
        # state)
        sizes.append(2 * c.e * c.s * c.b * c.h)
    return max(sizes)


class _Config:
    """What the items depend on in a config, read once per estimate (memo key "gpu_runtime")."""
    __slots__ = ("te", "grouped", "pb", "per_param", "dist_opt", "dp", "dp_expert", "bucket", "e", "t", "s", "b",
                 "h", "sp", "attn", "moe_gather", "mtp")

    def __init__(self, cfg, scores_in_buffer: bool = False):
        from .static_memory import dp_layout
        pd, _ = precision(cfg)
        self.e = DTYPE_BYTES[pd]
        self.t = t = _g(cfg, "tensor_model_parallel_size", 1)
        self.s = _g(cfg, "seq_length", 0) // _g(cfg, "context_parallel_size", 1)
        self.b, self.h = _g(cfg, "micro_batch_size", 1), _g(cfg, "hidden_size", 0)
        self.sp = bool(_g(cfg, "sequence_parallel", False)) and t > 1
        self.attn = attention_buffer_bytes(cfg, scores_in_buffer)
        # the allgather dispatcher gathers over expert-TP x EP ranks (its tp_ep group) when that is > 1
        etp = _g(cfg, "expert_tensor_parallel_size", None) or t
        g = etp * _g(cfg, "expert_model_parallel_size", 1)
        self.moe_gather = g if g > 1 and _g(cfg, "moe_token_dispatcher_type", "allgather") == "allgather" else 0
        self.mtp = bool(_g(cfg, "mtp_num_layers", 0))
        self.te = not local_spec(cfg)
        self.grouped = bool(_g(cfg, "moe_grouped_gemm", False))
        self.pb = DTYPE_BYTES[pd]
        opt = _g(cfg, "optimizer", "adam")
        # fp32 tensors per parameter (or shard): Megatron's main copy of 16-bit params, Adam's two moments
        self.per_param = (1 if pd != "fp32" else 0) + (2 if opt == "adam" else 1 if _g(cfg, "sgd_momentum", 0.9)
                                                        else 0)
        # as static_memory: dense buffers over dp x cp (one distributed-optimizer instance's share of it)
        self.dist_opt, self.dp, self.dp_expert, self.bucket = dp_layout(cfg)


def _config(cfg, memo: Optional[dict], scores_in_buffer: bool = False) -> _Config:
    c = memo.get("gpu_runtime") if memo is not None else None
    if c is None:
        c = _Config(cfg, scores_in_buffer)
        if memo is not None:
            memo["gpu_runtime"] = c
    return c


def stage_items(cfg, stage_chunks, pp_rank: int, env: Optional[dict] = None, memo: Optional[dict] = None,
                gpu: bool = True, scores_in_buffer: bool = False) -> list:
    """The stage's runtime buffers (Item), in the order the module docstring gives them. stage_chunks: the stage's
    memory.Chunk list (key = ("chunk", MoE flag per layer, has embedding, has output layer)). gpu=False: a CPU run
    of the same code (what the CPU traces measure): only the buffers it allocates too. scores_in_buffer: the formula
    set's TE unfused attention kept its scores in megatron's buffer (static_memory.attention_buffer_bytes)."""
    kinds = [k for c in stage_chunks for k in c.key[1]]
    has_layers, has_moe = bool(kinds), any(kinds)
    has_output = any([c.key[3] for c in stage_chunks])
    c = _config(cfg, memo, scores_in_buffer)
    if not gpu:
        return _global_buffer_items(c, has_layers, has_output, has_moe)
    conf = (environment() if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    ws = round_block(cublas_workspace_bytes(conf))
    items = [Item(TORCH_WORKSPACES, TORCH_THREADS * ws, TORCH_THREADS,
                  f"{ws / MiB:g} MiB each (CUBLAS_WORKSPACE_CONFIG={conf})" if conf else
                  f"{ws / MiB:g} MiB each (H100 default: CUBLAS_WORKSPACE_CONFIG unset)")]
    if has_layers and c.te:
        te = round_block(te_workspace_bytes())
        items.append(Item(TE_ITEMS[0], te, 1, "TE get_cublas_workspace, one per process"))
        if has_moe and c.grouped:
            items.append(Item(TE_ITEMS[1], TE_STREAMS * te, TE_STREAMS,
                              "TE get_cublas_workspace(grouped_gemm=True), one per compute stream"))
    items += _global_buffer_items(c, has_layers, has_output, has_moe)
    pad = rounding_bytes(cfg, stage_chunks, pp_rank, memo)
    if pad:
        items.append(Item("512-byte block rounding", pad, 0, "per-parameter optimizer tensors (and parameters)"))
    return items


def _global_buffer_items(c: "_Config", has_layers: bool, has_output: bool, has_moe: bool) -> list:
    attn = c.attn if has_layers else 0
    grow = round_block(global_buffer_bytes(None, has_layers, has_output, has_moe, c)) - round_block(attn)
    if grow <= 0:
        return []
    return [Item("megatron global memory buffer", grow, 1,
                 "'mpu' buffer: sequence-parallel all-gather / allgather MoE dispatcher"
                 + (" (beyond the local attention's part)" if attn else ""), gpu_only=False)]


def rounding_bytes(cfg, stage_chunks, pp_rank: int, memo: Optional[dict] = None) -> int:
    """What 512-byte blocks add to the optimizer's per-parameter tensors on a stage (the worst of DP ranks 0 and
    dp-1 with the distributed optimizer, whose shards differ): per tensor round_block(n) - n bytes."""
    c = _config(cfg, memo)
    pb, per_param = c.pb, c.per_param
    if not c.dist_opt:
        total = 0
        for chunk in stage_chunks:
            key = ("pad", getattr(chunk, "key", id(chunk)))
            hit = memo.get(key) if memo is not None else None
            if hit is None:
                cols = getattr(chunk, "columns", None)
                numels = cols[0] if cols is not None else [p[0] for p in chunk]
                # round_block(x) - x == -x % 512 for x > 0
                hit = sum([(-pb * n) % BLOCK + per_param * ((-4 * n) % BLOCK) for n in numels if n])
                if memo is not None:
                    memo[key] = hit
            total += hit
        return total
    dp, dp_expert = c.dp, c.dp_expert
    best = 0
    for r in sorted({0, max(dp, dp_expert) - 1}):
        total = 0
        for ci, chunk in enumerate(stage_chunks):
            bsize = c.bucket if (pp_rank == 0 and ci == 0) else None
            cols = getattr(chunk, "columns", None)
            parts = ((False, dp),) if cols is not None and not cols[1] else ((False, dp), (True, dp_expert))
            for is_exp, d in parts:
                key = ("pad", getattr(chunk, "key", id(chunk)), is_exp, r % d, bsize)
                hit = memo.get(key) if memo is not None else None
                if hit is None:
                    hit = _shard_padding(chunk, is_exp, d, r % d, bsize, per_param)
                    if memo is not None:
                        memo[key] = hit
                total += hit
        best = max(best, total)
    return best


def _shard_padding(chunk, is_exp: bool, dp: int, rank: int, bsize, per_param: int) -> int:
    """Rounding of the fp32 per-shard tensors one DP rank's distributed optimizer allocates for a chunk's dense
    or expert buffer (megatron-core DistributedOptimizer: a main-param copy per parameter shard, Adam's states
    per main param). Every parameter lies in one bucket; each bucket is split into dp equal shards."""
    _, lay = chunk_buffer(chunk, is_exp, dp, True, bsize)
    if lay is None:
        return 0
    # Parameters do not overlap and none straddles a bucket: sorted by start, those meeting a shard window
    # [lo, hi) are one run (found by bisection), so the cost is the run, not the whole chunk per bucket.
    if lay.ascending is not None:   # static_memory's one-bucket layout: starts and ends already ascending
        starts, ends = lay.ascending
    else:
        rs = sorted(lay.param_ranges)
        starts = [p0 for p0, _ in rs]
        ends = [p1 for _, p1 in rs]
    pad = 0
    for b0, b1 in lay.buckets:
        size = (b1 - b0) // dp
        lo = b0 + rank * size
        hi = lo + size
        i, j = bisect_right(ends, lo), bisect_left(starts, hi)
        pad += sum([-((p1 if p1 < hi else hi) - (p0 if p0 > lo else lo)) % 128
                    for p0, p1 in zip(starts[i:j], ends[i:j])])
    return 4 * per_param * pad   # 4*m bytes per piece: round_block(4m) - 4m == 4 * (-m % 128)
