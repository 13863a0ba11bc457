"""Activations of a chunk composed from per-segment formulas (a composed formula set, FORMATS 4.1).

A chunk's forward is a flat sequence of segments, the measured op structure walked in order: an op with children
C1..Cn runs its own code `<op>`, then C1's segments, its own code `<op>@C1`, ... (the root `step` holds the input
batch, the embedding, the decoder, the output layer and the loss as its stage holds them; the decoder repeats
`layers.*` once per layer of the chunk). Its backward is the same sequence reversed, each segment with its backward
quantities. Replaying the deltas and peaks gives the chunk's saved bytes and its forward and backward transients, the
way the traced runs reached theirs; each segment's formula depends only on the switches that change it, so a config
whose combination of switches was never traced is composed from segments measured in other combinations.

Recompute is composed too, never fitted per mode: a full-recompute group and, under selective recompute, core
attention (megatron-core's default `recompute_modules`) are checkpoints over the plain segments, which keep only
their output across the forward and hold their inputs until their backward, where they re-run their forward.

Where a label has no formula measured for the config's switch values it is *extrapolated*: each quantity takes the
largest value among the label's determined formulas nearest the config's switches (fewest differing `when` values),
and the report says which labels and what share of the saved bytes that is (`coverage`).
"""
from __future__ import annotations

from collections import ChainMap

from . import formulas as F
from .formulas import STRUCTURE_SWITCHES
from . import moe_tokens, transforms
from .args import field_reader, moe_layer_pattern, recompute_modules
from .model import MTP_LAYER

ROOT = "step"
FIRST_ONLY = ("data.tokens", "embedding")
# Multi-token prediction (the loss's stage): its layers, each the model's embedding of the shifted tokens, two
# norms, a projection, a transformer layer of the decoder's last layer's spec (walked with the decoder layer's
# programs: it allocates as a decoder layer does, tests/test_mtp.py) and a norm; then its loss head (the model's
# output layer and loss, called before the main ones: ops of their own, tracer.scopes._call_name).
MTP = "mtp"
MTP_LAYERS = "mtp.layers.*"
MTP_HEAD = ("mtp_head.output_layer", "mtp_head.loss")
LAST_ONLY = ("data.labels", "output_layer", "loss", "final_layernorm", MTP) + MTP_HEAD
LAYER = "layers.*"
EXPERT = ".local_experts.*"
# Selective recompute (recompute_modules ["core_attn"], megatron-core's default) checkpoints this op: it is composed
# like a full-recompute group, from the plain segments, keeping only its output (the context) across the forward.
SELECTIVE_OP = "layers.*.self_attention.core_attention"


def own_label(op: str, child: str) -> str:
    """Label of op's own code right after child `child` (FORMATS 3.1): `layers.*.mlp@linear_fc1`."""
    return f"{op}@{child[len(op) + 1:] if child.startswith(op + '.') else child}"


class ComposedCache:
    """Per-(set, config) evaluation of a composed set: segment values per (label, switches), memoised."""

    def __init__(self, fset: F.FormulaSet, cfg):
        self.fset, self.cfg = fset, cfg
        self.env = F.variables(cfg)
        # Full and selective recompute are composed from the plain layer's segments (checkpoint groups in
        # `sequence`), so a layer's segments are always those measured without recompute.
        self.sw = dict(F.switches(cfg, self.env))
        # selective recompute's modules (megatron-core's recompute_modules; core attention by default)
        self.recompute_modules = recompute_modules(cfg)
        self.selective = "core_attn" in self.recompute_modules
        self.sw["recompute"] = "none"
        e, s, b, h, st = (self.env[k] for k in ("e", "s", "b", "h", "st"))
        self.hidden = e * s * b * h / st
        # core attention's output under TP: s x b x (a/t) x d (not sequence-parallel: attention sees the whole s)
        self.context = e * s * b * self.env["a"] * self.env["d"] / self.env["t"]
        # Under rope, a query that SelfAttention had to copy (megatron-core reshapes [s, b, g, a/g * d] into
        # [s, b, a, d]: a copy when a rank has more than one group and more than one head per group) stays alive
        # until the attention returns, but the checkpoint holds the rotated query, not that copy.
        a_p, g_p = F.rank_heads(self.env)
        self.query_copy = self.context if self.sw["position"] == "rope" and self.sw["qcopy"] else 0.0
        # The checkpoint holds its inputs through its whole backward. Under rope with as many groups as heads, the
        # value is the one input that is a view of the projection output (query and key are rotated copies), and
        # the plain unfused backward frees that output with the value, after its first product; the checkpoint
        # keeps it. (A flash kernel's backward is one node that frees all three at its end, as the checkpoint does.)
        self.value_hold = e * s * b * (self.env["a"] + 2 * self.env["g"]) * self.env["d"] / self.env["t"] \
            if self.sw["position"] == "rope" and g_p == a_p and self.sw["attention"] == "unfused" else 0.0
        if self.sw.get("mla"):
            # Multi-latent attention: the context has the value heads' width; the query and key are new tensors
            # (rotary and plain parts concatenated) and the value a view of the key-value up projection's output,
            # which the unfused backward frees with it (composed: no traced run recomputed MLA's core attention)
            v = self.env
            self.context = e * s * b * v["a"] * v["dv"] / v["t"]
            self.query_copy = 0.0
            self.value_hold = e * s * b * v["a"] * (v["dq"] + v["dv"]) / v["t"] \
                if self.sw["attention"] == "unfused" else 0.0
        self.local_experts = max(1, int(self.env["E"] // max(1, self.env["ep"])))
        # an MTP layer repeats the decoder's last layer's spec: an MoE layer where that one is
        self._mtp_moe = bool(moe_layer_pattern(cfg)[-1])
        get = field_reader(cfg)
        self._mtp_checkpointed = get("recompute_granularity") == "full" and \
            (get("recompute_method") or "uniform") == "uniform"   # ('block': not checkpointed)
        self.routing = moe_tokens.routing(cfg)
        h = self.hidden
        self.recv_unit = (h, h, h, 0.0, [("pp_recv", h, h, 0.0)])   # a pipeline chunk's received input
        self._values: dict = {}
        self._parts: dict = {}   # id(values) -> (values, each quantity's terms where measured, env): parts()
        self._by_label: dict = {}
        for sf in fset.segments:
            self._by_label.setdefault(sf.label, []).append(sf)
        for lst in self._by_label.values():
            lst.sort(key=lambda sf: -len(sf.when))
        self._first_chunk = False     # the chunk being walked holds the embedding (sequence's `first`)
        self._layers: dict = {}       # (MoE, the model's first layer) -> (a layer's items, its index): _layer
        self.saved_measured = 0.0
        self.saved_extrapolated = 0.0
        self.saved_modelled = 0.0     # bytes of the rows registered transforms add (estimator.transforms)
        self._transform_rows: dict = {}
        self.modelled_difference: set = set()   # untraced kernel switch values the modelled set's difference covers
        self.extrapolated: set = set()
        self.modelled: set = set()     # the transforms' rows with bytes in this estimate (modelled, not measured)
        self.untraced = untraced_features(cfg, self.sw, fset)   # after mapping recompute to its plain layer

    def fallbacks(self) -> set:
        return set()   # a composed set never takes a number from the modelled set

    def coverage(self) -> dict:
        total = self.saved_measured + self.saved_extrapolated + self.saved_modelled
        share = 1.0 if total <= 0 else self.saved_measured / total
        if self.untraced:
            share = 0.0
        return {"measured_share": share, "extrapolated": sorted(self.extrapolated), "untraced": self.untraced,
                "modelled_difference": sorted(self.modelled_difference), "modelled": sorted(self.modelled),
                "standins": [] if self.fset.measured_on_gpu else standin_families(self.sw, self.untraced)}

    # ---- values
    def values(self, label: str, sw: dict, tokens: float = 1.0, first: bool = False,
               instance: str | None = None) -> tuple:
        """(fwd_delta, fwd_peak, bwd_delta, bwd_peak, measured) of a label under switches sw; `tokens`: the factor
        on its routed tokens (estimator.moe_tokens), applied to k; `first`: at the model's first layer (a program
        set may hold that layer's own programs; a composed set has none); `instance`: "first" | "last" of a label's
        repeated instances (likewise)."""
        key = (label, sw["moe"], sw["recompute"], tokens, first, instance)
        hit = self._values.get(key)
        if hit is None:
            hit = self._values[key] = self._evaluate(label, sw, tokens, first, instance)
        return hit

    def _evaluate(self, label: str, sw: dict, tokens: float = 1.0, first: bool = False,
                  instance: str | None = None) -> tuple:
        """Each quantity from the label's most specific entry that gives it and matches sw, measured where the
        entry's runs had the config's switch values; else extrapolated: the largest value among the determined
        entries nearest the config's switches (fewest `when` values differing from it)."""
        vals, measured = [], True
        terms: list = [None] * 4
        env = ChainMap(F.indicators(sw), self.env)     # a layer's own switches (dense / MoE, recompute)
        if tokens != 1.0:
            env = ChainMap({"k": self.env["k"] * tokens}, env)
        for i in range(4):
            have = [sf for sf in self._by_label.get(label, []) if sf.quantities[i] is not F.NOT_GIVEN]
            if not have:    # the label never has this phase: no bytes
                vals.append(0.0)
                continue
            match = _answering(have, i, sw)
            if match is not None:
                vals.append(_sum(match.quantities[i], env))
                terms[i] = match.quantities[i]
                measured = measured and match.measured_for(i, sw)
                continue
            measured = False
            have = [sf for sf in have if sf.quantities[i] is not None]
            if not have:
                vals.append(0.0)
                continue
            dist = [sum(sw.get(k) != v for k, v in sf.when) for sf in have]
            near = min(dist)
            vals.append(max(_sum(sf.quantities[i], env) for sf, d in zip(have, dist) if d == near))
        out = (*vals, measured)
        self._parts[id(out)] = (out, terms, env)   # evaluated by parts(), which only the reserved model asks
        return out

    def events(self, values: tuple):
        """A segment's allocation events (program sets: estimator.program_cache); a composed set has none."""
        return None

    def parts(self, values: tuple) -> tuple:
        """Each of a segment's four quantities (`values` as sequence() items hold them) as tensor sizes taken from
        its formula's terms (term_tensors; negative terms included), or None where the quantity was extrapolated
        (estimator.alloc_stream turns them into an allocation stream)."""
        hit = self._parts.get(id(values))
        if hit is None or hit[0] is not values:
            return (None,) * 4
        if len(hit) == 3:   # first ask: evaluate once
            hit = self._parts[id(values)] = (values, tuple(term_tensors(q, hit[2]) if q else None for q in hit[1]))
        return hit[1]

    def children(self, op: str, sw: dict) -> tuple:
        """op's children under switches sw; where no traced run had sw's values of the switches that change them,
        those of the nearest entry (fewest differing values), reported as extrapolated."""
        entries = _structure(self.fset, op)
        for name, when, kids in entries:
            if all(sw.get(k) == v for k, v in when):
                return kids
        if not entries:
            return ()
        self.extrapolated.add(f"{op} (children)")
        return min(entries, key=lambda e: sum(sw.get(k) != v for k, v in e[1]))[2]

    def transform_items(self, moe: bool, layer) -> list:
        """The segments registered transforms add to a layer (estimator.transforms), at its end: saved until its
        backward, which frees them."""
        rows = self._transform_rows.get(moe)
        if rows is None:
            rows = self._transform_rows[moe] = [
                (op, (s, max(f, s), -s, b, False)) for op, s, f, b in
                transforms.layer_rows(self.cfg, self.env, moe, self.fset.kind == "modelled", self.fset.measures)]
        return [(op, values, op, layer) for op, values in rows]

    # ---- sequence
    def sequence(self, moe_flags, first: bool, last: bool) -> list:
        """The chunk's forward as items: (label, values, op, instance) for a segment, ("run", [items][, grad,
        after]) for a layer (holding `grad` more in its backward once `after` of its segments ran), or ("ckpt",
        [items], kept, freed, grad, after[, retains, received]) for a checkpoint (a full-recompute group, or core
        attention under selective recompute) keeping `kept` bytes across the forward, holding `grad` more in its
        backward once `after` of its segments ran (its output's gradient, which the plain segments free there) and
        freeing `freed` after it; a group with an MoE layer (`retains`) keeps its input and returns a gradient
        that stays too, and a group whose output's gradient came by p2p (`received`) leaves that to the chunk."""
        from .activations import recomputed_groups
        out: list = []
        self._first_chunk = first
        self._mtp_at = len(moe_flags)   # MTP layers are numbered after the chunk's decoder layers
        # (under MTP the loss's stage reads the tokens too: its embedding of the shifted tokens)
        root_kids = [c for c in self._with_mtp(self.children(ROOT, self.sw))
                     if (first or c not in FIRST_ONLY or last and c == "data.tokens" and self.env["D"])
                     and (last or c not in LAST_ONLY)]
        self._own(ROOT, None, self.sw, out)
        for c in root_kids:
            if c == "decoder":
                self._decoder(moe_flags, last, recomputed_groups(self.cfg, len(moe_flags)), out)
            else:
                self._expand(c, None, self.sw, out)
            self._own(own_label(ROOT, c), None, self.sw, out, op=ROOT)
        return out

    def _with_mtp(self, kids) -> list:
        """The root's children under MTP: the block and its loss head after the decoder, as its runs had them
        (from a structure of runs without MTP, put there and said extrapolated)."""
        if not self.env["D"] or MTP in kids:
            return kids
        self.extrapolated.add(f"{ROOT} (children)")
        at = kids.index("decoder") + 1 if "decoder" in kids else len(kids)
        return list(kids[:at]) + [MTP, *MTP_HEAD] + list(kids[at:])

    def _mtp_expand(self, layer: int, sw: dict, out: list) -> None:
        """An MTP layer. Under uniform full recompute megatron-core checkpoints all of it after its embedding (the
        norms, the projection, the transformer layer, the final norm: MultiTokenPredictionLayer._checkpointed_forward)
        as a decoder group of one layer: keeping its output across the forward, re-run in its backward."""
        items: list = []
        self._expand(MTP_LAYERS, layer, sw, items)
        start = next((i for i, it in enumerate(items) if it[0] == MTP_LAYERS + ".enorm"), None)
        if not self._mtp_checkpointed or start is None:
            out += items
            return
        group = items[start:]
        out += items[:start]
        out.append(("ckpt", group, self.hidden, self.hidden, self.hidden, _after_mlp(group), self._mtp_moe, False))

    def _mtp_layer(self, layer: int, out: list) -> None:
        """An MTP layer's transformer layer: the decoder's last layer's kind, walked as a decoder layer."""
        moe = bool(self._mtp_moe)
        self._expand(LAYER, layer, dict(self.sw, moe=moe), out)
        out += self.transform_items(moe, layer)

    def _decoder(self, moe_flags, last: bool, groups, out: list) -> None:
        self._own("decoder", None, self.sw, out)
        for lo, hi, ckpt in groups:
            items: list = []
            for i in range(lo, hi):
                items += self._layer(bool(moe_flags[i]), i)
            if ckpt:
                # An MoE layer's recomputed graph outlives the checkpoint's backward (the token dispatcher keeps
                # its routing probabilities, which reach back to the group's detached input): the group's input
                # and that input's gradient stay allocated until the layer next runs forward (chunk_body).
                # A chunk before the model's last keeps the gradient it received for its output (below) to its
                # backward's end: the last group's output gradient is not the group's to free.
                retains = any(moe_flags[lo:hi])
                received = not last and hi == len(moe_flags)
                out.append(("ckpt", items, self.hidden, self.hidden, self.hidden, _after_mlp(items), retains,
                            received))
            elif not last and hi == len(moe_flags):
                # A chunk before the model's last receives its output's gradient by p2p and the schedule keeps
                # that tensor until the chunk's backward ends: the last layer adds its norm's input gradient into
                # a new tensor (where the measured runs' autograd reuses the buffer), one more hidden state from
                # its MLP's backward on. (A checkpoint holds its output's gradient the same way, above.)
                out.append(("run", items, self.hidden, _after_mlp(items)))
            else:
                out.append(("run", items))
        if last:
            for c in self.children("decoder", self.sw):
                if c != LAYER:
                    self._expand(c, None, self.sw, out)
                    self._own(own_label("decoder", c), None, self.sw, out, op="decoder")

    def _layer(self, moe: bool, i: int) -> list:
        """Layer i's items: the walk of a dense or MoE layer is the same for every layer but the model's first (its
        own programs), so it is made once per kind and copied with the layer's index (a chunk walks every layer)."""
        key = (moe, self._first_chunk and i == 0)
        hit = self._layers.get(key)
        if hit is None:
            items: list = []
            self._expand(LAYER, i, dict(self.sw, moe=moe), items)
            self._own(own_label("decoder", LAYER), None, self.sw, items, op="decoder", first=key[1])
            items += self.transform_items(moe, i)
            hit = self._layers[key] = (items, i)
        items, made = hit
        return items if made == i else _renumbered(items, made, i)

    def _expand(self, op: str, layer, sw: dict, out: list, expert: float | None = None,
                instance: str | None = None) -> None:
        """instance: "first" | "last" of a repeated child (a SequentialMLP's local experts), passed to its ops."""
        self._own(op, layer, sw, out, expert=expert, instance=instance)
        ckpt_at, deferred = None, 0.0     # where a child's checkpoint sits in `out`, what it holds back
        not_held = 0.0                    # of the frees after it, the bytes the checkpoint does not hold
        for c in self.children(op, sw):
            if c == MTP_LAYER:
                self._mtp_layer(layer, out)
                self._own(own_label(op, c), layer, sw, out, op=op)
                continue
            # A SequentialMLP runs its local experts one after another, each on its share of the tokens; under a
            # routing bound the busiest runs last (on top of the others' saved bytes, first in backward).
            n = self.local_experts if c.endswith(EXPERT) else int(self.env["D"]) if c == MTP_LAYERS else 1
            for i in range(n):
                if c == MTP_LAYERS:
                    self._mtp_expand(self._mtp_at + i, sw, out)
                    self._own(own_label(op, c), layer, sw, out, op=op)
                    continue
                pos = None if n < 2 else "first" if i == 0 else "last" if i == n - 1 else None
                inst = pos or instance
                share = expert
                if c.endswith(EXPERT) and sw["moe"] and self.routing.scales:
                    share = self.routing.busiest if i == n - 1 else self.routing.rest
                checkpointed = self._checkpointed(c, sw)
                if checkpointed and ckpt_at is None:
                    group: list = []
                    self._expand(c, layer, sw, group, share, inst)
                    ckpt_at, ckpt_kind = len(out), checkpointed
                    out.append(("ckpt", group))     # completed below, once the frees it holds back are known
                    # (core attention's parent keeps a copied query that the checkpoint does not hold; after a
                    # module's checkpoint its parent frees the module's output, which the checkpoint made anew)
                    not_held = self.query_copy if checkpointed == "core_attn" else self.hidden
                else:
                    self._expand(c, layer, sw, out, share, inst)
                self._discard(op, c, out)
                start = len(out)
                self._own(own_label(op, c), layer, sw, out, op=op, expert=expert, instance=inst)
                if ckpt_at is not None:
                    held, not_held = _defer_frees(out, start, not_held)
                    deferred += held
        if ckpt_at is None:
            return
        if ckpt_kind == "core_attn":
            out[ckpt_at] += (self.context, self.context + deferred, self.context + self.value_hold, 1)
        else:   # a module's output (one hidden state) kept across the forward, its gradient held in its backward
            out[ckpt_at] += (self.hidden, self.hidden + deferred, self.hidden, 1)

    def _discard(self, op: str, child: str, out: list) -> None:
        """megatron-core's output-discarding recompute (CheckpointWithoutOutput: `layernorm`, `moe_act`): the
        module runs without saving for its backward, and once its consumer `child` has run forward, its output's
        storage is released; its consumer's backward first re-runs it. So what the module's segment kept leaves the
        level right after the consumer's forward and comes back, with the module's forward transient, right before
        the consumer's backward (an item whose backward runs there)."""
        label = _DISCARDED.get((op, child))
        if label is None or _DISCARD_MODULE[label] not in self.recompute_modules:
            return
        kept = next((it for it in reversed(out) if it[0] == label), None)
        if kept is None:
            return      # a norm the spec fuses into the linear after it (Transformer Engine's)
        fd, fp = kept[1][0], kept[1][1]
        if fd > 0:
            out.append((label, (-fd, 0.0, fd, fp, kept[1][4]), label, kept[3]))

    def _checkpointed(self, op: str, sw: dict):
        """The selective recompute module (megatron-core's recompute_modules) that checkpoints op, if any:
        core attention, a dense layer's MLP (`mlp`), an MoE layer's whole MLP (`moe`), its shared experts."""
        modules = self.recompute_modules
        if not modules:
            return None
        if op == SELECTIVE_OP:
            return "core_attn" if "core_attn" in modules else None
        if op == LAYER + ".mlp":
            return "moe" if sw["moe"] and "moe" in modules else "mlp" if not sw["moe"] and "mlp" in modules \
                else None
        if op == LAYER + ".mlp.shared_experts" and "shared_experts" in modules and "moe" not in modules:
            return "shared_experts"
        return None

    def _own(self, label: str, layer, sw: dict, out: list, op: str | None = None,
             expert: float | None = None, first: bool = False, instance: str | None = None) -> None:
        if label not in self._by_label:
            return      # never seen allocating in any traced run: a segment without bytes
        tokens = 1.0
        if sw["moe"] and self.routing.scales and moe_tokens.routed(label):
            # one local expert's segments take its share; the rest of the expert side the rank's
            tokens = expert if expert is not None and moe_tokens.per_expert(label) else self.routing.rank
        first = first or (layer == 0 and self._first_chunk)
        out.append((label, self.values(label, sw, tokens, first, instance), op or label, layer))


# Output-discarding recompute (ComposedCache._discard): (parent op, the child after whose forward the output goes)
# -> the segment whose kept bytes go; and the recompute module that does it.
_DISCARDED = {(LAYER, LAYER + ".self_attention"): LAYER + ".input_layernorm",
              (LAYER, LAYER + ".mlp"): LAYER + ".pre_mlp_layernorm",
              (LAYER + ".mlp.experts", LAYER + ".mlp.experts.linear_fc2"): LAYER + ".mlp.experts@linear_fc1"}
_DISCARD_MODULE = {LAYER + ".input_layernorm": "layernorm", LAYER + ".pre_mlp_layernorm": "layernorm",
                   LAYER + ".mlp.experts@linear_fc1": "moe_act"}


def _renumbered(items: list, old: int, new: int) -> list:
    """A layer's items with layer index `old` made `new` (a checkpoint's group likewise; other indices kept)."""
    out = []
    for it in items:
        if it[0] in ("run", "ckpt"):
            out.append((it[0], _renumbered(it[1], old, new)) + it[2:])
        else:
            out.append(it if it[3] != old else (it[0], it[1], it[2], new))
    return out


def _after_mlp(items: list) -> int:
    """Backward segments of a full-recompute group before its output's gradient is one more tensor than the plain
    backward holds: the last layer's residual branch keeps that gradient as is through its MLP's backward; the
    plain backward then adds the norm's input gradient into it (autograd reuses the buffer), while the checkpoint,
    holding it, makes a new tensor for the sum."""
    for i, it in enumerate(reversed(items)):
        if it[0] == LAYER + ".mlp":
            return i + 1
    return 1


def _defer_frees(out: list, start: int, not_held: float) -> tuple:
    """The checkpoint saves its inputs until its backward: what the parent's own code frees after it (without
    recompute, the inputs nothing else saved, released when the parent returns) is held by the checkpoint instead
    and freed at the end of its backward, except the first `not_held` bytes of those frees (tensors the parent
    keeps that are not the checkpoint's inputs). Takes the held frees out of the segments out[start:]; returns
    (their bytes, what is left of not_held)."""
    held = 0.0
    for j in range(start, len(out)):
        label, (fd, fp, bd, bp, measured), op, layer = out[j]
        if fd < 0:
            keep = min(-fd, not_held)
            not_held -= keep
            held -= fd + keep
            out[j] = (label, (-keep, fp, bd, bp, measured), op, layer)
    return held, not_held


def term_tensors(terms, env) -> list:
    """A quantity's terms as tensors: a term with a small integer coefficient c (2..8) as c tensors of its
    monomial, any other term as one tensor; zero terms dropped. A decomposition for the allocation stream: the
    formulas give bytes, not tensors, and equal-shape tensors are what a small integer coefficient usually counts."""
    out = []
    for t in terms:
        if isinstance(t, F.MaxTerm):     # the larger pattern's own tensors
            out += term_tensors(max(t.alternatives, key=lambda alt: _sum(alt, env)), env)
            continue
        v = t.value(env)
        if not v:
            continue
        c = t.coef
        n = int(abs(c)) if c.denominator == 1 and 2 <= abs(c) <= 8 else 1
        out += [v / n] * n
    return out


def _sum(terms, env) -> float:
    return float(sum(t.value(env) for t in terms))


def _structure(fset, op: str) -> list:
    key = ("structure", op)
    hit = fset._cache.get(key)
    if hit is None:
        hit = fset._cache[key] = sorted((e for e in fset.structure if e[0] == op), key=lambda e: -len(e[1]))
    return hit


def untraced_features(cfg, sw: dict, fset) -> list:
    """Config features a composed set cannot express (no traced run had them), named for the report."""
    out = []
    seen_values = fset.seen_switch_values()
    by_transform = transforms.modelled_switch_values()
    for k, v in sw.items():
        if k == "dropout_mask" and not sw.get("dropout"):
            continue    # no dropout, no mask
        if k in seen_values and v not in seen_values[k] and (k, v) not in by_transform:
            out.append(f"{k}={v}")
    keys = {k for k in STRUCTURE_SWITCHES if k in seen_values}
    out += unseen_pairs(sw, _traced_with(fset, keys))
    # (context parallelism and shared experts are the layer transforms' rows, modelled: `modelled`; so is
    # qk-layernorm where the set's runs never had it)
    return out


def _traced_switches(fset) -> list:
    """The switches of every run the set was fitted on (its provenance), computed once per set."""
    hit = fset._cache.get("traced switches")
    if hit is None and fset.programs is not None:
        hit = fset._cache["traced switches"] = fset.programs.traced
    if hit is None:
        hit = fset._cache["traced switches"] = [F.switches(t["config"]) for t in fset.provenance.get("traces", [])
                                                if isinstance(t, dict) and isinstance(t.get("config"), dict)]
    return hit


def _traced_with(fset, keys: set) -> "_CoValues":
    """The traced runs' values of `keys` as _CoValues, made once per set."""
    ck = ("traced with", tuple(sorted(keys)))
    hit = fset._cache.get(ck)
    if hit is None:
        hit = fset._cache[ck] = _CoValues(_traced_switches(fset), keys)
    return hit


class _CoValues:
    """Per switch value, the values of every other switch in the traced runs that had it: with(a, va)[b]. Built
    on the distinct combinations of the switches asked about (a set's runs repeat a few dozen of them), each
    value's table on first ask."""

    def __init__(self, traced: list, keys: set):
        self.names = sorted(keys)
        self.combos = [dict(c) for c in {tuple((k, t.get(k)) for k in self.names) for t in traced}]
        self._with: dict = {}

    def with_(self, a: str, va) -> dict:
        hit = self._with.get((a, va))
        if hit is None:
            hit = self._with[(a, va)] = {}
            for t in self.combos:
                if t.get(a) == va:
                    for b, vb in t.items():
                        hit.setdefault(b, set()).add(vb)
        return hit


def unseen_pairs(sw: dict, traced: _CoValues) -> list:
    """Pairs of the config's switch values that the traced runs only ever saw confounded: every run with one
    value had the same other value of the second switch, and the reverse (the H100 campaign ran the TE spec only
    with flash attention, so `spec=te` and `attention=flash` cannot be told apart there). Such a config is not
    composed from measured parts, whatever the single values say. traced: the runs' values of the switches
    asked about."""
    out = []
    names = [k for k in traced.names if k in sw]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            va, vb = sw[a], sw[b]
            with_a = traced.with_(a, va).get(b, set())
            with_b = traced.with_(b, vb).get(a, set())
            if with_a and with_b and vb not in with_a and len(with_a) == 1 and len(with_b) == 1:
                out.append(f"{a}={va} with {b}={vb}")
    return out


def _replay_forward(items: list, level: float, peak: float, rows: list) -> tuple:
    for it in items:
        if it[0] in ("run", "ckpt"):
            level, peak = _replay_forward(it[1], level, peak, rows) if it[0] == "run" else _ckpt_forward(
                it[1], level, peak, rows, it[2])
            continue
        label, (fd, fp, _, _, _), op, layer = it
        peak = max(peak, level + fp)
        level += fd
        rows.append((op, layer, fd, fp))
    return level, peak


def _ckpt_forward(items: list, level: float, peak: float, rows: list, kept: float) -> tuple:
    """A checkpointed group's forward keeps only its output (`kept` bytes); its transient is at most its plain
    forward's."""
    _, top = _replay_forward(items, level, peak, rows)
    return level + kept, max(peak, top)


def _replay_backward(items: list, level: float, peak: float, bwd_rows: list, hold: list | None = None,
                     again: bool = False) -> tuple:
    """hold: [bytes, n] a checkpoint's output gradient, added to the level once n of its group's backward segments
    ran (where the plain segments free it). again: the chunk's previous backward ran last on it, so each MoE
    checkpoint's input and input gradient from then (`retained`, in the level) go as its forward re-runs."""
    above_retains = False   # the checkpoint whose backward ran last keeps its input's gradient (ours to free)
    for it in reversed(items):
        if it[0] == "run":
            # a run holding its output's gradient (`_decoder`): held from its MLP's backward to the chunk's end
            level, peak = _replay_backward(it[1], level, peak, bwd_rows, [it[2], it[3]] if len(it) > 2 else hold)
            above_retains = False
            continue
        if it[0] == "ckpt":
            # The checkpoint re-runs the group's forward, then its backward; its output's bytes go with it. Its
            # backward keeps the gradient of its output (megatron-core's CheckpointFunction.backward holds its
            # arguments until it returns): `grad` bytes more from where the plain segments free it on. Then its
            # input and that gradient go, except what an MoE group keeps (`_decoder`): its own input, and the
            # gradient it returned, which is the next group's output gradient.
            retains, received = ckpt_keeps(it)
            if again and retains:
                level -= 2 * it[3]
            level, peak = _replay_forward(it[1], level, peak, [])
            grad = [it[4], it[5]]
            level, peak = _replay_backward(it[1], level, peak, bwd_rows, grad)
            level -= (0.0 if above_retains or received else it[4] - grad[0]) + (0.0 if retains else it[3])
            above_retains = retains
            continue
        above_retains = False
        label, (_, _, bd, bp, _), op, layer = it
        peak = max(peak, level + bp)
        level += bd + grad_due(hold)
        bwd_rows.append((op, layer, bp))
    return level, peak


def grad_due(hold: list | None) -> float:
    """After one backward segment of a checkpoint's group: the bytes of its held output gradient if they become
    held now ([bytes, segments left], counted down here; compose and estimator.alloc_stream), else 0."""
    if not hold or not hold[0]:
        return 0.0
    hold[1] -= 1
    if hold[1] > 0:
        return 0.0
    due, hold[0] = hold[0], 0.0
    return due


# GPU kernel families a composed set measures on CPU stand-ins (tracer/standins.py, docs/STANDINS.md): switch value
# -> what the report calls it.
STANDIN_FAMILIES = (
    (("spec", "te"), "Transformer Engine layernorm-linear and norms"),
    (("attention", "flash"), "flash / fused attention"),
    (("fuse_act", True), "fused bias-activation"),
    (("fuse_softmax", True), "fused masked softmax"),
    (("fuse_rope", True), "fused RoPE"),
    (("fuse_bda", True), "fused bias-dropout-add"),
    (("grouped_gemm", True), "grouped GEMM experts"),
    (("scores", "call"), "unfused attention"),
    (("torch_norm", "cuda"), "torch's CUDA norms"),
)


def standin_families(sw: dict, untraced: list = ()) -> list:
    """The config's GPU kernel families whose formulas were measured on CPU stand-ins (not those the set never
    traced, `untraced`)."""
    out = [name for (key, value), name in STANDIN_FAMILIES if sw.get(key) == value and f"{key}={value}" not in untraced]
    if sw.get("dropout") and sw.get("dropout_mask") == "byte" and "dropout_mask=byte" not in untraced:
        out.append("1-byte dropout masks")
    return out


def chunk_body(cache: ComposedCache, moe_flags, first: bool, last: bool) -> tuple:
    """(saved, fwd peak above entry, bwd peak above the all-saved level, per-op rows, bwd peak of a backward that
    follows the chunk's previous backward with no forward of it between, or None where that is the same) of a
    chunk's own ops."""
    items = cache.sequence(moe_flags, first, last)
    rows: list = []
    saved, fwd = _replay_forward(items, 0.0, 0.0, rows)
    saved, fwd = transforms.relieved(cache.cfg, layer_kept(items), saved, fwd)
    bwd_rows: list = []
    _, bwd = _replay_backward(items, saved, saved, bwd_rows)
    _account(cache, items)
    again = None
    kept = retained(items)
    if kept:
        # The MoE checkpoints' inputs and input gradients stay until the layer runs forward again (a forward of
        # the next microbatch replaces them as it goes); a backward right after the chunk's last one starts with
        # them and frees each as its group re-runs its forward.
        _, top = _replay_backward(items, saved + kept, saved + kept, [], again=True)
        again = max(top - saved, 0.0)
    return saved, max(fwd, saved), max(bwd - saved, 0.0), _op_rows(rows, bwd_rows), again


def layer_kept(items: list) -> list:
    """Each layer's saved bytes, in order (a layer is a `run` item; a checkpoint group keeps its input only)."""
    out = []
    for it in items:
        if it[0] == "run":
            out.append(sum(x[1][0] for x in it[1] if x[0] not in ("run", "ckpt")))
        elif it[0] == "ckpt":
            out.append(it[2])
    return out


def retained(items: list) -> float:
    """Bytes a chunk's backward leaves allocated: each MoE checkpoint's input and its gradient."""
    return sum(2 * it[3] for it in items if it[0] == "ckpt" and ckpt_keeps(it)[0])


def ckpt_keeps(it: tuple) -> tuple:
    """(retains, received) of a checkpoint item (ComposedCache.sequence); both False where it has neither."""
    return len(it) > 6 and bool(it[6]), len(it) > 7 and bool(it[7])


def _answering(have: list, i: int, sw: dict):
    """Of the label's entries that give quantity i (most specific first), the first that matches sw, if it covers
    sw's switch values and determines the quantity."""
    match = next((sf for sf in have if sf.matches(sw)), None)
    return match if match is not None and match.covers(sw) and match.quantities[i] is not None else None


def _account(cache: ComposedCache, items: list) -> None:
    for it in items:
        if it[0] in ("run", "ckpt"):
            _account(cache, it[1])
            continue
        label, (fd, _, _, _, measured), _, _ = it
        if label in transforms.LAYER_LABELS:
            cache.saved_modelled += max(fd, 0.0)
            if fd > 0:
                cache.modelled.add(label)
        elif measured:
            cache.saved_measured += max(fd, 0.0)
        else:
            cache.saved_extrapolated += max(fd, 0.0)
            cache.extrapolated.add(label)


def _op_rows(rows: list, bwd_rows: list) -> list:
    """One (op, saved, fwd peak, bwd peak) row per op instance (an op in one layer), in forward order."""
    acc: dict = {}
    for op, layer, fd, fp in rows:
        r = acc.setdefault((op, layer), [op, 0.0, 0.0, 0.0])
        r[1] += fd
        r[2] = max(r[2], fp)
    for op, layer, bp in bwd_rows:
        r = acc.setdefault((op, layer), [op, 0.0, 0.0, 0.0])
        r[3] = max(r[3], bp)
    return [tuple(r) for r in acc.values()]
