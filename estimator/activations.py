"""Activation bytes per model chunk and microbatch from a formula set (recompute-aware).

A chunk is what one forward/backward of the schedule runs on one rank: a run of transformer layers plus, where it
holds them, the embedding (first chunk of stage 0) or final norm, output layer and loss (last chunk of the last
stage), and what the model keeps of the microbatch's input batch (tokens and position ids read by the embedding,
the loss mask read by the loss, the attention mask read by every layer). It is summarised as `saved` (bytes kept
per in-flight microbatch), `fwd_extra` (transient above the level at chunk entry during its forward) and
`bwd_extra` (transient above the level with all its saved bytes live).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from estimator._record import dataclass

from . import formulas as F
from . import moe_tokens, transforms
# The feature modules register their transforms (estimator.transforms) on import.
from . import context_parallel, fp8, fused_softmax, moe_probs_on_input, moe_router, offload, qk_norm, residual  # noqa: F401
from . import shared_experts  # noqa: F401

ATTN_OPS = ("layers.*.input_layernorm", "layers.*.self_attention.linear_qkv",
            "layers.*.self_attention.core_attention", "layers.*.self_attention.linear_proj",
            "layers.*.self_attention")
DENSE_MLP_OPS = ("layers.*.pre_mlp_layernorm", "layers.*.mlp.linear_fc1", "layers.*.mlp", "layers.*.mlp.linear_fc2")
MOE_MLP_OPS = ("layers.*.pre_mlp_layernorm", "layers.*.mlp.router", "layers.*.mlp", "layers.*.mlp.experts",
               "layers.*.mlp.shared_experts")
LAYER_OP = "layers.*"
FIRST_OPS = ("embedding",)
LAST_OPS = ("final_layernorm", "output_layer", "loss")
# The input batch (tracer.harness.get_batch, FORMATS 2.3): what the first chunk keeps of tokens and position ids,
# what the last keeps of labels and loss mask; every chunk gets the attention mask.
DATA_FIRST_OPS = ("data.tokens",)
DATA_LAST_OPS = ("data.labels",)
DATA_OPS = ("data.mask",)


HELD_OP = "backward_held"


def _determined(fset, fo, quantity: str) -> bool:
    """Whether the set's own formula behind `fo` gives `quantity` (not null, so not taken from a fallback)."""
    key = ("determined", fo.op, fo.when, quantity)
    hit = fset._cache.get(key)
    if hit is None:
        own = next((x for x in fset.formulas if x.op == fo.op and x.when == fo.when), None)
        hit = fset._cache[key] = own is not None and getattr(own, quantity) is not None
    return hit


def _op_rows(fset, ops, sw, env, fallbacks: set):
    """(op, saved, fwd, bwd) per op; adds the (op, quantity) pairs taken from the fallback set to `fallbacks`."""
    compiled = F.rows_evaluator(fset, ops, sw)
    if compiled is not None:  # the same evaluations, compiled into one function per (ops, switches)
        fn, used = compiled
        if used:
            fallbacks.update(used)
        return fn(env)
    rows = []
    for op in ops:
        fo, used = F.select_and_fallbacks(fset, op, sw)
        if used:
            fallbacks.update(used)
        rows.append((op, *(F.evaluate_selected(fset, op, fo, env) if fo else (0.0, 0.0, 0.0))))
    return rows


def _fold(rows) -> Tuple[float, float, float]:
    """(saved, fwd peak above entry, bwd peak above all-saved level) for ops run in order, backward in reverse."""
    cum = fwd = 0.0
    for _, s, f, _ in rows:
        fwd = max(fwd, cum + f)
        cum += s
    after = 0.0  # saved bytes of later ops, already freed when op i's backward runs
    bwd = 0.0
    for _, s, _, b in reversed(rows):
        bwd = max(bwd, b - after)
        after += s
    return cum, max(fwd, cum), bwd


class LayerCache:
    """Per-(set, config) evaluated layer rows, so a stage with 100 identical layers costs one evaluation."""

    def __init__(self, fset, cfg):
        self.fset, self.cfg = fset, cfg
        self.env = F.variables(cfg)
        self.sw = F.switches(cfg, self.env)
        self._cache: Dict[Tuple[bool, str], List[Tuple[str, float, float, float]]] = {}
        e, s, b, h, st = (self.env[k] for k in ("e", "s", "b", "h", "st"))
        self.hidden = e * s * b * h / st  # one sequence-sharded hidden state: pp recv input, checkpoint input
        # Layer backward peaks measured per point (FORMATS 4) exclude what the head's backward leaves live through
        # the decoder (the hidden-state gradient, a tied embedding's weight gradient, loss scalars): the set's
        # `backward_held`, None where it does not determine it.
        fo, used = F.select_and_fallbacks(fset, HELD_OP, self.sw)
        self._fallbacks = set(used)  # (op, quantity) pairs the evaluated rows took from the fallback set
        self.held = fo.evaluate(self.env)[2] if fo is not None and _determined(fset, fo, "bwd_peak") else None
        self.bwd_points: Dict[Tuple[bool, str], bool] = {}
        self.units: Dict[Any, Tuple[tuple, float]] = {}  # chunk_activations' layer / checkpoint-group units
        h = self.hidden
        self.recv_unit = (h, h, h, 0.0, [("pp_recv", h, h, 0.0)])
        self.routing = moe_tokens.routing(cfg)

    def model_unit(self, ops) -> tuple:
        """The unit of non-layer ops (embedding, or final norm + output layer + loss) run in order."""
        key = ("model_unit", ops)
        hit = self.units.get(key)
        if hit is None:
            rows = self.model_rows(ops)
            s, f, b = _fold(rows)
            hit = self.units[key] = (s, s, f, b, rows)
        return hit

    def data_ops(self, first: bool, last: bool) -> tuple:
        """The input-batch ops of a chunk that the set (or its fallback) has a formula for: sets fitted before the
        batch was traced as its own op, and the modelled set, have none (the batch then counts as zero)."""
        key = ("data_ops", first, last)
        hit = self.units.get(key)
        if hit is None:
            ops = (DATA_FIRST_OPS if first else ()) + (DATA_LAST_OPS if last else ()) + DATA_OPS
            hit = self.units[key] = tuple(op for op in ops if F.select(self.fset, op, self.sw) is not None)
        return hit

    def layer_rows(self, moe: bool, recompute: str):
        key = (moe, recompute)
        if key not in self._cache:
            sw = dict(self.sw, moe=moe, recompute=recompute)
            mlp = MOE_MLP_OPS if moe else DENSE_MLP_OPS
            if moe and not _g(self.cfg, "moe_shared_expert_intermediate_size"):
                mlp = MOE_MLP_OPS[:-1]   # no shared-expert module: no row (its formulas are not all zero then)
            ops = ATTN_OPS + mlp + (LAYER_OP,)
            rows = _op_rows(self.fset, ops, sw, self.env, self._fallbacks)
            if moe and self.routing.scales:
                # A per-op set's layer transients (the layer op's per-point formulas) span the MoE layer's routed
                # buffers too: their k terms scale like the expert side's.
                rows = [self._routed_row(r, sw) if moe_tokens.routed(r[0]) or r[0] == LAYER_OP else r for r in rows]
            # Modelled features that change a layer's saved bytes beyond the formula set's switches.
            extra = transforms.layer_rows(self.cfg, self.env, moe, self.fset.kind == "modelled")
            if extra:
                rows = list(rows) + extra
            self._cache[key] = rows
            fo = F.select(self.fset, LAYER_OP, sw)
            self.bwd_points[key] = fo is not None and any(
                pf.bwd_peak for pf in F.point_formulas(self.fset, LAYER_OP, fo.when))
        return self._cache[key]

    def _routed_row(self, row, sw):
        """An expert-side op's row under the routing bound (estimator.moe_tokens): its saved bytes with the
        rank's routed tokens; its transients, which may be one expert's on top of the others' saved bytes, with the
        busiest expert's tokens in the per-expert terms (those with 1/E: tokens * k * ep / E) and the rank's in the
        other routed ones (errs high: an op here spans all local experts, or the whole layer)."""
        fo = F.select(self.fset, row[0], sw)
        if fo is None:
            return row
        r = self.routing
        saved = moe_tokens.scaled(fo.saved, self.env, r.rank, r.rank)
        fwd = moe_tokens.scaled(fo.fwd_peak, self.env, r.rank, r.busiest)
        bwd = moe_tokens.scaled(fo.bwd_peak, self.env, r.rank, r.busiest)
        for pf in F.point_formulas(self.fset, row[0], fo.when):
            fwd = max(fwd, moe_tokens.scaled(pf.fwd_peak, self.env, r.rank, r.busiest))
            bwd = max(bwd, moe_tokens.scaled(pf.bwd_peak, self.env, r.rank, r.busiest))
        return (row[0], saved, fwd, bwd)

    def held_bwd(self, kinds, first: bool, last: bool) -> Tuple[float, float]:
        """(bytes to add to a unit's backward for what the backward holds from before it, and for its output
        when the stage sent and pseudo-freed it) for a unit of layers of these (moe, recompute) kinds: zero
        unless every layer's backward peak comes from per-point formulas (measured without them)."""
        if not kinds or not all(self.bwd_points.get(k, False) for k in kinds):
            return 0.0, 0.0
        # The measured value (the fit grids: one stage, tied embeddings) where the chunk holds both the loss
        # head and the embedding; elsewhere only the hidden-state gradient coming in (from the loss head or the
        # next stage), as no traced run separates it from the tied embedding's gradient.
        tied = not _g(self.cfg, "untie_embeddings_and_output_weights", False)
        held = self.held if (first and last and tied and self.held is not None) else self.hidden
        return held, self.hidden

    def fallbacks(self) -> set:
        """(op, quantity) pairs this config's evaluated rows (and backward_held) took from the fallback set."""
        return set(self._fallbacks)

    def model_rows(self, ops):
        key = (None, ops)
        if key not in self._cache:
            self._cache[key] = _op_rows(self.fset, ops, self.sw, self.env, self._fallbacks)
        return self._cache[key]


def _g(cfg, name, default=None):
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def recomputed_groups(cfg, n_layers: int) -> List[Tuple[int, int, bool]]:
    """[(first, last+1, checkpointed)] over a chunk's layers, as TransformerBlock._checkpointed_forward groups them."""
    if _g(cfg, "recompute_granularity") != "full" or n_layers == 0:
        return [(i, i + 1, False) for i in range(n_layers)]
    method = _g(cfg, "recompute_method", "uniform")
    n = _g(cfg, "recompute_num_layers", 1)
    if method == "block":
        return [(i, i + 1, i < n) for i in range(n_layers)]
    return [(i, min(i + n, n_layers), True) for i in range(0, n_layers, n)]


def cache_for(fset, cfg):
    """The per-(set, config) evaluator: a LayerCache, or for a composed set (FORMATS 4.1) a ComposedCache."""
    if fset.programs is not None:
        from .program_cache import ProgramCache
        return ProgramCache(fset, cfg)
    if fset.composed:
        from .compose import ComposedCache
        return ComposedCache(fset, cfg)
    return LayerCache(fset, cfg)


def _composed_chunk(cache, moe_flags, first: bool, last: bool, recv_input: bool):
    from .compose import chunk_body
    saved, fwd, bwd, rows, again = chunk_body(cache, moe_flags, first, last)
    units = [cache.recv_unit] if recv_input else []
    # The stage output of a chunk before the last is sent and pseudo-freed; the backward starts with the received
    # gradient in its place (and frees it no earlier than the layer that frees its own in a one-stage run): the
    # level stays.
    h = 0.0 if last else cache.hidden
    units.append((saved - h, saved - h, fwd, bwd + h, rows))
    acts = fold_chunk(units)
    if again is not None:
        acts.bwd_again = fold_chunk(units[:-1] + [(saved - h, saved - h, fwd, again + h, rows)]).bwd_extra
    per_op = per_op_bytes(units)
    diff = untraced_difference(cache, moe_flags, first, last, recv_input)
    if diff is not None:
        name, ds, df, db = diff
        again = None if acts.bwd_again is None else max(acts.bwd_again + db, 0.0)
        acts = ChunkActivations(acts.saved + ds, max(acts.fwd_extra + df, acts.saved + ds),
                                max(acts.bwd_extra + db, 0.0), again)
        per_op[name] = {"saved": ds, "fwd_peak": max(df, 0.0), "bwd_peak": max(db, 0.0), "count": 1}
    return acts, per_op


# Switches that pick a kernel inside an unchanged op structure (a fused or unfused path): a set that traced one
# value answers another from it, and the modelled set says what the other changes. (A structural switch -- TP,
# SP, MoE, the spec, the attention backend -- changes the ops themselves: no difference carries over.)
KERNEL_SWITCHES = ("fuse_act", "fuse_softmax", "fuse_rope", "dropout_mask", "fuse_bda", "fuse_ce")


def untraced_switches(cache) -> dict:
    """The config's kernel switch values that the set never traced, where it traced exactly one value of that
    switch (so every segment it answered came from that value): {switch: (config's value, traced value)}. The
    values compose.untraced_features reads (no mask without dropout)."""
    seen = cache.fset.seen_switch_values() if cache.fset.composed else {}
    sw = cache.sw
    return {k: (sw[k], next(iter(seen[k]))) for k in KERNEL_SWITCHES
            if k in sw and len(seen.get(k, ())) == 1 and sw[k] not in seen[k]
            and not (k == "dropout_mask" and not sw.get("dropout"))}


def untraced_difference(cache, moe_flags, first: bool, last: bool, recv_input: bool):
    """(row name, saved, forward, backward) to add to a chunk of a fitted set for kernel switch values the set never
    traced (untraced_switches), so such a feature still changes the estimate (modelled, and said so): per switch,
    the modelled set's chunk with the config's value against the same chunk with the traced one. Saved bytes move
    by the chunk's difference; each transient by the larger of the chunk's difference and the largest difference of
    one op's transient (the op may not set the chunk's peak in the modelled set and still set it here: errs high).
    None where no switch makes a difference."""
    key = ("untraced difference", tuple(moe_flags), first, last, recv_input)
    hit = cache._values.get(key, False)
    if hit is not False:
        return hit
    hit = None
    if cache.fset.kind != "modelled":
        total, names = [0.0, 0.0, 0.0], []
        for k, (value, traced) in sorted(untraced_switches(cache).items()):
            diff = _modelled_difference(cache.cfg, {k: value}, {k: traced}, moe_flags, first, last, recv_input)
            if any(diff):
                names.append(f"{k}={value}")
                total = [x + y for x, y in zip(total, diff)]
        if names:
            cache.modelled_difference.update(names)
            hit = ("untraced " + ", ".join(names) + " (modelled difference)", *total)
    cache._values[key] = hit
    return hit


def _modelled_difference(cfg, config_sw: dict, traced_sw: dict, moe_flags, first, last, recv_input) -> tuple:
    model = F.load("modelled")
    acts, ops = [], []
    for values in (config_sw, traced_sw):
        lc = LayerCache(model, cfg)
        lc.sw = dict(lc.sw, **values)
        units = chunk_units(lc, moe_flags, first, last, recv_input)[0]
        acts.append(fold_chunk(units))
        ops.append(per_op_bytes(units))
    (a, b), (pa, pb) = acts, ops
    zero = {"fwd_peak": 0.0, "bwd_peak": 0.0}
    op_f = max((row["fwd_peak"] - pb.get(op, zero)["fwd_peak"] for op, row in pa.items()), default=0.0)
    op_b = max((row["bwd_peak"] - pb.get(op, zero)["bwd_peak"] for op, row in pa.items()), default=0.0)
    return a.saved - b.saved, max(a.fwd_extra - b.fwd_extra, op_f), max(a.bwd_extra - b.bwd_extra, op_b)


def chunk_activations(cache: LayerCache, moe_flags: Sequence[bool], first: bool, last: bool,
                      recv_input: bool) -> Tuple["ChunkActivations", Dict[str, Dict[str, float]]]:
    """(ChunkActivations, per-op bytes) of one chunk. moe_flags: per layer of the chunk. first/last: holds
    embedding / loss head. recv_input: the chunk's input arrives by p2p (held until its backward).
    A chunk is folded from units (kept, full, fwd, bwd, rows): one layer, a full-recompute checkpoint group, or a
    non-layer op (module docstring; `full` = bytes live during its backward, `bwd` = transient above the level
    before its backward - kept + full). Equal units are one shared tuple, built once per (set, config)."""
    if not isinstance(cache, LayerCache):
        return _composed_chunk(cache, moe_flags, first, last, recv_input)
    units, _, layer_kept = chunk_units(cache, moe_flags, first, last, recv_input)
    # Pipeline p2p tensors that outlive their step (sent input gradients, the chunk's last input kept by
    # set_input_tensor, interleaved sends after the pair's backward) depend on the schedule: schedule.p2p_counts.
    acts = fold_chunk(units)
    saved, fwd = transforms.relieved(cache.cfg, layer_kept, acts.saved, acts.fwd_extra)
    if saved != acts.saved:
        acts = ChunkActivations(saved, fwd, acts.bwd_extra)
    return acts, per_op_bytes(units)


def chunk_units(cache: LayerCache, moe_flags: Sequence[bool], first: bool, last: bool,
                recv_input: bool) -> Tuple[list, list, list]:
    """(units, kinds, each layer unit's kept bytes before the sent-output adjustment) of a chunk in forward order
    (chunk_activations folds them; estimator.alloc_stream turns them into tensors). kinds[i]: ("recv",), ("model",), ("layer", held) or ("ckpt", held), and for the last layer
    unit of a stage that sends its output ("layer" | "ckpt", held, sent): held = what the backward holds from
    before it (LayerCache.held_bwd), sent = what the sent output adds back to the backward."""
    hidden = cache.hidden
    units, kinds, layer_kept = [], [], []
    if recv_input:
        units.append(cache.recv_unit)
        kinds.append(("recv",))
    data = cache.data_ops(first, last)
    if data:
        units.append(cache.model_unit(data))
        kinds.append(("model",))
    if first:
        units.append(cache.model_unit(FIRST_OPS))
        kinds.append(("model",))
    groups = recomputed_groups(cache.cfg, len(moe_flags))
    memo = cache.units
    u = None
    sent = 0.0
    for lo, hi, ckpt in groups:
        key = (tuple(moe_flags[lo:hi]), ckpt, first, last)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _group_unit(cache, key)
        u, sent, _ = hit
        units.append(u)
        layer_kept.append(u[0])
        kinds.append(("ckpt" if ckpt else "layer", hit[2]))
    if not last and u is not None:
        # The stage output is sent and pseudo-freed (deallocate_pipeline_outputs); nothing on this rank saves it.
        # A per-point backward peak is measured above the level with the layer's output counted (its consumer's
        # backward frees it first, so it is counted as freed there): the bytes taken off `full` are added back.
        kept, full, fwd, bwd, rows = u
        units[-1] = (kept - hidden, full - hidden, fwd, bwd + sent, rows)
        kinds[-1] = kinds[-1] + (sent,)
    if last:
        units.append(cache.model_unit(LAST_OPS))
        kinds.append(("model",))
    return units, kinds, layer_kept


def _group_unit(cache: LayerCache, key) -> Tuple[tuple, float, float]:
    """(unit, bytes the stage's sent output adds to its backward, bytes its backward holds from before it) for one
    layer or checkpoint group."""
    kinds_moe, ckpt, first, last = key
    sel = "selective" if cache.sw["recompute"] == "selective" else "none"
    rec = "none" if ckpt else sel
    if len(kinds_moe) == 1:
        rows = cache.layer_rows(kinds_moe[0], rec)  # shared list: folded once per kind
    else:
        rows = [r for m in kinds_moe for r in cache.layer_rows(m, "none")]
    s, f, b = _fold(rows)
    held, sent = cache.held_bwd([(m, rec) for m in kinds_moe], first, last)
    if ckpt:
        # Forward runs without saving; backward re-runs it: its saved bytes come back on top of the input.
        h = cache.hidden
        return (h, s + h, max(f, h), b + held, rows), sent, held
    return (s, s, f, b + held, rows), sent, held


@dataclass
class ChunkActivations:
    saved: float       # bytes kept per in-flight microbatch
    fwd_extra: float   # peak above entry level during the forward
    bwd_extra: float   # peak above (entry level + saved) during the backward
    # the same for a backward that follows the chunk's previous backward with no forward of the chunk between
    # (compose.chunk_body: MoE full recompute leaves tensors until the layer's next forward); None: bwd_extra
    bwd_again: Optional[float] = None


def with_backward_extra(c: ChunkActivations, extra: float) -> ChunkActivations:
    """The chunk with `extra` bytes more on top of each of its backwards (a buffer its backward holds)."""
    return ChunkActivations(c.saved, c.fwd_extra, c.bwd_extra + extra,
                            None if c.bwd_again is None else c.bwd_again + extra)


def fold_chunk(units: Sequence[tuple]) -> ChunkActivations:
    """Units (kept, full, fwd, bwd, rows) run in order forward, in reverse backward."""
    cum = fwd = 0.0
    for u in units:
        fwd = max(fwd, cum + u[2])
        cum += u[0]
    saved = cum
    bwd = 0.0
    before = saved
    for kept, full, _, b, _ in reversed(units):
        before -= kept
        bwd = max(bwd, before + full + b - saved)
    return ChunkActivations(saved, max(fwd, saved), max(bwd, 0.0))


def per_op_bytes(units: Sequence[tuple]) -> Dict[str, Dict[str, float]]:
    """Op -> summed saved / max fwd / max bwd bytes per microbatch over the chunk (for the model tree)."""
    counts: Dict[int, Any] = {}
    for u in units:  # identical layers share one rows list: aggregate by list, then by op
        rows = u[4]
        c = counts.get(id(rows))
        if c is None:
            counts[id(rows)] = [rows, 1]
        else:
            c[1] += 1
    out: Dict[str, Dict[str, float]] = {}
    for rows, n in counts.values():
        for op, s, f, b in rows:
            d = out.get(op)
            if d is None:
                # The same arithmetic as accumulating onto zeros (0.0 + x turns -0.0 and ints into what += gives).
                out[op] = {"saved": 0.0 + s * n, "fwd_peak": max(0.0, f), "bwd_peak": max(0.0, b), "count": n}
            else:
                d["saved"] += s * n
                d["fwd_peak"] = max(d["fwd_peak"], f)
                d["bwd_peak"] = max(d["bwd_peak"], b)
                d["count"] += n
    return out
