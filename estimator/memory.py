"""Top level: per rank class static memory + schedule-simulated activations -> peak (estimate(cfg, fset))."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from estimator._record import dataclass, field

from . import activations as A
from . import formulas as F
from . import schedule as S
from . import fp8, gpu_runtime, offload, sharding, tp_overlap
from . import persistent_state
from .static_memory import DTYPE_BYTES, ParamInfo, StaticMemory, attention_buffer_bytes, static_memory


@dataclass
class RankEstimate:
    pp_rank: int               # TP and EP ranks of one stage hold identical shapes, so a class is a PP stage
    params: int
    expert_params: int
    bytes: Dict[str, float]    # parameters, gradients, optimizer_states, activations, gpu_runtime, other (transient)
    peak_bytes: float
    peak_phase: str
    in_flight_max: int
    per_op: Dict[str, Dict[str, float]]   # op -> saved / fwd_peak / bwd_peak bytes per microbatch (+ count)
    static: StaticMemory = None
    timeline: Optional[S.RankTimeline] = None
    gpu_runtime: list = field(default_factory=list)  # gpu_runtime.Item: modelled persistent runtime buffers
    after_step_bytes: float = 0.0  # held once the optimizer step is done (torch's allocated_bytes.all.current)


@dataclass
class Estimate:
    formula_set: str           # "name (kind)": reports must say when it is 'modelled'
    ranks: List[RankEstimate]
    max_peak_bytes: float
    max_peak_pp_rank: int
    schedule: str
    fallbacks: set = field(default_factory=set)  # (op, quantity) this estimate took from the fallback set
    coverage: Optional[dict] = None  # composed sets: share of saved bytes from measured formulas, extrapolated labels


def _param_infos(ops) -> List[ParamInfo]:
    """ParamInfo per parameter of `ops`, in named_parameters order (Attention registers core_attention, then
    linear_proj, before SelfAttention's linear_qkv; embedding first, final norm and output layer last)."""
    ops = sorted(enumerate(ops), key=lambda io: (*_module_order(io[1]),
                                                 _ATTENTION_FIRST.get(io[1].op.rsplit(".", 1)[-1], 2), io[0]))
    params: List[ParamInfo] = []
    for _, op in ops:
        shared = op.shared_embedding
        for _ in range(op.count):
            for shape in op.shapes:
                n = 1
                for x in shape:
                    n *= x
                params.append(ParamInfo(n, op.is_expert, shared, len(shape)))
    return params


_ATTENTION_FIRST = {"core_attention": 0, "linear_proj": 1}


def _module_order(op) -> tuple:
    """GPTModel's registration order: embedding, decoder layers, the decoder's final norm, MTP layers, output."""
    if op.op.startswith("embedding"):
        return (0, 0)
    if op.op.startswith("mtp."):
        return (3, op.layer)
    if op.layer is not None:
        return (1, op.layer)
    return (4 if op.op == "output_layer" else 2, 0)


def _with_columns(params: List[ParamInfo]) -> tuple:
    """(params, numels, any expert, shared_embedding flags): a chunk's columns are the concatenation of its parts'."""
    return (params, [p[0] for p in params], any([p[1] for p in params]), [p[2] for p in params])


class Chunk(list):
    """One model chunk's parameters (ParamInfo, named_parameters order). `key` names its content: chunks of one config
    with equal keys (same layer kinds, same place: first/last) hold equal lists, so memos can skip hashing them."""
    __slots__ = ("key", "cache", "columns")  # cache: derived data (grad-buffer layouts), filled by
    # static_memory.chunk_buffer; columns: (numels, any expert param, shared_embedding flags), read-only


def param_chunks(cfg, pp_rank: int, vpp: int, _tables: Optional[tuple] = None) -> List[List[ParamInfo]]:
    """The rank's model chunks, each its parameters in named_parameters order (== _param_infos of
    model.rank_params(cfg, pp_rank, vp).ops). A layer's parameters depend only on whether it is a MoE layer, so
    each kind is expanded once and repeated; chunks with equal keys are one shared (read-only) Chunk."""
    from . import model as M  # owned by a colleague: rank_params(cfg, pp_rank, vp_stage) -> RankParams(.ops)
    layer_table, pattern, templates, by_key = _tables or _param_tables(cfg)
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if vpp > 1 else None
        first, last = M.has_embedding(cfg, pp_rank, vp_stage), M.has_output(cfg, pp_rank, vp_stage)
        kinds = tuple([pattern[layer] for layer in layer_table[(pp_rank, vp)]])
        key = ("chunk", kinds, first, last)
        params = by_key.get(key)
        if params is None:
            head = _with_columns(_param_infos(M.head_ops(cfg, first, last)))
            parts = [head]
            for i, kind in enumerate(kinds):
                t = templates.get(kind)
                if t is None:
                    t = templates[kind] = _with_columns(
                        _param_infos(M.layer_ops(cfg, layer_table[(pp_rank, vp)][i])))
                parts.append(t)
            parts.append(_with_columns(_param_infos(M.tail_ops(cfg, first, last))))
            params = Chunk(head[0])
            numels, shared = list(head[1]), list(head[3])
            for t in parts[1:]:
                params += t[0]
                numels += t[1]
                shared += t[3]
            params.key, params.cache = key, {}
            params.columns = (numels, any([t[2] for t in parts]), shared)
            by_key[key] = params
        chunks.append(params)
    return chunks


def _param_tables(cfg) -> tuple:
    """(chunk -> layers table, MoE pattern, per-kind parameter templates, chunks by key (both filled on use))."""
    from . import model as M
    return M.chunk_layer_table(cfg), cfg.moe_layer_pattern(), {}, {}


def all_param_chunks(cfg) -> Dict[int, List[List[ParamInfo]]]:
    """param_chunks for every pipeline rank, sharing one layer table, one template per layer kind and one Chunk
    per distinct chunk."""
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    tables = _param_tables(cfg)
    return {r: param_chunks(cfg, r, vpp, tables) for r in range(cfg.pipeline_model_parallel_size)}


def schedule_name(cfg) -> str:
    pp, vpp = cfg.pipeline_model_parallel_size, (cfg.virtual_pipeline_model_parallel_size or 1)
    return "no pipelining" if pp == 1 else ("interleaved 1F1B" if vpp > 1 else "1F1B")


# Features whose ops no other op stands in for: composing them from the standard layer's ops would be a wrong
# number, so a set measures them (some of its runs had the switch value) or the estimate stops. (The per-op
# modelled set has no formulas for them.) (switch, value) -> flag
_OWN_OPS = {("mla", True): "--multi-latent-attention", ("mtp", True): "--mtp-num-layers",
            ("qk_norm", "l2"): "--qk-l2-norm", ("output_gate", True): "--attention-output-gate"}


def _check_measures(cfg, fset) -> None:
    from .args import ConfigError, recompute_modules
    modules = sorted(set(recompute_modules(cfg)) - {"core_attn"})
    if modules and fset.programs is None and not fset.composed:
        # selective recompute of other modules is composed from the layer's programs; the per-op modelled set
        # has selective recompute of core attention only
        raise ConfigError(f"--recompute-modules {' '.join(modules)} changes memory and cannot be estimated with "
                          f"formula set {fset.name!r}: its layers have no programs to compose it from (use "
                          f"--formulas cpu_compose)")
    if (getattr(cfg, "mtp_num_layers", None) or 0) > 1:
        # each MTP layer's loss head frees other tensors than the first's (the last to run frees the block's
        # joined hidden states): the traced runs have one MTP layer
        raise ConfigError(f"--mtp-num-layers {cfg.mtp_num_layers} cannot be estimated: no formula set measured more "
                          f"than one multi-token prediction layer")
    if not any(getattr(cfg, a, None) for a in ("multi_latent_attention", "mtp_num_layers", "qk_l2_norm",
                                               "attention_output_gate")):
        return      # (the set's switch values are costly to gather the first time)
    sw = F.switches(cfg)
    for (switch, value), flag in _OWN_OPS.items():
        if sw[switch] == value and not fset.measures(switch, value):
            raise ConfigError(f"{flag} changes memory and cannot be estimated with formula set {fset.name!r}: "
                              f"it measured no run with it (use --formulas cpu_compose)")


def estimate(cfg: Any, formula_set: Union[str, F.FormulaSet, None] = None, timeline: bool = False,
             chunks_by_stage: Optional[Dict[int, List[List[ParamInfo]]]] = None, per_op: bool = True,
             device: str = "cuda") -> Estimate:
    """Every rank class's static bytes, activation bytes and schedule peak for one config.
    chunks_by_stage: all_param_chunks(cfg), when the caller already has it. per_op=False leaves the per-op rows
    empty (a layout search needs the peaks only). device="cpu": the same run on the CPU (what CPU traces
    measure): no GPU-only runtime buffers (estimator.gpu_runtime)."""
    want_ops = per_op
    fset = formula_set if isinstance(formula_set, F.FormulaSet) else F.load(formula_set or F.DEFAULT_SET)
    _check_measures(cfg, fset)
    pp = cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    M_ = cfg.num_microbatches
    group = getattr(cfg, "microbatch_group_size_per_vp_stage", None) or pp
    cache = A.cache_for(fset, cfg)
    if chunks_by_stage is None:
        chunks_by_stage = all_param_chunks(cfg)
    vp_arg = vpp if vpp > 1 else None
    scores_in_buffer = fset.te_scores_in_buffer
    attn_buffer = attention_buffer_bytes(cfg, scores_in_buffer)
    userbuffers = tp_overlap.buffer_bytes(cfg)  # every rank, from initialization on (under `other`)
    memo: dict = {}  # equal chunks and equal stages (same layer kinds, same place in the model) are evaluated once
    # Pipeline p2p tensors (one hidden state each) that megatron-core's schedule keeps alive across steps.
    p2p = cache.hidden if pp > 1 else 0.0
    runtime_env = gpu_runtime.environment()
    ranks = []
    for r in range(pp):
        stage_chunks = chunks_by_stage[r]
        # A Chunk's key names its layer kinds and whether it holds the embedding / the loss head; stage 0 alone
        # may bucket its first chunk, so equal keys give equal activations, per-op rows and static memory.
        stage_key = ("stage", tuple([c.key for c in stage_chunks]), r == 0)
        stage = memo.get(stage_key)
        if stage is None:
            chunks, chunk_ops = [], []
            for c in stage_chunks:
                hit = memo.get(c.key)
                if hit is None:
                    _, kinds, first, last = c.key
                    hit = memo[c.key] = A.chunk_activations(cache, tuple(map(bool, kinds)), first, last,
                                                            recv_input=not first)
                chunks.append(hit[0])
                chunk_ops.append(hit[1])
            per_op = _stage_per_op(chunk_ops) if want_ops else {}
            st = stage_static(cfg, stage_chunks, r, memo, device)
            runtime = gpu_runtime.stage_items(cfg, stage_chunks, r, runtime_env, memo, gpu=device != "cpu",
                                              scores_in_buffer=scores_in_buffer)
            gpu_bytes = sum([it.bytes for it in runtime])
            # Sharded data parallelism's gathered weights are live while the model computes, its unsharded
            # gradient buckets in each backward; neither outlives the iteration (estimator.sharding).
            gathered, grad_buckets = sharding.compute_bytes(cfg, stage_chunks)
            if grad_buckets:
                chunks = [A.with_backward_extra(c, grad_buckets) for c in chunks]
            # Persistent from the first forward on (reported under `other`): the local attention's global buffer,
            # the rotary cache and the MoE layers' routing state (estimator.persistent_state).
            base = st.total_bytes + (attn_buffer if any(c.key[1] for c in stage_chunks) else 0) + userbuffers \
                + gpu_bytes + persistent_state.stage_bytes(cfg, stage_chunks) + gathered
            stage = memo[stage_key] = (chunks, per_op, st, base, runtime, gpu_bytes, gathered)
        chunks, per_op, st, base, runtime, gpu_bytes, gathered = stage
        if want_ops:
            per_op = {op: dict(d) for op, d in per_op.items()}  # each stage owns its rows
        if timeline:
            steps = S.order(pp, r, M_, vp_arg, group)
            recv, sends = S.p2p_flags(pp, r, vp_arg)
            tl = S.simulate(steps, chunks, base, st.optimizer_step_transient_bytes, keep_events=True,
                            warmup=S.warmup_count(pp, r, M_, vp_arg, group), p2p=p2p, recv=recv, sends=sends,
                            interleaved=vp_arg is not None)
            # Activation bytes at the peak: the saved microbatches live then; the rest of the peak is transient.
            act = 0.0 if tl.peak_phase == "optimizer step" else _saved_at(steps, chunks, tl.peak_index)
        else:
            tl, act = S.rank_timeline(pp, r, M_, chunks, base, st.optimizer_step_transient_bytes,
                                      vp=vp_arg, group=group, p2p=p2p)
        cats = {"parameters": st.weights_bytes + gathered, "gradients": st.grad_buffer_bytes,
                "optimizer_states": st.optimizer_bytes, "activations": act, "gpu_runtime": gpu_bytes,
                "other": tl.peak - st.total_bytes - gathered - act - gpu_bytes}
        # After the step every microbatch is freed: the persistent level plus the p2p tensors the model chunks keep.
        after = base - gathered + (2 * sum(S.p2p_flags(pp, r, vp_arg)[0]) * p2p if p2p else 0)
        ranks.append(RankEstimate(r, st.params, st.expert_params, cats, tl.peak, tl.peak_phase, tl.in_flight_max,
                                  per_op, st, tl if timeline else None, runtime, after))
    top = max(ranks, key=lambda x: x.peak_bytes)
    return Estimate(fset.label, ranks, top.peak_bytes, top.pp_rank, schedule_name(cfg), cache.fallbacks(),
                    cache.coverage() if fset.composed else None)


def stage_static(cfg: Any, stage_chunks: List[List[ParamInfo]], pp_rank: int,
                 memo: Optional[dict] = None, device: str = "cuda") -> StaticMemory:
    """One stage's static memory, as estimate() counts it: megatron-core DDP's buffers, or sharded data
    parallelism's (estimator.sharding)."""
    st = static_memory(cfg, stage_chunks, pp_rank=pp_rank, _memo=memo, device=device)
    if sharding.active(cfg):
        st = sharding.apply(cfg, st, stage_chunks)
    if fp8.active(cfg):
        added, _ = fp8.stage_weight_bytes(cfg, pp_rank, DTYPE_BYTES[cfg.params_dtype])
        st.weights_bytes += added  # st is this call's own (static_memory builds a new one each time)
    share = offload.optimizer_gpu_share(cfg)
    if share < 1.0:
        st.optimizer_bytes = int(st.optimizer_bytes * share)
        st.optimizer_detail = dict(st.optimizer_detail, gpu_share=share)
    return st


def static_peak_bytes(cfg: Any, chunks_by_stage: Dict[int, List[List[ParamInfo]]]) -> int:
    """The largest stage's static bytes: a lower bound of estimate()'s peak (a layout search skips the schedule
    of layouts whose weights, gradients and optimizer states alone do not fit)."""
    memo: dict = {}
    return max(stage_static(cfg, chunks, r, memo).total_bytes for r, chunks in chunks_by_stage.items())


def _stage_per_op(chunk_ops: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """A stage's per-op rows from its chunks' (in order): saved bytes and counts summed, peaks maxed."""
    distinct: Dict[int, list] = {}  # equal chunks share one per-op dict: id -> [dict, how many chunks]
    for d in chunk_ops:
        hit = distinct.get(id(d))
        if hit is None:
            distinct[id(d)] = [d, 1]
        else:
            hit[1] += 1
    if len(distinct) < len(chunk_ops) and _integral_sums(distinct.values()):
        # Integer byte counts whose sums stay below 2**53: n additions of x are exactly x * n, in any order.
        pairs = distinct.values()
    else:
        pairs = [(d, 1) for d in chunk_ops]  # one addition per chunk, in chunk order, as floats round
    per_op: Dict[str, Dict[str, float]] = {}
    for ops, n in pairs:
        for op, d in ops.items():
            acc = per_op.get(op)
            if acc is None:
                acc = per_op[op] = {"saved": 0.0, "fwd_peak": 0.0, "bwd_peak": 0.0, "count": 0}
            acc["saved"] += d["saved"] * n if n > 1 else d["saved"]
            acc["count"] += d["count"] * n
            # max over repeats of a chunk is the max over the chunk once (a tie keeps the accumulator).
            if d["fwd_peak"] > acc["fwd_peak"]:
                acc["fwd_peak"] = d["fwd_peak"]
            if d["bwd_peak"] > acc["bwd_peak"]:
                acc["bwd_peak"] = d["bwd_peak"]
    return per_op


def _integral_sums(pairs) -> bool:
    total = 0.0
    for ops, n in pairs:
        for d in ops.values():
            x = d["saved"]
            if not isinstance(x, (int, float)) or abs(x) >= _EXACT or not float(x).is_integer():
                return False
            total += abs(x) * n
    return total < _EXACT


_EXACT = float(1 << 53)


def _saved_at(steps, chunks, idx: int) -> float:
    """Saved activation bytes live when step idx runs (a forward's own saved bytes count, a backward's too)."""
    level = 0.0
    for i, (kind, _, c) in enumerate(steps[: idx + 1]):
        if kind == "F":
            level += chunks[c].saved
        elif i < idx:
            level -= chunks[c].saved
    return level
