"""Static memory per rank: weights, DDP gradient buffers, optimizer states (megatron-core 0.16 layout).

Mirrors megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer: one contiguous grad buffer per
(model chunk, dense|expert) filled in reverse parameter order; with the distributed optimizer each param start is
padded to 64 elements and each bucket end to lcm(dp, 128) so every DP rank owns an equal shard, and the params
themselves move into a (padded) param buffer that the all-gather writes into.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate
from operator import add, itemgetter, le
from estimator._record import dataclass, field

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class ParamInfo(tuple):
    """One parameter as DDP sees it (named_parameters order): numel; expert (allreduce=False in megatron-core: goes
    to the expert-DP buffer); shared_embedding (tied embedding/output weight with PP > 1: own bucket under
    dist-opt); ndim, the tensor's rank (megatron-core puts 1-D params, biases and norm weights, in the
    no-weight-decay group, which decides the optimizer's parameter order: step_transient_bytes).

    What collections.namedtuple would build, written out: importing collections costs the CLI ~2 ms at start-up."""
    __slots__ = ()
    _fields = ("numel", "expert", "shared_embedding", "ndim")

    def __new__(cls, numel, expert=False, shared_embedding=False, ndim=2):
        return tuple.__new__(cls, (numel, expert, shared_embedding, ndim))

    def __getnewargs__(self):
        return tuple(self)

    def __repr__(self):
        return "ParamInfo(numel=%r, expert=%r, shared_embedding=%r, ndim=%r)" % tuple(self)

    numel = property(itemgetter(0), doc="elements")
    expert = property(itemgetter(1), doc="in the expert-DP buffer")
    shared_embedding = property(itemgetter(2), doc="tied embedding/output weight with PP > 1")
    ndim = property(itemgetter(3), doc="tensor rank")


class BufferLayout:
    """numel: elements allocated (with padding); numel_unpadded; buckets: [start, end) per bucket; param_ranges:
    [start, end) per param, in the given (forward) order. One-bucket fast path only: ascending, (starts, ends) in
    buffer order (params reversed), ascending and disjoint, so a shard's elements are two bisections away
    (shard_param_elements); param_ranges is then built from it when first read (the estimate never reads it).
    Equality and repr as the record (dataclass) it was: ascending neither compared nor shown."""
    __slots__ = ("numel", "numel_unpadded", "buckets", "_ranges", "ascending")

    def __init__(self, numel: int, numel_unpadded: int, buckets: List[Tuple[int, int]],
                 param_ranges: Optional[List[Tuple[int, int]]], ascending: Optional[tuple] = None):
        self.numel, self.numel_unpadded, self.buckets = numel, numel_unpadded, buckets
        self._ranges, self.ascending = param_ranges, ascending

    @property
    def param_ranges(self) -> List[Tuple[int, int]]:
        if self._ranges is None:
            starts, ends = self.ascending
            ranges = list(zip(starts, ends))
            ranges.reverse()
            self._ranges = ranges
        return self._ranges

    @param_ranges.setter
    def param_ranges(self, value) -> None:
        self._ranges = value

    def _fields(self) -> tuple:
        return (self.numel, self.numel_unpadded, self.buckets, self.param_ranges)

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self._fields() == other._fields()
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return "BufferLayout(numel=%r, numel_unpadded=%r, buckets=%r, param_ranges=%r)" % self._fields()


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def buffer_layout(numels: Sequence[int], shared: Sequence[bool], dp: int, dist_opt: bool,
                  bucket_size: Optional[int], pad_for_high_busbw: bool = False) -> BufferLayout:
    """The same index arithmetic as _ParamAndGradBuffer.__init__ (params walked in reverse)."""
    divisor = math.lcm(dp, 128, 2 ** 16 if pad_for_high_busbw else 1)
    if numels and bucket_size is None and not (dist_opt and any(shared)):
        # One bucket and nothing that closes it early: starts are running sums (of 64-padded sizes under the
        # distributed optimizer, every start being a multiple of 64 already), walked in reverse.
        rev = numels[::-1]
        if dist_opt:  # _pad(n, 64) per param; a chunk repeats a few distinct sizes, so pad each size once
            padded = {n: -(-n // 64) * 64 for n in set(rev)}
            sizes = list(map(padded.__getitem__, rev))
        else:
            sizes = rev
        starts = [0, *accumulate(sizes)]
        starts.pop()
        ends = list(map(add, starts, rev))
        end = ends[-1]
        return BufferLayout(_pad(end, divisor) if dist_opt else end, end, [(0, _pad(end, divisor) if dist_opt else end)],
                            None, (starts, ends))
    pad_end = (lambda i: _pad(i, divisor)) if dist_opt else (lambda i: i)
    ranges: List[Tuple[int, int]] = [(0, 0)] * len(numels)
    buckets: List[Tuple[int, int]] = []
    unpadded = 0
    start = bucket_start = 0
    end = 0
    n_in_bucket = 0

    def close(end_index: int) -> int:
        nonlocal bucket_start, n_in_bucket, unpadded
        unpadded += end_index - bucket_start
        padded = pad_end(end_index)
        buckets.append((bucket_start, padded))
        bucket_start, n_in_bucket = padded, 0
        return padded

    for i in range(len(numels) - 1, -1, -1):
        if dist_opt:
            start = _pad(start, 64)
        own = dist_opt and shared[i]
        if own and n_in_bucket:
            start = close(start)
        end = start + numels[i]
        ranges[i] = (start, end)
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            start = close(end)
        else:
            start = end
    if n_in_bucket:
        close(end)
    total = buckets[-1][1] if buckets else 0
    return BufferLayout(total, unpadded, buckets, ranges)


def chunk_buffer(chunk: Sequence[ParamInfo], expert: bool, dp: int, dist_opt: bool,
                 bucket_size: Optional[int]) -> Tuple[List[int], Optional[BufferLayout]]:
    """(numels, BufferLayout) of one chunk's dense (expert=False) or expert grad buffer; ([], None) when the chunk
    has no such params. Cached on a memory.Chunk, so static memory and the DP collectives lay it out once."""
    cache = getattr(chunk, "cache", None)
    key = (expert, dp, dist_opt, bucket_size)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    columns = getattr(chunk, "columns", None)
    if columns is not None and not columns[1]:
        # A memory.Chunk without expert params: its numel and shared_embedding columns, built with it.
        numels, _, shared = columns
        if expert or not numels:
            numels = []
        out = (numels, buffer_layout(numels, shared, dp, dist_opt, bucket_size) if numels else None)
    else:
        out = _chunk_buffer(chunk, expert, dp, dist_opt, bucket_size)
    if cache is not None:
        cache[key] = out
    return out


def _chunk_buffer(chunk, expert, dp, dist_opt, bucket_size):
    if set(map(type, chunk)) != {ParamInfo}:
        chunk = [p if isinstance(p, ParamInfo) else ParamInfo(*p) for p in chunk]
    flags = list(map(itemgetter(1), chunk))
    if flags.count(False) == len(flags):  # every p.expert == False
        group = [] if expert else chunk
    else:
        group = [p for p in chunk if bool(p.expert) == expert]
    numels = list(map(itemgetter(0), group))
    return (numels, buffer_layout(numels, list(map(itemgetter(2), group)), dp, dist_opt, bucket_size)
            if group else None)


def shard_param_elements(layout: BufferLayout, dp: int, dp_rank: int) -> int:
    """Real parameter elements in DP rank `dp_rank`'s shard (what the distributed optimizer keeps states for)."""
    if len(layout.buckets) == 1 and layout.param_ranges:
        # One bucket: every param lies in it; ranges are disjoint and ascending in reverse param order.
        (b0, b1), = layout.buckets
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        if layout.ascending is not None:  # built that way by buffer_layout's fast path
            starts, ends = layout.ascending
            ok = True
        else:
            asc = layout.param_ranges[::-1]
            starts = list(map(itemgetter(0), asc))
            ends = list(map(itemgetter(1), asc))
            ok = starts[0] >= b0 and ends[-1] <= b1 and all(map(le, starts, ends)) and \
                all(map(le, ends[:-1], starts[1:]))
        if ok:
            first = bisect_right(ends, lo)       # first range with p1 > lo
            last = bisect_left(starts, hi) - 1   # last range with p0 < hi
            if first > last:
                return 0
            n = sum(ends[first:last + 1]) - sum(starts[first:last + 1])
            n -= max(0, lo - starts[first]) + max(0, ends[last] - hi)
            return n
    n = 0
    for (b0, b1) in layout.buckets:
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        for (p0, p1) in layout.param_ranges:
            if p1 > lo and p0 < hi and p0 >= b0 and p1 <= b1:
                n += min(p1, hi) - max(p0, lo)
    return n


@dataclass
class StaticMemory:
    params: int                     # parameters held by this rank (all chunks)
    expert_params: int
    weights_bytes: int             # param storage (padded param buffer under dist-opt)
    grad_buffer_bytes: int         # DDP main-grad buffers (padded)
    optimizer_bytes: int           # fp32 master params + Adam/SGD states (sharded with dist-opt)
    optimizer_detail: dict = field(default_factory=dict)
    grad_buffer_numel: int = 0
    padding_elements: int = 0
    # the step's own memory above the persistent level: 16-bit gradients' fp32 copies (optimizer_detail
    # fp32_grad_copy_bytes) and the update's temporaries (adam_step)
    optimizer_step_transient_bytes: int = 0
    optimizer_step: str = "fused"   # adam_step(): how the step runs, which decides its temporaries

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.grad_buffer_bytes + self.optimizer_bytes


def _g(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def precision(cfg: Any) -> Tuple[str, str]:
    """(param dtype, grad dtype) as megatron-core DDP sees them."""
    pd = "bf16" if _g(cfg, "bf16", False) else "fp16" if _g(cfg, "fp16", False) else "fp32"
    if pd == "fp32":
        return pd, "fp32"
    fp32_grads = _g(cfg, "accumulate_allreduce_grads_in_fp32", pd == "bf16")
    if pd == "bf16" and _g(cfg, "grad_reduce_in_bf16", False):
        fp32_grads = False
    return pd, "fp32" if fp32_grads else pd


def optimizer_bytes_per_param(cfg: Any) -> Tuple[int, int]:
    """(bytes per param that stay replicated, bytes per param that the distributed optimizer shards) for the
    optimizer side only: master fp32 params (16-bit params), fp32 grad copies (16-bit grads), Adam m+v / SGD momentum."""
    master, grad_copy, states = optimizer_element_bytes(cfg)
    return 0, master + grad_copy + states


# Bytes per element of the precision-aware optimizer's state dtypes (fp8 moments are stored as uint8)
_STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def optimizer_element_bytes(cfg: Any) -> Tuple[int, int, int]:
    """Per parameter element the optimizer holds (on the distributed optimizer: per element of the rank's shard):
    (master copy, fp32 copy of a 16-bit gradient made in the step, Adam's moments / SGD's momentum).
    Megatron's optimizer: fp32 master copies of 16-bit parameters, the step's fp32 gradient copies, fp32 moments.
    The precision-aware optimizer (megatron-core 0.16.1 with Transformer Engine's FusedAdam: master_weights,
    use_decoupled_grad, store_param_remainders on by default): the moments in --exp-avg-dtype / --exp-avg-sq-dtype;
    the master copy in --main-params-dtype, kept by TE as the 16 low bits a bf16 parameter lacks when that is
    fp32 (store_param_remainders), the step reading the gradient buffer itself (no copy). Under fp8 other than
    delayed scaling with fp32 main parameters megatron-core keeps the master copies and gradients its own way."""
    pd, gd = precision(cfg)
    opt = _g(cfg, "optimizer", "adam")
    if opt == "adam" and _g(cfg, "use_precision_aware_optimizer", False):
        main = _g(cfg, "main_params_dtype", "fp32")
        moments = _STATE_BYTES[_g(cfg, "exp_avg_dtype", "fp32")] + _STATE_BYTES[_g(cfg, "exp_avg_sq_dtype", "fp32")]
        fp8 = _g(cfg, "fp8", None) is not None and _g(cfg, "fp8_recipe", "delayed") != "delayed"
        if main != "fp32" or not fp8 or _g(cfg, "optimizer_cpu_offload", False):
            master = 2 if pd == "bf16" and main == "fp32" else _STATE_BYTES[main] if pd != "fp32" else 0
            return master, 0, moments
        return (4 if pd != "fp32" else 0), (4 if gd != "fp32" else 0), moments
    master = 4 if pd != "fp32" else 0
    grad_copy = 4 if gd != "fp32" else 0   # Float16Optimizer copies 16-bit main grads to fp32 main params' .grad
    states = 8 if opt == "adam" else (4 if _g(cfg, "sgd_momentum", 0.9) else 0)
    return master, grad_copy, states


def static_memory(cfg: Any, chunks: Sequence[Iterable[ParamInfo]], pp_rank: int = 0,
                  dp_rank: Optional[int] = None, _memo: Optional[dict] = None, device: str = "cuda") -> StaticMemory:
    """Static bytes of one rank. `chunks`: the rank's model chunks (one per virtual stage), each the parameters in
    named_parameters order. dp_rank None = the DP rank whose shard holds the most real elements.
    _memo: a dict kept by the caller for one config; chunks with equal parameter lists are then laid out once.
    device: where the run runs ("cpu" or a GPU), which decides how torch's AdamW steps (adam_step)."""
    pd, gd = precision(cfg)
    pb, gb = DTYPE_BYTES[pd], DTYPE_BYTES[gd]
    dist_opt, dp_dense, dp_expert, bucket = dp_layout(cfg)
    master_b, grad_copy_b, opt_states = optimizer_element_bytes(cfg)

    params = expert = weights = grads = gnumel = padding = state_elems = 0
    largest = bucket_top = 0
    for ci, chunk in enumerate(chunks):
        # Megatron-LM disables bucketing on stages > 0 and on virtual chunks > 0.
        bsize = bucket if (pp_rank == 0 and ci == 0) else None
        key = None
        if _memo is not None:
            content = getattr(chunk, "key", None)  # memory.Chunk: names its content without hashing it
            if content is None:
                content = chunk = chunk if isinstance(chunk, tuple) else tuple(chunk)
            key = ("static", content, bsize, dp_dense, dp_expert, dist_opt, dp_rank)
            hit = _memo.get(key)
            if hit is not None:
                for is_exp, n, big, numel, unpadded, shard, top in hit:
                    bucket_top = max(bucket_top, top)
                    params += n
                    expert += n if is_exp else 0
                    largest = max(largest, big)
                    gnumel += numel
                    padding += numel - unpadded
                    grads += numel * gb
                    weights += (numel if dist_opt else n) * pb
                    state_elems += shard
                continue
        parts = []
        for is_exp, dp in ((False, dp_dense), (True, dp_expert)):
            numels, lay = chunk_buffer(chunk, is_exp, dp, dist_opt, bsize)
            if not numels:
                continue
            n = sum(numels)
            params += n
            expert += n if is_exp else 0
            big = max(numels)
            largest = max(largest, big)
            gnumel += lay.numel
            padding += lay.numel - lay.numel_unpadded
            grads += lay.numel * gb
            weights += (lay.numel if dist_opt else n) * pb
            if dist_opt:
                ranks = ([0, dp - 1] if dp > 1 else [0]) if dp_rank is None else [dp_rank % dp]  # the last shard holds the padding
                shard = max(shard_param_elements(lay, dp, r) for r in ranks)
            else:
                shard = n
            state_elems += shard
            # the largest bucket the distributed optimizer reduce-scatters (and all-gathers) over DP
            top = max((b1 - b0 for b0, b1 in lay.buckets), default=0) if dist_opt and dp > 1 else 0
            bucket_top = max(bucket_top, top)
            parts.append((is_exp, n, big, lay.numel, lay.numel_unpadded, shard, top))
        if key is not None:
            _memo[key] = parts
    master = master_b * state_elems
    # 16-bit gradients: the step makes an fp32 copy of each (shard of a) gradient for the fp32 main parameter's
    # .grad (megatron-core's _copy_model_grads_to_main_grads: `.float()`), which the next iteration's zero_grad
    # frees before any forward: step-time memory, not persistent (measured on CPU, DP 2 bf16 with the distributed
    # optimizer: --grad-reduce-in-bf16 lowers the forward's peak by the whole 2-byte saving of the grad buffer).
    grad_copy = grad_copy_b * state_elems
    states = opt_states * state_elems
    detail = {"master_params_bytes": master, "fp32_grad_copy_bytes": grad_copy, "states_bytes": states,
              "state_elements": state_elems, "optimizer": _g(cfg, "optimizer", "adam")}
    step = adam_step(cfg, device)
    if step == "single":
        transient = step_transient_bytes(chunks, dist_opt, dp_dense, dp_expert, bucket, pp_rank)
    elif step == "foreach":
        transient = foreach_step_transient_bytes(chunks, dist_opt, dp_dense, dp_expert, bucket, pp_rank)
    else:
        # A fused multi-tensor step (TE / apex FusedAdam) needs no parameter-sized temporaries; grad-norm / clipping
        # keep one fp32 vector of the largest tensor's shard at most (modelled, conservative).
        transient = 4 * -(-largest // (dp_dense if dist_opt else 1))
    from .formulas import kernels
    if device == "cpu" and kernels(cfg)["collectives"] == "gloo":
        # gloo's reduce_scatter_tensor (and all_gather_into_tensor) works on a flat copy of the whole bucket, freed
        # when the collective ends (measured on CPU, DP 2 with the distributed optimizer: one grad-buffer-sized
        # tensor inside grad_sync, one param-buffer-sized one inside param_gather); NCCL and the fake process
        # group need none. It comes at the end of the backward, before the step's own memory: the larger of the
        # two is the rank's transient.
        transient = max(transient, bucket_top * gb - grad_copy)
    return StaticMemory(params, expert, weights, grads, master + states, detail, gnumel, padding,
                        grad_copy + transient, step)


def adam_step(cfg: Any, device: str = "cuda") -> str:
    """How the optimizer step runs, which decides its parameter-sized temporaries. megatron-core 0.16.1 takes
    Transformer Engine's FusedAdam, else apex's, else torch.optim.AdamW (megatron/core/optimizer/__init__.py):
    - "fused": TE / apex FusedAdam, what a Megatron-LM GPU install has (its containers ship both): in place;
    - "foreach": torch's AdamW on a GPU (--torch-adam: neither TE nor apex installed). torch defaults to its
      multi-tensor path there, whose `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` holds one fp32 temporary
      per parameter of the whole parameter group at once (seen on an H100: the step set the peak of full-recompute
      runs, +1x the group's fp32 size);
    - "single": torch's AdamW on CPU (its single-tensor path, two temporaries per parameter: step_transient_bytes),
      what every CPU trace runs.
    Another optimizer (SGD) steps in place: "fused"."""
    if _g(cfg, "optimizer", "adam") != "adam":
        return "fused"
    if device == "cpu":
        return "single"
    return "foreach" if _g(cfg, "torch_adam", False) else "fused"


def dp_layout(cfg: Any) -> Tuple[bool, int, int, Optional[int]]:
    """How DDP and the optimizer split a stage's parameters: (distributed optimizer, the dense DP size (DDP's
    buffers use the DP x CP group), the expert DP size, stage 0's first-chunk bucket size (ddp_bucket_size)) -- the
    arguments optimizer_groups and the step-transient functions take after `chunks`. With N distributed-optimizer
    instances DDP's buffers and the shards use the groups of one instance, DP / N ranks (megatron-core's
    intra_dp_cp_group and intra_expt_dp_group)."""
    dist_opt = bool(_g(cfg, "use_distributed_optimizer", False))
    n = _g(cfg, "num_distributed_optimizer_instances", 1) if dist_opt else 1
    return (dist_opt,
            _g(cfg, "data_parallel_size", 1) * _g(cfg, "context_parallel_size", 1) // n,
            (_g(cfg, "expert_data_parallel_size", None) or _g(cfg, "data_parallel_size", 1)) // n,
            ddp_bucket_size(cfg))


def ddp_bucket_size(cfg: Any) -> Optional[int]:
    """Elements per DDP bucket (stage 0's first chunk only; None: one bucket). Megatron-LM 0.16.1's get_model:
    --ddp-bucket-size (or the size --ddp-num-buckets sets), else max(40M, 1M x the data-parallel size with CP);
    no buckets unless --overlap-grad-reduce."""
    if not _g(cfg, "overlap_grad_reduce", False):
        return None
    return _g(cfg, "ddp_bucket_size", None) or max(
        40_000_000, 1_000_000 * _g(cfg, "data_parallel_size", 1) * _g(cfg, "context_parallel_size", 1))


def local_spec(cfg: Any) -> bool:
    """megatron-core's local spec (no Transformer Engine): the path measured on CPU, where the optimizer is torch's
    AdamW and attention is the local DotProductAttention."""
    spec = _g(cfg, "spec", None)
    return _g(cfg, "transformer_impl", "transformer_engine") == "local" or bool(spec and spec[0] == "local")


def attention_buffer_bytes(cfg: Any, te_scores_in_buffer: bool = False) -> int:
    """megatron-core's local DotProductAttention takes its baddbmm output from the global memory buffer
    (parallel_state.get_global_memory_buffer().get_tensor((b * heads / TP, sq, sk), dtype, "mpu")): one tensor per
    process, allocated by the first forward and kept for the rest of training (measured on CPU: b*(a/t)*s*s
    elements of the activation dtype, e.g. 175,616 B for b=2, a=7, s=56, fp32). 0 where no layer runs it.
    Transformer Engine's unfused attention makes its scores per call instead (a forward transient, in the programs
    of runs traced with it: the `scores` switch); a run traced with the earlier stand-in kept them in this buffer
    under the TE spec too (its recorded `scores`: "buffer"; on the H100 traces the 54 / 72 MiB the fp32 runs keep
    in core attention). te_scores_in_buffer: the set has only such runs (FormulaSet.te_scores_in_buffer): its
    programs lack the transient, and the buffer stands for it (errs high)."""
    if not local_spec(cfg):
        from .formulas import kernels
        k = kernels(cfg)
        if k["attention"] != "unfused" or (k["scores"] == "call" and not te_scores_in_buffer):
            return 0
    e = DTYPE_BYTES[precision(cfg)[0]]
    s = _g(cfg, "seq_length", 0) // _g(cfg, "context_parallel_size", 1)
    return e * _g(cfg, "micro_batch_size", 1) * (_g(cfg, "num_attention_heads", 0) // _g(cfg, "tensor_model_parallel_size", 1)) * s * s


def step_transient_bytes(chunks: Sequence[Iterable[ParamInfo]], dist_opt: bool, dp_dense: int, dp_expert: int,
                         bucket: Optional[int] = None, pp_rank: int = 0) -> int:
    """Peak above the level at the optimizer step's entry when megatron-core falls back to torch.optim.AdamW
    (no Transformer Engine / apex FusedAdam: the CPU path, and what the local spec is measured with).

    Measured on CPU (megatron-core 0.16.1, torch 2.13.0): torch's single-tensor AdamW computes, per parameter in
    optimizer-group order, `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two fp32 temporaries
    of the parameter's size while the previous parameter's `denom` is still bound, so the peak is
    max over consecutive params (prev + 2 * cur) fp32 elements, within a param group (the function returns between
    groups). megatron-core's groups: (weight decay | not: 1-D params and biases) x (dense | expert), each in
    named_parameters order over the model chunks. With the distributed optimizer the step runs on this DP rank's
    shards, in grad-buffer order (params reversed within each buffer), zero-sized shards skipped; the largest DP
    rank is taken. (The grad-norm pass before it keeps one param-sized temporary at a time: never larger.)"""
    return 4 * max((max((_adam_peak(v) for v in groups.values()), default=0)
                    for groups in optimizer_groups(chunks, dist_opt, dp_dense, dp_expert, bucket, pp_rank)), default=0)


def foreach_step_transient_bytes(chunks: Sequence[Iterable[ParamInfo]], dist_opt: bool, dp_dense: int,
                                 dp_expert: int, bucket: Optional[int] = None, pp_rank: int = 0) -> int:
    """Peak above the level at the step's entry for torch.optim.AdamW's multi-tensor (foreach) step, torch's default
    on a GPU: `torch._foreach_sqrt(exp_avg_sqs)` makes one fp32 tensor per parameter (shard) of a parameter group,
    all alive until the group's update is done; groups step one after another (optimizer_groups)."""
    return 4 * max((max((sum(v) for v in groups.values()), default=0)
                    for groups in optimizer_groups(chunks, dist_opt, dp_dense, dp_expert, bucket, pp_rank)), default=0)


def optimizer_groups(chunks: Sequence[Iterable[ParamInfo]], dist_opt: bool, dp_dense: int, dp_expert: int,
                     bucket: Optional[int] = None, pp_rank: int = 0) -> List[Dict[Tuple[bool, bool], List[int]]]:
    """The optimizer's parameter groups ((weight decay, expert) -> elements per parameter in step order), as
    step_transient_bytes describes them: one dict without the distributed optimizer, else one per DP rank looked
    at (the first and the last), each holding that rank's shards."""
    groups: Dict[Tuple[bool, bool], List[int]] = {}
    if not dist_opt:
        for chunk in chunks:
            for p in chunk:
                p = p if isinstance(p, ParamInfo) else ParamInfo(*p)
                groups.setdefault((p.ndim > 1, bool(p.expert)), []).append(p.numel)
        return [groups]
    out = []
    dps = {False: dp_dense, True: dp_expert}
    for r in sorted({0, max(dp_dense, dp_expert) - 1}):
        groups = {}
        for ci, chunk in enumerate(chunks):
            chunk = [p if isinstance(p, ParamInfo) else ParamInfo(*p) for p in chunk]
            bsize = bucket if (pp_rank == 0 and ci == 0) else None
            for is_exp in (False, True):
                group = [p for p in chunk if bool(p.expert) == is_exp]
                if not group:
                    continue
                dp = dps[is_exp]
                lay = buffer_layout([p.numel for p in group], [p.shared_embedding for p in group], dp, True, bsize)
                shards = [0] * len(group)
                for (b0, b1) in lay.buckets:
                    size = (b1 - b0) // dp
                    lo, hi = b0 + (r % dp) * size, b0 + (r % dp + 1) * size
                    for i, (p0, p1) in enumerate(lay.param_ranges):
                        if p0 >= b0 and p1 <= b1 and p1 > lo and p0 < hi:
                            shards[i] += min(p1, hi) - max(p0, lo)
                for i in range(len(group) - 1, -1, -1):  # buffer order: params reversed
                    if shards[i]:
                        groups.setdefault((group[i].ndim > 1, is_exp), []).append(shards[i])
        out.append(groups)
    return out


def _adam_peak(numels: Sequence[int]) -> int:
    prev, top = 0, 0
    for n in numels:
        top = max(top, prev + 2 * n)
        prev = n
    return top


def table_bytes_per_param(cfg: Any) -> float:
    """Megatron's documented bytes/param (docs: distributed optimizer): 18 | 6+12/d (bf16), 20 | 4+16/d (fp16),
    16 | 8+8/d (fp32), Adam, padding ignored."""
    pd, gd = precision(cfg)
    d = dp_layout(cfg)[1]
    _, sharded = optimizer_bytes_per_param(cfg)
    rep = DTYPE_BYTES[pd] + DTYPE_BYTES[gd]
    return rep + sharded / d if _g(cfg, "use_distributed_optimizer", False) else rep + sharded
