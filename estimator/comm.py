"""Communication per parallel dimension: every collective of one training iteration, per rank class.

What megatron-core 0.16.1 issues (verified against real gloo runs in tests/test_comm_measured.py for TP, TP+SP, PP
and DP with and without the distributed optimizer; CP and EP rows are modelled):
- TP, no SP: all-reduce of [s/cp, b, h] twice per layer forward (row-parallel outputs) and twice backward
  (column-parallel input grads); the vocab-parallel embedding all-reduces its output; the output layer all-reduces
  its input grad; vocab-parallel cross-entropy all-reduces three fp32 [s/cp, b] tensors.
- TP + SP: per layer forward 2 all-gathers + 2 reduce-scatters, backward 4 all-gathers (input re-gather for the
  weight grad, and the reduce-scatters' backward) + 2 reduce-scatters; the embedding reduce-scatters [s, b, h] (rope or no
  positions; with learned positions it all-reduces [b, s, h], then splits) and all-gathers in backward; the output layer all-gathers forward and backward and reduce-scatters
  its input grad; after backward, one all-reduce of the grads of TP-replicated params (norms, row-parallel biases,
  MoE routers and shared-expert gates).
- PP: per microbatch, send of activations [s/cp/(t if SP), b, h] forward and of their grads backward.
- DP: megatron DDP's grad buffer per bucket (grad dtype; padded under the distributed optimizer): all-reduce, or
  reduce-scatter + all-gather of the param buffer (param dtype) with the distributed optimizer.
- Embedding group: all-reduce of the tied word-embedding grad [v/t, h] between first and last stage.
- Optimizer: one fp32 scalar all-reduce for the grad norm (model-parallel group; whole world with dist-opt).
Message bytes for all-gather / reduce-scatter are the full (gathered) tensor; wire bytes per rank use ring factors:
all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, send = message.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from estimator._record import dataclass, field

from estimator.parallel import ParallelLayout, layout_from_config
from estimator import fp8, moe_tokens, sharding
from estimator.args import moe_layer_pattern
from estimator.formulas import qk_norm_of
from estimator.static_memory import DTYPE_BYTES, ParamInfo, chunk_buffer, dp_layout, precision


def _g(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def ring_factor(op: str, n: int) -> float:
    """Bytes each rank sends per message byte, for ring algorithms (NCCL's bus-bandwidth convention)."""
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0  # send-recv: the message itself


@dataclass
class Collective:
    dim: str                 # tp | pp | dp | cp | ep | embedding | optimizer
    op: str                  # all-reduce | all-gather | reduce-scatter | send-recv | all-to-all
    what: str                # which tensor and where in the step
    group: str               # key into ParallelLayout.groups
    group_size: int
    groups: list             # the groups of that kind that run it (global ranks)
    ranks: list              # global ranks that issue it (a rank class)
    shape: tuple
    dtype: str
    bytes: int               # one message (full tensor for all-gather / reduce-scatter)
    per_microbatch: int      # calls per microbatch on one rank (0 = once per iteration)
    per_iteration: int       # calls per iteration on one rank
    phase: str = "fwd"       # fwd | bwd | step | recompute
    modelled: bool = False   # True: not checked against a measured run
    direction: str = ""      # send-recv only: "send" or "recv" (the receiver puts nothing on the wire)

    @property
    def wire_bytes_per_call(self) -> int:
        if self.op == "send-recv" and self.direction == "recv":
            return 0
        return int(round(self.bytes * ring_factor(self.op, self.group_size)))

    @property
    def wire_bytes_per_iteration(self) -> int:
        return self.wire_bytes_per_call * self.per_iteration

    @property
    def cluster_bytes_per_iteration(self) -> int:
        return self.wire_bytes_per_iteration * len(self.ranks)

    def measured_ops(self) -> list:
        """torch.distributed op names this row stands for (used by the measured test)."""
        return [self.direction] if self.op == "send-recv" else [self.op]

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["shape"] = list(self.shape)
        d.update(wire_bytes_per_call=self.wire_bytes_per_call, wire_bytes_per_iteration=self.wire_bytes_per_iteration,
                 cluster_bytes_per_iteration=self.cluster_bytes_per_iteration)
        return d


@dataclass
class CommReport:
    collectives: list
    layout: ParallelLayout
    notes: list = field(default_factory=list)

    def stage_classes(self):
        """(stage of each global rank, per stage the wire bytes per iteration of one of its ranks by dimension), or
        None when some collective's issuing ranks are not whole pipeline stages. communication() builds every
        row from whole stages, so ranks of one stage issue the same collectives: per-rank figures are per-stage
        figures, found without a pass over every rank of every row."""
        lay = self.layout
        pp_groups = lay.groups["pp"]
        stage_of = [0] * lay.world_size
        for g in pp_groups:
            for p, r in enumerate(g):
                stage_of[r] = p
        size = len(pp_groups)  # ranks per stage
        per_stage: list = [{} for _ in range(lay.pp)]
        seen: dict = {}
        for c in self.collectives:
            stages = seen.get(id(c.ranks))
            if stages is None:
                stages = seen[id(c.ranks)] = sorted({stage_of[r] for r in c.ranks})
                if len(c.ranks) != size * len(stages):   # ranks are distinct: whole stages exactly when this holds
                    return None
            for p in stages:
                d = per_stage[p]
                d[c.dim] = d.get(c.dim, 0) + c.wire_bytes_per_iteration
        return stage_of, per_stage, seen

    def per_rank_bytes(self) -> dict:
        """Wire bytes per iteration sent by each global rank, by dimension."""
        classes = self.stage_classes()
        if classes is not None:
            stage_of, per_stage, _ = classes
            return {r: dict(per_stage[p]) for r, p in enumerate(stage_of)}
        out = {r: {} for r in range(self.layout.world_size)}
        for c in self.collectives:
            dim, wire = c.dim, c.wire_bytes_per_iteration  # one value per collective, added for each rank
            for r in c.ranks:
                row = out[r]
                row[dim] = row.get(dim, 0) + wire
        return out

    def busiest_rank_bytes(self) -> int:
        """Wire bytes per iteration of the rank that sends the most, all dimensions together."""
        classes = self.stage_classes()
        if classes is not None:
            return max((sum(d.values()) for d in classes[1]), default=0)
        totals = [0] * self.layout.world_size
        for c in self.collectives:
            wire = c.wire_bytes_per_iteration
            for r in c.ranks:
                totals[r] += wire
        return max(totals, default=0)

    def summary(self) -> dict:
        """Per dimension: calls per iteration (max over ranks), max wire bytes per rank, cluster total."""
        classes = self.stage_classes()
        dims: dict = {}
        for c in self.collectives:
            d = dims.setdefault(c.dim, {"ops": [], "calls_per_iteration": {}, "cluster_bytes_per_iteration": 0,
                                        "modelled": False})
            if c.op not in d["ops"]:
                d["ops"].append(c.op)
            d["cluster_bytes_per_iteration"] += c.cluster_bytes_per_iteration
            d["modelled"] = d["modelled"] or c.modelled
            calls = d["calls_per_iteration"]
            for who in (classes[2][id(c.ranks)] if classes else c.ranks):  # stages, or ranks
                calls[who] = calls.get(who, 0) + c.per_iteration
        per = classes[1] if classes else list(self.per_rank_bytes().values())
        for dim, d in dims.items():
            d["calls_per_iteration"] = max(d["calls_per_iteration"].values(), default=0)
            d["max_rank_bytes_per_iteration"] = max((b.get(dim, 0) for b in per), default=0)
        return dims

    def to_dict(self) -> dict:
        return {"order": self.layout.order,
                "groups": {k: [list(g) for g in v] for k, v in self.layout.groups.items()},
                "summary": self.summary(),
                "per_rank_bytes_per_iteration": {str(r): b for r, b in self.per_rank_bytes().items()},
                "collectives": [c.to_dict() for c in self.collectives], "notes": list(self.notes)}


# Group kinds whose groups vary no pipeline coordinate (megatron builds them from tp/cp/ep/dp digits only).
_ONE_STAGE_KINDS = frozenset(["tp", "cp", "dp", "dp-cp", "tp-cp", "tp-dp-cp", "ep", "expert-tp", "expert-dp",
                              "dp-cp-intra", "expert-dp-intra", "dist-opt-inter",
                              "expert-tp-ep"])


def layers_per_stage(cfg: Any) -> list:
    """Decoder layers on each PP rank (all virtual chunks together), megatron's uneven first/last split."""
    pp, n = _g(cfg, "pipeline_model_parallel_size", 1), _g(cfg, "num_layers", 1)
    if _g(cfg, "pipeline_model_parallel_layout") is not None:
        from estimator.model import layers_per_pp_rank
        return [layers_per_pp_rank(cfg, p) for p in range(pp)]
    first, last = _g(cfg, "decoder_first_pipeline_num_layers"), _g(cfg, "decoder_last_pipeline_num_layers")
    if pp == 1:
        return [n]
    fixed = {0: first, pp - 1: last}
    fixed = {k: v for k, v in fixed.items() if v is not None}
    rest = n - sum(fixed.values())
    middle = pp - len(fixed)
    each = rest // middle if middle else 0
    return [fixed.get(p, each) for p in range(pp)]


def tp_replicated_grad_elements(cfg: Any) -> list:
    """Per PP stage: the gradient elements megatron-core all-reduces over TP after the backward
    (finalize_model_grads._allreduce_non_tensor_model_parallel_grads): parameters tagged sequence_parallel under SP
    and qk-layernorm weights; 0 without TP."""
    pp = _g(cfg, "pipeline_model_parallel_size", 1)
    if _g(cfg, "tensor_model_parallel_size", 1) <= 1:
        return [0] * pp
    mtp = _g(cfg, "mtp_num_layers") or 0
    layers = layers_per_stage(cfg)
    sp, h = bool(_g(cfg, "sequence_parallel", False)), _g(cfg, "hidden_size")
    moe = moe_layers_per_stage(cfg, layers) if _g(cfg, "num_experts") and sp else [0] * pp
    # per MoE layer under SP: the router's weight [E, h] and bias [E], the shared experts' gate [1, h], and with
    # biases (expert TP 1 only) each local expert's output bias [h] where a dense layer has one
    e = _g(cfg, "num_experts") or 0
    bias = _g(cfg, "add_bias_linear", True)
    local = e // max(1, _g(cfg, "expert_model_parallel_size", 1) or 1)
    per_moe = e * h + (e + (local - 1) * h if bias else 0) + (h if _g(cfg, "moe_shared_expert_gate", False) else 0)
    out = []
    for p in range(pp):
        n = _tp_replicated_elements(cfg, layers[p] + (mtp if p == pp - 1 else 0), p == pp - 1)
        if n and p == pp - 1 and sp:   # MTP's three norms per layer
            n += 3 * mtp * h * (1 if _g(cfg, "normalization", "LayerNorm") == "RMSNorm" else 2)
        out.append(n + moe[p] * per_moe)
    return out


def _tp_replicated_elements(cfg: Any, layers: int, last: bool) -> int:
    """Grad elements all-reduced over TP after backward: params tagged sequence_parallel (norms, row-parallel
    biases) with SP, plus qk-layernorm weights, for every layer (tp_replicated_grad_elements adds what an MoE layer
    has besides)."""
    h = _g(cfg, "hidden_size")
    norm = h * (1 if _g(cfg, "normalization", "LayerNorm") == "RMSNorm" else 2)
    n = 0
    if _g(cfg, "sequence_parallel", False):
        bias = h if _g(cfg, "add_bias_linear", True) else 0
        n += layers * (2 * norm + 2 * bias) + (norm if last else 0)
    if _g(cfg, "multi_latent_attention", False):
        # the replicated down projections and the latents' norms see each rank's own tokens under SP
        if _g(cfg, "sequence_parallel", False):
            q, kv, rope = _g(cfg, "q_lora_rank") or 0, _g(cfg, "kv_lora_rank"), _g(cfg, "qk_pos_emb_head_dim")
            norms = (q + kv) * (1 if _g(cfg, "normalization", "LayerNorm") == "RMSNorm" else 2) \
                if _g(cfg, "qk_layernorm", False) else 0
            n += layers * (h * (q + kv + rope) + norms)
    elif qk_norm_of(cfg) == "layernorm":   # (an L2 norm has no weights)
        d = _g(cfg, "kv_channels") or h // _g(cfg, "num_attention_heads")
        n += layers * 2 * d * (1 if _g(cfg, "normalization", "LayerNorm") == "RMSNorm" else 2)
    return n


# TP rows of one stage's layers, with and without sequence parallelism: (op, what, phase, calls per layer, whether
# only recomputed layers issue it (then modelled)). Built once here rather than per estimate.
_TP_LAYER_ROWS = {
    False: (("all-reduce", "layer outputs (attention proj, MLP fc2)", "fwd", 2, False),
            ("all-reduce", "layer input grads (qkv, fc1)", "bwd", 2, False),
            ("all-reduce", "recomputed layer outputs", "recompute", 2, True)),
    True: (("all-gather", "layer inputs (qkv, fc1)", "fwd", 2, False),
           ("reduce-scatter", "layer outputs (attention proj, MLP fc2)", "fwd", 2, False),
           ("all-gather", "input re-gather for weight grads + output grads", "bwd", 4, False),
           ("reduce-scatter", "layer input grads (qkv, fc1)", "bwd", 2, False),
           ("all-gather", "recomputed layer inputs", "recompute", 2, True),
           ("reduce-scatter", "recomputed layer outputs", "recompute", 2, True)),
}


def _mla_tp_rows(cfg: Any, sp: bool, s: int, b: int, h: int) -> list:
    """Per layer, the TP collectives of megatron-core's MLASelfAttention with the TE spec and of a dense or MoE
    layer's MLP side (its fc1 / fc2 pair, as _TP_LAYER_ROWS counts it): (op, what, phase, calls, recomputed, shape).
    The down projections are replicated (no collective); the up projections are column-parallel on the latents, so
    their inputs are gathered (SP) and their input gradients reduced, and under SP the shared rotary key is gathered
    (megatron's gather_from_sequence_parallel_region). Without a query latent the query projection is
    column-parallel on the hidden state."""
    q_in = _g(cfg, "q_lora_rank") or h
    ins = [("query up projection input" if q_in != h else "query projection input", (s, b, q_in)),
           ("key-value up projection input", (s, b, _g(cfg, "kv_lora_rank")))]
    mlp, out = ("MLP fc1 input", (s, b, h)), ("layer outputs (attention proj, MLP fc2)", (s, b, h))
    rows = []
    for recomputed, phase in ((False, "fwd"), (True, "recompute")):
        if sp:
            for what, shape in ins + [mlp]:
                rows.append(("all-gather", what, phase, 1, recomputed, shape))
            rows.append(("all-gather", "rotary key part", phase, 1, recomputed, (s, b, _g(cfg, "qk_pos_emb_head_dim"))))
            rows.append(("reduce-scatter", out[0], phase, 2, recomputed, out[1]))
        else:
            rows.append(("all-reduce", out[0], phase, 2, recomputed, out[1]))
    if sp:
        for what, shape in ins + [mlp]:
            rows.append(("all-gather", what + " re-gather for weight grads", "bwd", 1, False, shape))
            rows.append(("reduce-scatter", what + " grad", "bwd", 1, False, shape))
        rows.append(("reduce-scatter", "rotary key part grad", "bwd", 1, False,
                     (s, b, _g(cfg, "qk_pos_emb_head_dim"))))
        rows.append(("all-gather", "output grads (attention proj, MLP fc2)", "bwd", 2, False, (s, b, h)))
    else:
        for what, shape in ins + [mlp]:
            rows.append(("all-reduce", what + " grad", "bwd", 1, False, shape))
    return rows


# PP rows of one stage: (what it sends, what it receives, phase) for activations forward and their grads backward.
_PP_ROWS = (("activations to next/prev stage", "activations from prev/next stage", "fwd"),
            ("activation grads to next/prev stage", "activation grads from prev/next stage", "bwd"))


def _shape_bytes(dtype: str, shape: tuple) -> int:
    n = DTYPE_BYTES.get(dtype, 4)
    for x in shape:
        n *= x
    return n


def communication(cfg: Any, layout: Optional[ParallelLayout] = None,
                  chunks_by_stage: Optional[dict] = None) -> CommReport:
    """All collectives of one iteration. `chunks_by_stage[pp_rank]` = that stage's model chunks, each a list of
    ParamInfo in named_parameters order (from estimator.model); without it DP buffer rows are left out."""
    lay = layout or layout_from_config(cfg)
    t, pp, cp, ep = lay.tp, lay.pp, lay.cp, lay.ep
    sp = bool(_g(cfg, "sequence_parallel", False)) and t > 1
    s, b, h = _g(cfg, "seq_length") // cp, _g(cfg, "micro_batch_size", 1), _g(cfg, "hidden_size")
    m = _g(cfg, "num_microbatches", 1)
    vpp = _g(cfg, "virtual_pipeline_model_parallel_size", 1) or 1
    pdt, gdt = precision(cfg)
    tied = not _g(cfg, "untie_embeddings_and_output_weights", False)
    # multi-token prediction's layers run on the last stage: each a transformer layer of the decoder's last
    # layer's kind, the embedding of the shifted tokens, a projection and one more loss head
    mtp = _g(cfg, "mtp_num_layers") or 0
    decoder_layers = layers_per_stage(cfg)
    layers = decoder_layers[:-1] + [decoder_layers[-1] + mtp]
    # Every pp group holds one rank of each stage, in stage order: column p of the pp groups is stage p's ranks
    # (== lay.stage_ranks(p) for every p, in one pass).
    stage_ranks = [sorted(col) for col in zip(*lay.groups["pp"])]
    stage_of: list = []  # rank -> pp stage, filled on first use
    rows: list = []
    notes: list = []
    members_of: dict = {}  # (group kind, stage or stages) -> (issuing ranks, groups that hold one of them, size)
    stages_hit: dict = {}  # group kind -> (per group the set of stages it touches, per stage its groups)

    def by_stage_of(group):
        """[per group the set of stages it touches (None until asked for), per stage the groups holding one of
        its ranks], one pass over the groups per kind."""
        hits = stages_hit.get(group)
        if hits is not None:
            return hits
        all_groups = lay.groups[group]
        if pp == 1:
            hits = [None, [list(all_groups)]]
        elif group == "pp":
            hits = [None, [list(all_groups)] * pp]  # every pp group holds a rank of every stage
        else:
            if not stage_of:
                stage_of.extend([0] * lay.world_size)
                for p, ranks in enumerate(stage_ranks):
                    for r in ranks:
                        stage_of[r] = p
            by_stage: list = [[] for _ in range(pp)]
            if group in _ONE_STAGE_KINDS:
                # Its groups vary no pipeline coordinate: each lies in the stage of its first rank.
                touched = None
                for g in all_groups:
                    by_stage[stage_of[g[0]]].append(g)
            else:
                touched = [{stage_of[r] for r in g} for g in all_groups]
                for g, hit in zip(all_groups, touched):
                    for p in hit:
                        by_stage[p].append(g)  # group order kept within each stage
            hits = [touched, by_stage]
        stages_hit[group] = hits
        return hits

    def member(group, p):
        """(ranks of stage p, the groups of this kind holding one of them, group size); shared by the rows of
        one (kind, stage) pair, read-only once built."""
        key = (group, p)
        hit = members_of.get(key)
        if hit is None:
            groups = by_stage_of(group)[1][p]
            hit = members_of[key] = (stage_ranks[p], groups, len(groups[0]) if groups else 1)
        return hit

    def members(group, stages):
        """member() for a row issued by the ranks of several stages."""
        ranks = sorted([r for p in stages for r in stage_ranks[p]])
        all_groups = lay.groups[group]
        wanted = set(stages)
        if len(wanted) == pp:
            groups = list(all_groups)  # all stages: every group holds one of their ranks
        else:
            hits = by_stage_of(group)
            if hits[0] is None:  # kinds whose stages by_stage_of did not need per group
                if group == "pp":
                    hits[0] = [set(range(pp))] * len(all_groups)
                else:  # one-stage kinds (pp > 1 here, as a proper subset of the stages was asked for)
                    hits[0] = [{stage_of[g[0]]} for g in all_groups]
            groups = [g for g, hit in zip(all_groups, hits[0]) if not wanted.isdisjoint(hit)]
        return ranks, groups, len(groups[0]) if groups else 1

    def add(dim, op, what, group, shape, dtype, per_mb, stages, phase, per_iter=None, modelled=False, direction=""):
        """One row, unless never issued (the only other reason to leave a row out: every stage has ranks) or
        its group is of one rank (moves nothing)."""
        if per_mb == 0 and not per_iter:
            return
        if len(stages) == 1:
            ranks, groups, size = member(group, stages[0])
        else:
            key = (group, tuple(stages))
            hit = members_of.get(key)
            if hit is None:
                hit = members_of[key] = members(group, stages)
            ranks, groups, size = hit
        if size <= 1:
            return
        rows.append(Collective(dim, op, what, group, size, groups, ranks, tuple(shape), dtype,
                               _shape_bytes(dtype, shape), per_mb, per_iter if per_iter is not None else per_mb * m,
                               phase, modelled, direction))

    full_act, first, last = (s, b, h), [0], [pp - 1]
    replicated = tp_replicated_grad_elements(cfg)
    recompute_full = _g(cfg, "recompute_granularity") == "full"
    if t > 1:
        # (op, what, phase, calls per layer, recomputed, shape, bytes): multi-latent attention's own, or the standard
        # layer's on hidden-state-sized tensors
        if _g(cfg, "multi_latent_attention", False):
            layer_rows = [r + (_shape_bytes(pdt, r[5]),) for r in _mla_tp_rows(cfg, sp, s, b, h)]
        else:
            act_bytes = _shape_bytes(pdt, full_act)
            layer_rows = [r + (full_act, act_bytes) for r in _TP_LAYER_ROWS[sp]]
    for p in range(pp):
        L = layers[p]
        # Full recompute replays each recomputed layer's forward (and its TP collectives) during backward.
        rec = 0
        if recompute_full:
            rec = min(_g(cfg, "recompute_num_layers", 1), L) if _g(cfg, "recompute_method") == "block" else L
        if t > 1 and L:
            ranks, groups, size = member("tp", p)
            if size > 1:
                for op, what, phase, calls, recomputed, shape, nbytes in layer_rows:
                    per_mb = calls * (rec if recomputed else L)
                    if per_mb != 0:
                        rows.append(Collective("tp", op, what, "tp", size, groups, ranks, shape, pdt, nbytes,
                                               per_mb, per_mb * m, phase, recomputed, ""))
        sp_elems = replicated[p]
        if sp_elems:
            add("tp", "all-reduce", "grads of TP-replicated params (norms, row-parallel biases, MoE routers)", "tp",
                (sp_elems,), gdt, 0, [p], "step", per_iter=1)

    if t > 1:
        # megatron-core reduce-scatters the vocab-parallel embedding's output straight into the sequence-parallel
        # layout when no learned position embedding is added after it (LanguageModelEmbedding.
        # reduce_scatter_embeddings); otherwise it all-reduces, adds positions, then scatters (no communication).
        # (MTP's embedding of the shifted tokens does the same on the last stage.)
        for stage, n in ((first, 1), (last, mtp)):
            if sp and _g(cfg, "position_embedding_type", "learned_absolute") != "learned_absolute":
                add("tp", "reduce-scatter", "word embedding output", "tp", full_act, pdt, n, stage, "fwd")
            else:
                add("tp", "all-reduce", "word embedding output", "tp", (b, s, h), pdt, n, stage, "fwd")
            if sp:
                add("tp", "all-gather", "embedding grad (sequence scatter backward)", "tp", full_act, pdt, n, stage,
                    "bwd")
        heads = 1 + mtp     # the main loss head and one per MTP layer
        if sp:
            add("tp", "all-gather", "output layer input", "tp", full_act, pdt, heads, last, "fwd")
            add("tp", "all-gather", "output layer input re-gather for weight grad", "tp", full_act, pdt, heads, last,
                "bwd")
            add("tp", "reduce-scatter", "output layer input grad", "tp", full_act, pdt, heads, last, "bwd")
        else:
            add("tp", "all-reduce", "output layer input grad", "tp", full_act, pdt, heads, last, "bwd")
        add("tp", "all-reduce", "vocab-parallel cross-entropy (max, target logit, sum exp)", "tp", (s, b), "fp32",
            3 * heads, last, "fwd")
        if mtp:
            # MTP's projection of [embedding, hidden] (column-parallel, 2h -> h), gathered whole over TP, then
            # scattered over the sequence under SP (its backward gathers)
            joined = (s, b, 2 * h)
            if sp:
                add("tp", "all-gather", "MTP projection input", "tp", joined, pdt, mtp, last, "fwd")
                add("tp", "all-gather", "MTP projection input re-gather for weight grad", "tp", joined, pdt, mtp,
                    last, "bwd")
                add("tp", "reduce-scatter", "MTP projection input grad", "tp", joined, pdt, mtp, last, "bwd")
                add("tp", "all-gather", "MTP projection output grad (sequence scatter backward)", "tp", full_act,
                    pdt, mtp, last, "bwd")
            else:
                add("tp", "all-reduce", "MTP projection input grad", "tp", joined, pdt, mtp, last, "bwd")
            add("tp", "all-gather", "MTP projection output (gathered over TP)", "tp", full_act, pdt, mtp, last,
                "fwd")

    if pp > 1:
        act = (s // t if sp else s, b, h)
        act_bytes = _shape_bytes(pdt, act)
        # Interleaving: each of the vpp chunks sends once per microbatch, except the model's last chunk (fwd)
        # and first chunk (bwd). Both counts are multiples of m.
        for p in range(pp):
            fwd_sends = m * vpp - (m if p == pp - 1 else 0)
            fwd_recvs = m * vpp - (m if p == 0 else 0)
            ranks, groups, size = member("pp", p)
            for (send, recv, phase), n_send, n_recv in zip(_PP_ROWS, (fwd_sends, fwd_recvs), (fwd_recvs, fwd_sends)):
                if n_send:
                    rows.append(Collective("pp", "send-recv", send, "pp", size, groups, ranks, act, pdt, act_bytes,
                                           n_send // m, n_send, phase, vpp > 1, "send"))
                if n_recv:
                    rows.append(Collective("pp", "send-recv", recv, "pp", size, groups, ranks, act, pdt, act_bytes,
                                           n_recv // m, n_recv, phase, vpp > 1, "recv"))
        if tied or mtp:     # (under MTP megatron-core keeps the last stage's output weight in the group)
            v = _g(cfg, "padded_vocab_size") or _g(cfg, "vocab_size")
            add("embedding", "all-reduce", "tied word-embedding grad (first and last stage)", "embedding",
                (v // t, h), gdt, 0, [0, pp - 1], "step", per_iter=1)

    if cp > 1:
        g = _g(cfg, "num_query_groups") or _g(cfg, "num_attention_heads")
        d = _g(cfg, "kv_channels") or h // _g(cfg, "num_attention_heads")
        kv = (2, s, b, (g // t if g >= t else 1) * d)
        for p in range(pp):
            add("cp", "send-recv", "ring attention K,V blocks", "cp", kv, pdt, (cp - 1) * layers[p], [p], "fwd",
                modelled=True, direction="send")
            add("cp", "send-recv", "ring attention K,V blocks + dK,dV", "cp", (2,) + kv, pdt, (cp - 1) * layers[p],
                [p], "bwd", modelled=True, direction="send")
        notes.append("CP: ring exchange of K/V (TE/flash attention) is modelled; not measurable on CPU.")

    num_experts = _g(cfg, "num_experts")
    if num_experts and (ep > 1 or lay.etp > 1):
        k = _g(cfg, "moe_router_topk", 2)
        moe_layers = moe_layers_per_stage(cfg, decoder_layers)
        tokens = s * b // (t if sp else 1)
        disp = _g(cfg, "moe_token_dispatcher_type", "allgather")
        routing = moe_tokens.routing(cfg)
        # A rank sends each of its tokens' k copies (fewer when dropped); padded to capacity, capacity rows per expert.
        sent = routing.capacity * num_experts if routing.mode == "padded" else tokens * k
        for p in range(pp):
            n = moe_layers[p]
            if disp == "alltoall" and ep > 1:
                add("ep", "all-to-all", "token dispatch + combine (top-k copies)", "ep", (sent, h), pdt, 2 * n,
                    [p], "fwd", modelled=True)
                add("ep", "all-to-all", "dispatch + combine grads", "ep", (sent, h), pdt, 2 * n, [p], "bwd",
                    modelled=True)
            else:
                gsz = len(lay.groups["expert-tp-ep"][0])
                add("ep", "all-gather", "tokens to all experts (allgather dispatcher)", "expert-tp-ep",
                    (tokens * gsz, h), pdt, n, [p], "fwd", modelled=True)
                add("ep", "reduce-scatter", "combine expert outputs", "expert-tp-ep", (tokens * gsz, h), pdt, n, [p],
                    "fwd", modelled=True)
                add("ep", "all-gather", "combine grads", "expert-tp-ep", (tokens * gsz, h), pdt, n, [p], "bwd",
                    modelled=True)
                add("ep", "reduce-scatter", "token grads", "expert-tp-ep", (tokens * gsz, h), pdt, n, [p], "bwd",
                    modelled=True)
        notes.append("EP: all-to-all volumes are what each rank sends (every token's top-k copies, or capacity rows "
                     "per expert when padded; what a rank receives depends on routing); routing metadata collectives "
                     "are small and not listed (modelled).")

    if chunks_by_stage is not None and sharding.active(cfg):
        def fsdp_row(op, what, group, n, dtype, per_mb, per_iter, p, phase):
            add("dp", op, what, group, (n,), dtype, per_mb, [p], phase, per_iter, modelled=True)
        stage_params = {p: (sum(x[0] for c in chunks for x in c if not x[1]),
                            sum(x[0] for c in chunks for x in c if x[1])) for p, chunks in chunks_by_stage.items()}
        sharding.comm_rows(cfg, fsdp_row, stage_params)
        notes.append("DP: sharded data parallelism (FSDP) is modelled: whole-stage volumes, not per-unit buckets.")
    elif chunks_by_stage is not None:
        _dp_rows(cfg, lay, chunks_by_stage, member, rows, pdt, gdt)
    else:
        notes.append("DP: per-rank parameter lists not given; gradient-buffer collectives left out.")
    dist_opt = bool(_g(cfg, "use_distributed_optimizer", False))
    # The distributed optimizer's shards span DP, so its grad norm is reduced over the whole world.
    add("optimizer", "all-reduce", "grad-norm (fp32 scalar)", "world" if dist_opt else "tp-pp",
        (1,), "fp32", 0, list(range(pp)), "step", per_iter=1)
    return CommReport(collectives=rows, layout=lay, notes=notes)


def moe_layers_per_stage(cfg: Any, decoder_layers: Sequence[int]) -> list:
    """MoE layers per stage (decoder_layers: layers_per_stage), the last stage's MTP layers counted where the
    decoder's last layer, whose spec they repeat, is an MoE one."""
    pattern = moe_layer_pattern(cfg)
    out = _moe_layers_per_stage(pattern, decoder_layers)
    mtp = _g(cfg, "mtp_num_layers") or 0
    if mtp and pattern[-1]:
        out[-1] += mtp
    return out


def _moe_layers_per_stage(pattern: Sequence[int], layers: Sequence[int]) -> list:
    """MoE layers per stage: `pattern` (args.moe_layer_pattern) cut into the stages' layer counts."""
    out, i = [], 0
    for L in layers:
        out.append(sum(pattern[i:i + L]))
        i += L
    return out


def _dp_rows(cfg, lay, chunks_by_stage, member, rows, pdt, gdt) -> None:
    """DDP grad sync per bucket, exactly as megatron's _ParamAndGradBuffer splits and pads its buffers.
    member(group kind, stage) -> (ranks, groups, group size) as in communication(); rows are appended to `rows`."""
    dist_opt, dense_dp, expert_dp, first_bucket = dp_layout(cfg)   # DP sizes: one optimizer instance's
    # several distributed-optimizer instances: each reduce-scatters within its own ranks, then the ranks holding
    # one shard all-reduce it across the instances (megatron-core's _ParamAndGradBucketGroup.start_grad_sync)
    instances = _g(cfg, "num_distributed_optimizer_instances", 1)   # read on the distributed-optimizer path only
    pe, ge = DTYPE_BYTES.get(pdt, 4), DTYPE_BYTES.get(gdt, 4)
    for p, chunks in chunks_by_stage.items():
        # --fp8-param-gather: the GEMM weights are gathered in fp8 (modelled: their share of the stage's
        # parameters, spread evenly over its param buckets).
        fp8_share = fp8.param_gather_share(cfg, p, chunks)
        for ci, chunk in enumerate(chunks):
            bucket = first_bucket if p == 0 and ci == 0 else None
            for expert, group, size in ((False, "dp-cp", dense_dp), (True, "expert-dp", expert_dp)):
                _, layout = chunk_buffer(chunk, expert, size, dist_opt, bucket)
                if layout is None:
                    continue
                kind = "expert " if expert else ""
                grad_what = f"{kind}grad bucket (chunk {ci})"
                if not dist_opt:
                    ranks, groups, gsize = member(group, p)
                    if gsize > 1:   # a group of one moves nothing
                        for (b0, b1) in layout.buckets:
                            n = b1 - b0
                            rows.append(Collective("dp", "all-reduce", grad_what, group, gsize, groups, ranks, (n,),
                                                   gdt, ge * n, 0, 1, "step", False, ""))
                    continue
                if instances > 1:
                    group += "-intra"
                    inter = member("dist-opt-inter", p)
                ranks, groups, gsize = member(group, p)
                param_what = f"{kind}param bucket after step (chunk {ci})"
                for (b0, b1) in layout.buckets:
                    n = b1 - b0
                    if gsize > 1:
                        rows.append(Collective("dp", "reduce-scatter", grad_what, group, gsize, groups, ranks, (n,),
                                               gdt, ge * n, 0, 1, "step", False, ""))
                    if instances > 1:
                        shard = n // size
                        rows.append(Collective("dp", "all-reduce", f"{kind}grad shard across optimizer instances "
                                               f"(chunk {ci})", "dist-opt-inter", inter[2], inter[1], inter[0],
                                               (shard,), gdt, ge * shard, 0, 1, "step", False, ""))
                    if gsize <= 1:
                        continue
                    if fp8_share and not expert:
                        rows.append(Collective("dp", "all-gather", param_what, group, gsize, groups, ranks,
                                               (n,), f"{pdt}/fp8", int(n * (pe - (pe - 1) * fp8_share)), 0, 1,
                                               "step", True, ""))
                    else:
                        rows.append(Collective("dp", "all-gather", param_what, group, gsize, groups, ranks,
                                               (n,), pdt, pe * n, 0, 1, "step", False, ""))

__all__ = ["Collective", "CommReport", "communication", "ring_factor", "layers_per_stage", "ParamInfo"]
