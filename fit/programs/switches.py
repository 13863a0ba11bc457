"""The switches a program set is cut by: their order, which of them can change each label, and the op structure
(per op, its children, split by the switches that change them: FORMATS 4.1)."""
from __future__ import annotations

import itertools
from collections import Counter

from estimator.formulas import STRUCTURE_SWITCHES   # the estimator checks combinations of the same switches

# Switches most likely to change what an op allocates come first, so ties between equally good splits prefer them;
# the layer spec before all (it changes the most labels: norms fused into linear_qkv and linear_fc1).
ORDER = ("spec", "attention", "mla", "q_lora", "mtp", "mtp_shared", "recompute", "moe", "moe_comm", "activation", "position",
         "normalization", "torch_norm", "gqa", "qk_norm", "output_gate", "dropout", "sp", "dtype", "softmax_fp32", "tp", "collectives", "bias",
         "tied", "fuse_act", "fuse_softmax", "fuse_rope", "dropout_mask", "fuse_ce", "fuse_bda", "mb1", "qcopy",
         "qcore", "a2a", "le1", "epx", "pre_softmax", "grouped_gemm", "scores")
# Switches a label's runs are split on first wherever they change its event structure, before the greedy choice,
# per label prefix. torch's norms as CUDA runs them come from the GPU-kernel campaign's local-spec runs only; pooled
# with the CPU runs, the norms' own labels and the decoder's code between layers (which frees what a norm did not
# keep) let either kind answer the other's untraced combinations: a bf16 CPU RMSNorm, which does not keep its
# input, answered fp32 ones. Split first, each kind's subtree is fitted from its own runs. (Elsewhere the pooled
# tree is better: the campaign's 30 local-spec runs do not cover what the CPU runs do.)
SPLIT_FIRST = {"torch_norm": ("decoder", "layers.*.input_layernorm", "layers.*.pre_mlp_layernorm", "final_layernorm")}


def split_first(label: str) -> tuple:
    """The switches `label`'s runs are split on first (SPLIT_FIRST)."""
    return tuple(k for k, prefixes in SPLIT_FIRST.items() if label.startswith(prefixes))

# The switches that can change a label's allocations, where fewer than all (the longest matching label prefix
# applies; a label without one may depend on any switch): a split on any other switch can only be a coincidence of
# the campaign's design (runs that differ in it also differ in one of these) or noise, and its formula would then
# extrapolate wrongly to combinations never traced (the attention's own code fitted on `activation`, say).
# The embedding's lookups (the vocabulary-parallel one masks its input under TP) and its own code: the position
# lookup's sum, the [b, s, h] -> [s, b, h] copy (a view at b = 1), the sequence-parallel scatter and clone, the
# dropout and its mask; a tensor of TP's all-reduce that gloo's thread releases late on some CPU runs is noise a
# split by `tp` must not fit. Attention and the MLP see the layer's shape switches, their own kernels and, through
# the layer spec (Transformer Engine fuses the norm into linear_qkv and linear_fc1), the norm type.
# (and multi-token prediction's embedding of the same weight in the same chunk: its gradient is summed with the
# main one's)
_EMBEDDING = ("position", "dropout", "dropout_mask", "sp", "collectives", "mb1", "mtp_shared")
_LAYER_PART = ("spec", "normalization", "torch_norm", "dtype", "sp", "tp", "collectives", "mb1")
_MOE_CODE = ("spec", "dtype", "sp", "tp", "collectives", "moe_comm", "a2a", "le1", "epx", "torch_norm")
RELEVANT = {
    "embedding": _EMBEDDING + ("tp",),
    # the lookup's backward makes the weight's dense gradient in the model's dtype (bf16: then an fp32 copy for the
    # main gradient), where a tied weight's gradient from the output layer is already held
    "embedding.word_embeddings": _EMBEDDING + ("tp", "dtype", "tied"),
    "embedding.position_embeddings": _EMBEDDING + ("tp", "dtype"),    # its table's gradient likewise, never tied
    # the logits and their gradient (TP: vocabulary-parallel), the input's gather under SP, the weight's gradient
    # (bf16: its fp32 copy; tied: kept for the embedding's backward)
    # (under multi-token prediction the main head reads a view of the MTP block's joined hidden states)
    "output_layer": ("spec", "dtype", "tied", "sp", "tp", "collectives", "mb1", "fuse_ce", "torch_norm", "mtp",
                     "mtp_shared"),
    # the cross entropy over the logits (fp32 under bf16; vocabulary-parallel under TP), then the root's own code
    # after it, which frees the loss head's inputs: the final norm's output (RMSNorm in bf16 keeps its fp32 copy)
    # and the position ids or rotary table
    "loss": ("spec", "dtype", "tp", "collectives", "sp", "mb1", "fuse_ce", "torch_norm", "mtp"),
    "step@loss": ("spec", "dtype", "tp", "collectives", "sp", "mb1", "fuse_ce", "normalization", "position",
                  "torch_norm", "mtp"),
    "embedding@": _EMBEDDING,
    # multi-token prediction: its calls of the model's embedding (its weight's gradient summed with the main
    # lookup's in one chunk: mtp_shared), its own code (the two norms, the projection of both joined, gathered over
    # TP and scattered over SP, the final norm, the join of the hidden states), its loss head as the main one's
    "mtp.layers.*.embedding": _EMBEDDING + ("tp", "dtype", "tied"),
    "mtp": _LAYER_PART + ("mtp_shared", "dropout", "dropout_mask"),
    "mtp_head.output_layer": ("spec", "dtype", "tied", "sp", "tp", "collectives", "mb1", "fuse_ce", "torch_norm",
                              "mtp_shared"),
    "mtp_head.loss": ("spec", "dtype", "tp", "collectives", "sp", "mb1", "fuse_ce", "torch_norm", "mtp_shared"),
    "layers.*.self_attention": _LAYER_PART + ("attention", "mla", "q_lora", "position", "gqa", "qk_norm",
                                              "output_gate", "qcopy", "qcore",
                                              "dropout", "dropout_mask", "softmax_fp32", "bias", "fuse_softmax",
                                              "fuse_rope", "scores"),
    # (and dropout: the bias-dropout-add after the MLP hands its last linear's backward a gradient of its own under
    # dropout, which that backward frees, and a shared one without)
    "layers.*.mlp": _LAYER_PART + ("moe", "moe_comm", "a2a", "activation", "bias", "fuse_act", "dropout",
                                   "dropout_mask", "grouped_gemm"),
    # The MoE layer's own code around its experts (the token dispatcher's permute, exchange, sort and their
    # inverses) never sees the experts' activation or biases, nor the norm before the router (no spec fuses it
    # into the dispatch), nor the micro-batch's shape (it flattens the tokens first); the experts' own code splits
    # and joins the tokens of more than one local expert.
    "layers.*.mlp@router": _MOE_CODE,
    # the router's logits, top-k and probabilities over the tokens its rank holds: the experts' activation, their
    # biases and dropout after the MLP are beyond it
    "layers.*.mlp.router": _MOE_CODE + ("pre_softmax",),
    # (after the experts: the combine's backward frees the layer's output gradient, a tensor of its own under
    # dropout, as after a dense MLP)
    "layers.*.mlp@experts": _MOE_CODE + ("dropout", "grouped_gemm"),
    "layers.*.mlp.experts": _MOE_CODE + ("mb1", "activation", "bias", "fuse_act", "grouped_gemm"),
    # the layer's own code after its attention and after its MLP: the bias-dropout-add into the residual stream
    # (after an MoE layer's MLP, of what its dispatcher returns)
    "layers.*@self_attention": _LAYER_PART + ("dropout", "dropout_mask", "bias", "fuse_bda"),
    "layers.*@mlp": _LAYER_PART + ("dropout", "dropout_mask", "bias", "moe", "moe_comm", "a2a", "fuse_bda"),
}


def relevant(label: str, switch: str) -> bool:
    keys = [k for k in RELEVANT if label.startswith(k)]
    return not keys or switch in RELEVANT[max(keys, key=len)]


def parts(runs: list, keys: tuple) -> dict:
    """Runs grouped by their values of the switches `keys`."""
    out: dict = {}
    for r in runs:
        out.setdefault(tuple(r.switches.get(k) for k in keys), []).append(r)
    return out


# Beyond the structure switches the estimator checks in pairs (STRUCTURE_SWITCHES), what changes an op's children:
# multi-latent attention's query latent (a down / up pair or one projection) and, with MLA, the fused RoPE (the
# unfused path calls the layer's rotary embedding module, the fused one reads its cache), and the query's and key's
# norm modules.
STRUCTURE_KEYS = STRUCTURE_SWITCHES + ("q_lora", "fuse_rope", "qk_norm")


def _structure_keys(have: list, op: str) -> tuple:
    """The fewest switches (singles, then pairs, then triples, in STRUCTURE_KEYS order) whose values fix op's
    children in every run; else every switch that varies. Fewest, so that an entry covers every combination of the
    switches that do not change the op (a layer's children depend on the layer spec, not on MoE or recompute)."""
    def uniform(keys):
        return all(len({tuple(r.children[op]) for r in rs}) == 1 for rs in parts(have, keys).values())
    varying = [k for k in STRUCTURE_KEYS if len({r.switches.get(k) for r in have}) > 1]
    for n in range(4):
        for keys in itertools.combinations(varying, n):
            if uniform(keys):
                return keys
    return tuple(varying)


def fit_structure(runs: list) -> list[dict]:
    """Per op, its children in forward order, split by the switches that change them."""
    ops = sorted({op for r in runs for op in r.children})
    out = []
    for op in ops:
        have = [r for r in runs if op in r.children]
        keys = _structure_keys(have, op)
        for part, rs in parts(have, keys).items():
            variants = Counter(tuple(r.children[op]) for r in rs)
            children = _union(list(variants))
            entry = {"op": op, "when": dict(zip(keys, part)), "children": children}
            if len(variants) > 1:
                n = variants.get(tuple(children), 0)
                entry["note"] = f"{len(rs) - n} of {len(rs)} runs had other children: {sorted(variants)}"
            out.append(entry)
    return out


def _union(variants: list) -> list:
    """The children of every variant, in forward order. A pipeline stage runs part of the model (the first stage
    no output layer or loss, a later one no embedding), and the estimator takes each stage's part of the whole
    list, so the list is the whole model's, never the most common stage's."""
    variants = sorted(variants, key=lambda v: (-len(v), v))
    out = list(variants[0])
    for v in variants[1:]:
        for i, child in enumerate(v):
            if child not in out:
                before = [c for c in v[:i] if c in out]
                out.insert(out.index(before[-1]) + 1 if before else 0, child)
    return out
