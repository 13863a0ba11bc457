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


def _op_rows(fset, ops, sw, env):
    rows = []
    for op in ops:
        fo = F.select(fset, op, sw)
        rows.append((op, *(fo.evaluate(env) if fo else (0.0, 0.0, 0.0))))
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

    def layer_rows(self, moe: bool, recompute: str):
        key = (moe, recompute)
        if key not in self._cache:
            sw = dict(self.sw, moe=moe, recompute=recompute)
            ops = ATTN_OPS + (MOE_MLP_OPS if moe else DENSE_MLP_OPS) + (LAYER_OP,)
            self._cache[key] = _op_rows(self.fset, ops, sw, self.env)
        return self._cache[key]

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
    for lo, hi, ckpt in recomputed_groups(cache.cfg, len(moe_flags)):
        if hi - lo == 1:
            rows = cache.layer_rows(moe_flags[lo], "none" if ckpt else sel)  # shared list: fold once per kind
        else:
            rows = [r for i in range(lo, hi) for r in cache.layer_rows(moe_flags[i], "none")]
        key = id(rows)
        if key not in cache.folds:
            cache.folds[key] = (_fold(rows), rows)
        s, f, b = cache.folds[key][0]
        if ckpt:
            # Forward runs without saving; backward re-runs it: its saved bytes come back on top of the input.
            units.append(Unit(f"layers[{lo}:{hi}]*", cache.hidden, s + cache.hidden, max(f, cache.hidden), b, rows))
        else:
            units.append(Unit(f"layers[{lo}]", s, s, f, b, rows))
    if not last and units and units[-1].name.startswith("layers"):
        # The stage output is sent and pseudo-freed (deallocate_pipeline_outputs); nothing on this rank saves it.
        u = units[-1]
        units[-1] = Unit(u.name, u.kept - cache.hidden, u.full - cache.hidden, u.fwd, u.bwd, u.ops)
    if last:
        rows = cache.model_rows(LAST_OPS)
        s, f, b = _fold(rows)
        units.append(Unit("head", s, s, f, b, rows))
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
