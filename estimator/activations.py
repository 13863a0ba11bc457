"""Activation bytes per model chunk and microbatch from a formula set (recompute-aware).

A chunk is what one forward/backward of the schedule runs on one rank: a run of transformer layers plus, where it
holds them, the embedding (first chunk of stage 0) or final norm, output layer and loss (last chunk of the last
stage). It is summarised as `saved` (bytes kept per in-flight microbatch), `fwd_extra` (transient above the level
at chunk entry during its forward) and `bwd_extra` (transient above the level with all its saved bytes live).
"""
from __future__ import annotations

from estimator._record import dataclass, field

from . import formulas as F

ATTN_OPS = ("layers.*.input_layernorm", "layers.*.self_attention.linear_qkv",
            "layers.*.self_attention.core_attention", "layers.*.self_attention.linear_proj",
            "layers.*.self_attention")
DENSE_MLP_OPS = ("layers.*.pre_mlp_layernorm", "layers.*.mlp.linear_fc1", "layers.*.mlp", "layers.*.mlp.linear_fc2")
MOE_MLP_OPS = ("layers.*.pre_mlp_layernorm", "layers.*.mlp.router", "layers.*.mlp", "layers.*.mlp.experts",
               "layers.*.mlp.shared_experts")
LAYER_OP = "layers.*"
FIRST_OPS = ("embedding",)
LAST_OPS = ("final_layernorm", "output_layer", "loss")


@dataclass
class Unit:
    """A forward/backward unit: one layer, a full-recompute checkpoint group, or a non-layer op."""
    name: str
    kept: float        # saved bytes held after the forward
    full: float        # bytes live during its backward (re-materialised when recomputed)
    fwd: float         # forward transient above entry level (includes its own saved growth)
    bwd: float         # backward transient above (level before the unit's backward - kept + full)
    ops: List[Tuple[str, float, float, float]] = field(default_factory=list)  # (op, saved, fwd, bwd) per op


HELD_OP = "backward_held"


def _determined(fset, fo, quantity: str) -> bool:
    """Whether the set's own formula behind `fo` gives `quantity` (not null, so not taken from a fallback)."""
    key = ("determined", fo.op, fo.when, quantity)
    hit = fset._cache.get(key)
    if hit is None:
        own = next((x for x in fset.formulas if x.op == fo.op and x.when == fo.when), None)
        hit = fset._cache[key] = own is not None and getattr(own, quantity) is not None
    return hit


def _op_rows(fset, ops, sw, env):
    rows = []
    for op in ops:
        fo = F.select(fset, op, sw)
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
        self.sw = F.switches(cfg)
        self._cache: Dict[Tuple[bool, str], List[Tuple[str, float, float, float]]] = {}
        self.folds: Dict[int, Any] = {}
        e, s, b, h, st = (self.env[k] for k in ("e", "s", "b", "h", "st"))
        self.hidden = e * s * b * h / st  # one sequence-sharded hidden state: pp recv input, checkpoint input
        # Layer backward peaks measured per point (FORMATS 4) exclude what the head's backward leaves live through
        # the decoder (the hidden-state gradient, a tied embedding's weight gradient, loss scalars): the set's
        # `backward_held`, None where it does not determine it.
        fo = F.select(fset, HELD_OP, self.sw)
        self.held = fo.evaluate(self.env)[2] if fo is not None and _determined(fset, fo, "bwd_peak") else None
        self.bwd_points: Dict[Tuple[bool, str], bool] = {}

    def layer_rows(self, moe: bool, recompute: str):
        key = (moe, recompute)
        if key not in self._cache:
            sw, ops = self._query(key)
            self._cache[key] = _op_rows(self.fset, ops, sw, self.env)
            fo = F.select(self.fset, LAYER_OP, sw)
            self.bwd_points[key] = fo is not None and any(
                pf.bwd_peak for pf in F.point_formulas(self.fset, LAYER_OP, fo.when))
        return self._cache[key]

    def _query(self, key) -> Tuple[Dict[str, Any], Tuple[str, ...]]:
        """(switches, ops) behind a row-cache key: (moe, recompute) for a layer, (None, ops) for model ops."""
        if key[0] is None:
            return self.sw, key[1]
        moe, recompute = key
        ops = ATTN_OPS + (MOE_MLP_OPS if moe else DENSE_MLP_OPS) + (LAYER_OP,)
        return dict(self.sw, moe=moe, recompute=recompute), ops

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
        """(op, quantity) pairs this config's evaluated rows took from the fallback set."""
        out = set()
        for key in self._cache:
            sw, ops = self._query(key)
            for op in ops:
                out.update(F.fallbacks_used(self.fset, op, sw))
        out.update(F.fallbacks_used(self.fset, HELD_OP, self.sw))
        return out

    def model_rows(self, ops):
        key = (None, ops)
        if key not in self._cache:
            self._cache[key] = _op_rows(self.fset, ops, self.sw, self.env)
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


def chunk_units(cache: LayerCache, moe_flags: Sequence[bool], first: bool, last: bool,
                recv_input: bool) -> List[Unit]:
    """Units of one chunk. moe_flags: per layer of the chunk. first/last: holds embedding / loss head.
    recv_input: the chunk's input arrives by p2p (held until its backward)."""
    sel = "selective" if cache.sw["recompute"] == "selective" else "none"
    units: List[Unit] = []
    if recv_input:
        units.append(Unit("pp_recv", cache.hidden, cache.hidden, cache.hidden, 0.0, [("pp_recv", cache.hidden, cache.hidden, 0.0)]))
    if first:
        rows = cache.model_rows(FIRST_OPS)
        s, f, b = _fold(rows)
        units.append(Unit("embedding", s, s, f, b, rows))
    sent = 0.0
    for lo, hi, ckpt in recomputed_groups(cache.cfg, len(moe_flags)):
        if hi - lo == 1:
            rows = cache.layer_rows(moe_flags[lo], "none" if ckpt else sel)  # shared list: fold once per kind
        else:
            rows = [r for i in range(lo, hi) for r in cache.layer_rows(moe_flags[i], "none")]
        key = id(rows)
        if key not in cache.folds:
            cache.folds[key] = (_fold(rows), rows)
        s, f, b = cache.folds[key][0]
        held, sent = cache.held_bwd([(moe_flags[i], "none" if ckpt else sel) for i in range(lo, hi)], first, last)
        if ckpt:
            # Forward runs without saving; backward re-runs it: its saved bytes come back on top of the input.
            units.append(Unit(f"layers[{lo}:{hi}]*", cache.hidden, s + cache.hidden, max(f, cache.hidden),
                              b + held, rows))
        else:
            units.append(Unit(f"layers[{lo}]", s, s, f, b + held, rows))
    if not last and units and units[-1].name.startswith("layers"):
        # The stage output is sent and pseudo-freed (deallocate_pipeline_outputs); nothing on this rank saves it.
        # A per-point backward peak is measured above the level with the layer's output counted (its consumer's
        # backward frees it first, so it is counted as freed there): the bytes taken off `full` are added back.
        u = units[-1]
        units[-1] = Unit(u.name, u.kept - cache.hidden, u.full - cache.hidden, u.fwd, u.bwd + sent, u.ops)
    if last:
        rows = cache.model_rows(LAST_OPS)
        s, f, b = _fold(rows)
        units.append(Unit("head", s, s, f, b, rows))
    # Pipeline p2p tensors that outlive their step (sent input gradients, the chunk's last input kept by
    # set_input_tensor, interleaved sends after the pair's backward) depend on the schedule: schedule.p2p_counts.
    return units


@dataclass
class ChunkActivations:
    saved: float       # bytes kept per in-flight microbatch
    fwd_extra: float   # peak above entry level during the forward
    bwd_extra: float   # peak above (entry level + saved) during the backward
    units: List[Unit]


def fold_chunk(units: Sequence[Unit]) -> ChunkActivations:
    cum = fwd = 0.0
    for u in units:
        fwd = max(fwd, cum + u.fwd)
        cum += u.kept
    saved = cum
    bwd = 0.0
    before = saved
    for u in reversed(units):
        before -= u.kept
        bwd = max(bwd, before + u.full + u.bwd - saved)
    return ChunkActivations(saved, max(fwd, saved), max(bwd, 0.0), list(units))


def per_op_bytes(units: Sequence[Unit]) -> Dict[str, Dict[str, float]]:
    """Op -> summed saved / max fwd / max bwd bytes per microbatch over the chunk (for the model tree)."""
    out: Dict[str, Dict[str, float]] = {}
    counts: Dict[int, Any] = {}
    for u in units:  # identical layers share one rows list: aggregate by list, then by op
        c = counts.setdefault(id(u.ops), [u.ops, 0])
        c[1] += 1
    for rows, n in counts.values():
        for op, s, f, b in rows:
            d = out.setdefault(op, {"saved": 0.0, "fwd_peak": 0.0, "bwd_peak": 0.0, "count": 0})
            d["saved"] += s * n
            d["fwd_peak"] = max(d["fwd_peak"], f)
            d["bwd_peak"] = max(d["bwd_peak"], b)
            d["count"] += n
    return out
