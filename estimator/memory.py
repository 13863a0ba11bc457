"""Top level: per rank class static memory + schedule-simulated activations -> peak (estimate(cfg, fset))."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from . import activations as A
from . import formulas as F
from . import schedule as S
from .static_memory import ParamInfo, StaticMemory, static_memory


@dataclass
class RankEstimate:
    pp_rank: int               # TP and EP ranks of one stage hold identical shapes, so a class is a PP stage
    params: int
    expert_params: int
    bytes: Dict[str, float]    # parameters, gradients, optimizer_states, activations, other (transient at peak)
    peak_bytes: float
    peak_phase: str
    in_flight_max: int
    per_op: Dict[str, Dict[str, float]]   # op -> saved / fwd_peak / bwd_peak bytes per microbatch (+ count)
    static: StaticMemory = None
    timeline: Optional[S.RankTimeline] = None


@dataclass
class Estimate:
    formula_set: str           # "name (kind)": reports must say when it is 'modelled'
    ranks: List[RankEstimate]
    max_peak_bytes: float
    max_peak_pp_rank: int
    schedule: str


def param_chunks(cfg, pp_rank: int, vpp: int) -> List[List[ParamInfo]]:
    from . import model as M  # owned by a colleague: rank_params(cfg, pp_rank, vp_stage) -> RankParams(.ops)
    tied = not getattr(cfg, "untie_embeddings_and_output_weights", False)
    pp = cfg.pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp):
        ops = M.rank_params(cfg, pp_rank, vp if vpp > 1 else None).ops
        # named_parameters order: SelfAttention registers linear_proj before linear_qkv.
        ops = sorted(enumerate(ops), key=lambda io: (io[1].layer if io[1].layer is not None else (-1 if io[1].op.startswith("embedding") else 1 << 30),
                                                  0 if "linear_proj" in io[1].op else 1, io[0]))
        params: List[ParamInfo] = []
        for _, op in ops:
            shared = op.shared_embedding or (tied and pp > 1 and op.op == "embedding.word_embeddings")
            for _ in range(op.count):
                for shape in op.shapes:
                    n = 1
                    for x in shape:
                        n *= x
                    params.append(ParamInfo(n, op.is_expert, shared))
        chunks.append(params)
    return chunks


def schedule_name(cfg) -> str:
    pp, vpp = cfg.pipeline_model_parallel_size, (cfg.virtual_pipeline_model_parallel_size or 1)
    return "no pipelining" if pp == 1 else ("interleaved 1F1B" if vpp > 1 else "1F1B")


def estimate(cfg: Any, formula_set: Union[str, F.FormulaSet, None] = None, timeline: bool = False) -> Estimate:
    """Every rank class's static bytes, activation bytes and schedule peak for one config."""
    fset = formula_set if isinstance(formula_set, F.FormulaSet) else F.load(formula_set or F.DEFAULT_SET)
    from . import model as M
    pp = cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    M_ = cfg.num_microbatches
    group = getattr(cfg, "microbatch_group_size_per_vp_stage", None) or pp
    cache = A.LayerCache(fset, cfg)
    moe = cfg.moe_layer_pattern()
    ranks = []
    for r in range(pp):
        chunks, per_op = [], {}
        for vp in range(vpp):
            layers = M.stage_layers(cfg, r, vp if vpp > 1 else None)
            first = r == 0 and vp == 0
            last = r == pp - 1 and vp == vpp - 1
            units = A.chunk_units(cache, [bool(moe[i]) for i in layers], first, last, recv_input=not first)
            chunks.append(A.fold_chunk(units))
            for op, d in A.per_op_bytes(units).items():
                acc = per_op.setdefault(op, {"saved": 0.0, "fwd_peak": 0.0, "bwd_peak": 0.0, "count": 0})
                acc["saved"] += d["saved"]; acc["count"] += d["count"]
                acc["fwd_peak"] = max(acc["fwd_peak"], d["fwd_peak"]); acc["bwd_peak"] = max(acc["bwd_peak"], d["bwd_peak"])
        st = static_memory(cfg, param_chunks(cfg, r, vpp), pp_rank=r)
        steps = S.order(pp, r, M_, vpp if vpp > 1 else None, group)
        tl = S.simulate(steps, chunks, st.total_bytes, st.optimizer_step_transient_bytes, keep_events=timeline,
                        warmup=S.warmup_count(pp, r, M_, vpp if vpp > 1 else None, group))
        # Activation bytes at the peak: the saved microbatches live then; the rest of the peak is transient.
        if tl.peak_phase == "optimizer step":
            act = 0.0
        else:
            act = _saved_at(steps, chunks, tl.peak_index)
        cats = {"parameters": st.weights_bytes, "gradients": st.grad_buffer_bytes,
                "optimizer_states": st.optimizer_bytes, "activations": act,
                "other": tl.peak - st.total_bytes - act}
        ranks.append(RankEstimate(r, st.params, st.expert_params, cats, tl.peak, tl.peak_phase, tl.in_flight_max,
                                  per_op, st, tl if timeline else None))
    top = max(ranks, key=lambda x: x.peak_bytes)
    return Estimate(fset.label, ranks, top.peak_bytes, top.pp_rank, schedule_name(cfg))


def _saved_at(steps, chunks, idx: int) -> float:
    """Saved activation bytes live when step idx runs (a forward's own saved bytes count, a backward's too)."""
    level = 0.0
    for i, (kind, _, c) in enumerate(steps[: idx + 1]):
        if kind == "F":
            level += chunks[c].saved
        elif i < idx:
            level -= chunks[c].saved
    return level
