"""Candidate monomials (docs/FORMATS.md section 4 variables) that an op's bytes may be a sum of.

A monomial is a sorted tuple of (variable, exponent) pairs; () is the constant 1. Each op family gets a short list
of sharded-shape atoms (tokens s*b times a hidden-like size, divided by the parallel size that shards it); every
atom appears twice, times `e` (an activation in the training dtype) and bare (a fixed-size dtype: fp32 softmax,
int64 indices, byte masks), so the fit can tell them apart once the data holds two dtypes.
Order matters: earlier candidates win ties between fits that agree on the whole domain of a formula.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Mapping

# The FORMATS 4 variables (and the switch indicators of composed sets): one list for the fitter and the estimator.
from estimator.formulas import VARIABLES

Monomial = tuple  # tuple[tuple[str, int], ...], sorted by variable name

# The Megatron flag that changes each variable (for "vary X" hints).
FLAG_HINTS = {
    "s": "--seq-length", "b": "--micro-batch-size", "h": "--hidden-size", "f": "--ffn-hidden-size",
    "a": "--num-attention-heads", "g": "--num-query-groups (with --group-query-attention)",
    "d": "--kv-channels", "v": "--vocab-size", "E": "--num-experts", "k": "--moe-router-topk",
    "fe": "--moe-ffn-hidden-size", "fs": "--moe-shared-expert-intermediate-size",
    "t": "--tensor-model-parallel-size", "st": "--sequence-parallel (with TP > 1)",
    "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size", "e": "--bf16 / --fp16 (element size)",
    "P": "the parameter count (--hidden-size, --ffn-hidden-size, --vocab-size, --num-layers, TP/EP/DP sharding)",
    "Pmax": "the largest parameter tensor (--vocab-size x --hidden-size / TP, or the MLP weights)",
    "Pstep": "the parameter shapes (largest 2*p_i + p_(i-1) within an optimizer parameter group)",
    "L": "--num-layers (per pipeline stage)",
    "ql": "--q-lora-rank (with --multi-latent-attention)", "kl": "--kv-lora-rank",
    "dq": "--qk-head-dim", "dr": "--qk-pos-emb-head-dim", "dv": "--v-head-dim",
    "D": "--mtp-num-layers",
}


def parse_monomial(text: str) -> Monomial:
    """'s*s*b*a/t' -> (('a',1),('b',1),('s',2),('t',-1)); '1' -> ()."""
    exps: dict[str, int] = {}
    num, _, den = text.partition("/")
    for part, sign in ((num, 1), (den, -1)):
        for name in filter(None, (p.strip() for p in part.split("*"))):
            if name == "1":
                continue
            if name not in VARIABLES:
                raise ValueError(f"unknown variable {name!r} in {text!r}")
            exps[name] = exps.get(name, 0) + sign
    return tuple(sorted((k, v) for k, v in exps.items() if v))


def format_monomial(m: Monomial) -> str:
    num = [k for k, v in m for _ in range(v) if v > 0]
    den = [k for k, v in m for _ in range(-v) if v < 0]
    text = "*".join(_canonical_order(num)) or "1"
    return text + ("/" + "*".join(_canonical_order(den)) if den else "")


def _canonical_order(names: list[str]) -> list[str]:
    return sorted(names, key=VARIABLES.index)


def times(m: Monomial, var: str, exp: int = 1) -> Monomial:
    d = dict(m)
    d[var] = d.get(var, 0) + exp
    return tuple(sorted((k, v) for k, v in d.items() if v))


def evaluate(m: Monomial, values: Mapping[str, object]) -> Fraction:
    """Exact value of the monomial at integer/rational variable values."""
    out = Fraction(1)
    for var, exp in m:
        out *= Fraction(values[var]) ** exp
    return out


def variables_of(m: Monomial) -> set[str]:
    return {k for k, _ in m}


# --- op families ------------------------------------------------------------------------------------------
# Atoms without e. Tokens are s*b (s is already seq/cp). Layer-norm/residual-stream activations are sharded by
# sequence parallelism (/st); attention and MLP interiors by TP (/t); logits by TP over the vocab.
_STREAM = ["s*b*h/st", "s*b*h", "s*b*h/t"]
_WEIGHTS = ["h*h/t", "h*f/t", "h*a*d/t", "h*g*d/t", "h", "f/t", "a*d/t", "g*d/t"]
# MoE with balanced routing (tracer/moe_routing.py): a rank's s*b/st tokens are gathered over the expert-TP x EP
# group (s*b*ep*etp/st rows of hidden states and of router probabilities), and its local experts receive
# s*b*k*etp/st of them, each of fe/etp interior width. Zero on dense configs (E = k = 0 there).
_MOE = ["s*b*k*h*etp/st", "s*b*k*fe/st", "s*b*E*etp/st", "s*b*h*ep*etp/st", "s*b*E*ep*etp/st", "s*b*k*etp/st",
        "s*b*E/st", "s*b*k/st", "E/ep", "E"]
# One local expert at a time (its backward, its fc1 output): each of the E experts receives s*b*k*ep*etp/(st*E)
# of the gathered tokens, of width h, or fe/etp inside the expert; and one expert's weight gradients.
_ONE_EXPERT = ["s*b*k*h*ep*etp/st*E", "s*b*k*fe*ep/st*E", "h*fe/etp"]
# The code of one local expert (`...local_experts.*`, its linears and its own code): its tokens (rows of width h,
# fe/etp inside), their routing probabilities, and its weight gradients.
_IN_EXPERT = _ONE_EXPERT + ["s*b*k*ep*etp/st*E", "fe/etp", "h", "1"]
# A decoder layer's own atoms (residual stream, attention and MLP interiors, weight-gradient sizes).
_LAYER = _STREAM + ["s*b*f/t", "s*b*a*d/t", "s*b*g*d/t", "s*s*b*a/t", "s*b/st", "1"] + _WEIGHTS
# Multi-latent attention (0 without it): the latents on the rank's own tokens (the TE spec's replicated down
# projections; /st under SP) and gathered for the column-parallel up projections, the shared rotary key part
# gathered over SP, every head's plain and rotary query / key parts and its value (/t), the weights' gradients.
_MLA_TOKENS = ["s*b*ql/st", "s*b*ql", "s*b*kl/st", "s*b*kl", "s*b*dr/st", "s*b*dr",
               "s*b*a*dq/t", "s*b*a*dr/t", "s*b*a*dv/t", "s*b*a/t", "s*b/st", "s*b"]
_MLA_WEIGHTS = ["h*ql", "h*kl", "h*dr", "ql*a*dq/t", "ql*a*dr/t", "kl*a*dq/t", "kl*a*dv/t", "h*a*dq/t",
                "h*a*dr/t", "h*a*dv/t", "ql", "kl"]
_MLA = _STREAM + _MLA_TOKENS + _MLA_WEIGHTS + ["1"]
# Multi-token prediction's own code (its transformer layer is the decoder layer's programs): the embedding of the
# shifted tokens and their ids, the two norms, the joined [embedding, hidden] and its projection (gathered over TP,
# scattered over SP), its weight's gradient, and the block's join of the 1 + D hidden states.
_MTP = _STREAM + ["s*b*h*D/st", "s*b*h*D", "s*b", "s*b/st", "h*h/t", "h", "1"]
FAMILIES: dict[str, list[str]] = {
    "mla": _MLA,
    "mtp": _MTP,
    # s*b*d, s*d: under rope, the backward of the rotated query and key frees tensors of one head's width
    "core_attention": ["s*b*a*d/t", "s*b*g*d/t", "s*s*b*a/t", "s*b*a/t", "s*b*h/st", "s*b*d", "s*d", "1",
                       "s*b*a*dq/t", "s*b*a*dr/t", "s*b*a*dv/t"],
    # s*b/st: Transformer Engine's LayerNormLinear (the TE spec's linear_qkv and linear_fc1) keeps its fused
    # norm's fp32 statistics per local token
    "linear_qkv": _STREAM + ["s*b*a*d/t", "s*b*g*d/t", "s*b/st", "1"],
    "linear_proj": _STREAM + ["s*b*a*d/t", "1", "s*b*a*dv/t", "h*a*dv/t"],
    "linear_fc1": _STREAM + ["s*b*f/t", "s*b/st", "1"],
    "linear_fc2": _STREAM + ["s*b*f/t", "1"],
    "mlp": ["s*b*f/t", "s*b*h/st", "s*b*h", "1"] + _MOE,
    "layernorm": ["s*b*h/st", "s*b/st", "s*b*a*d/t", "s*b*g*d/t", "s*b*a/t", "s*b*g/t", "1"],
    "self_attention": _STREAM + ["s*b*a*d/t", "s*b*g*d/t", "s*s*b*a/t", "s*b*a/t", "s*d", "1"] + _MLA_TOKENS
    + ["s*dr"],
    "layer": _LAYER + _MOE,
    # The layer basis for parts of dense layers only (the MoE atoms are 0 there) and of MoE layers only.
    "layer_dense": _LAYER,
    "layer_moe": _STREAM + ["s*b*a*d/t", "s*b*g*d/t", "s*s*b*a/t", "s*b/st", "1"] + _MOE + _ONE_EXPERT
                 + ["h*h/t", "h*a*d/t", "h*g*d/t", "h*E", "h"],
    "embedding": ["s*b*h/st", "s*b*h", "s*b", "s*h", "v*h/t", "1"],
    "output_layer": ["s*b*v/t", "s*b*h/st", "s*b*h", "s*b", "v*h/t", "1"],
    # The loss op also carries the whole loss head's backward transient (FORMATS 4): the output layer's input
    # and weight gradients and the final norm's gradients come after the logits' terms.
    "loss": ["s*b*v/t", "s*b", "s*b/t", "b", "s", "1", "s*b*h/st", "s*b*h", "v*h/t"],
    # The input batch: [b, s] int64 tokens, position ids and labels, fp32 loss mask, [b, 1, s, s] bool attention
    # mask; s alone for position ids built once and expanded.
    "data": ["s*b", "s*s*b", "s", "s*s", "b", "1"],
    "router": ["s*b*E/st", "s*b*k/st", "s*b*h/st", "s*b*E", "s*b*k", "s*b/st", "E", "1"],
    "experts": ["s*b*k*h*etp/st", "s*b*k*fe/st", "s*b*k*h/st", "s*b*k*fe/etp", "s*b*k*h", "s*b*k*fe", "s*b*k/st",
                "E/ep", "1"] + _ONE_EXPERT,
    "local_expert": _IN_EXPERT,
    "shared_experts": ["s*b*fs/t", "s*b*h/st", "s*b*h", "1"],
    "token_dispatcher": _MOE + ["s*b*k*h/st", "s*b*k*h", "1"],
    # The optimizer step (torch AdamW on CPU, one parameter at a time): parameter-sized temporaries (two of the
    # current parameter while the previous one's is still referenced: Pstep), or ones of the largest tensor, or of
    # all parameters the rank's optimizer holds (per-stage variables, FORMATS 4).
    "optimizer": ["Pstep", "Pmax", "P", "1"],
    # What the loss head's backward leaves live through the decoder's backward: the gradient of the hidden state
    # it passes down, a tied embedding's weight gradient (held until the embedding's backward), loss scalars.
    "backward_held": ["s*b*h/st", "v*h/t", "s*b", "1"],
}


# Multi-latent attention's projections and latent norms: the MLA family
MLA_OPS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
               "linear_kv_up_proj", "q_layernorm", "kv_layernorm")


# Multi-token prediction's own modules (its transformer layer and its calls of the embedding are the decoder's and
# the embedding's families)
MTP_OPS = ("enorm", "hnorm", "eh_proj", "final_layernorm")


def family(op: str) -> str:
    """Which basis an op name (FORMATS 2.3 normalised) uses."""
    last = op.rsplit(".", 1)[-1]
    if last in MLA_OPS:
        return "mla"
    if op in ("mtp", "mtp.layers.*") or op.startswith("mtp.layers.*.") and last in MTP_OPS:
        return "mtp"
    if ".local_experts.*" in op:   # before the linear families: an expert's linears see only its tokens
        return "local_expert"
    if op in ("optim", "optimizer") or op.startswith("optim"):
        return "optimizer"
    if op == "backward_held":
        return "backward_held"
    if op.startswith("data."):
        return "data"
    if op == "loss" or last == "loss":
        return "loss"
    if last in FAMILIES:
        return last
    if "layernorm" in last or last.endswith("_norm") or last == "norm":
        return "layernorm"
    if "shared_expert" in op:
        return "shared_experts"
    if "experts" in op:
        return "experts"
    if "router" in op:
        return "router"
    if "dispatcher" in op:
        return "token_dispatcher"
    if "embedding" in op:
        return "embedding"
    if "output_layer" in op:
        return "output_layer"
    if op.startswith("layers.") and op.count(".") == 1:  # 'layers.*' itself: residuals, backward of a layer
        return "layer"
    if "self_attention" in op or "cross_attention" in op:
        return "self_attention"
    if ".mlp" in op:
        return "mlp"
    return "layer"  # widest basis for anything unrecognised


# Bare atoms a family's own allocations need and no other label's fit should be offered (they are not in the
# every-family list the size solver tries after a label's own): the CPU flash kernel's per-thread fp32 scratch of
# the attention stand-in, [q block, s + d] plus two q-block rows for s < 192 (4*(32*s + 32*d + 64) bytes), which a
# head width other than hidden / heads tells apart from every other atom; and the fp32 weight gradient of a
# query's or key's norm, d elements.
OWN_ONLY: dict[str, list[str]] = {"core_attention": ["s", "d"], "layernorm": ["d"]}


def candidates(op: str, moe: bool | None = None) -> list[Monomial]:
    """Ordered candidate monomials for `op`: atoms times e first, then the same atoms bare. `moe`: the data are
    all MoE layers (True) or all dense (False); the layer op then takes the basis of that kind."""
    fam = family(op)
    if fam == "layer" and moe is not None:
        fam = "layer_moe" if moe else "layer_dense"
    atoms = [parse_monomial(a) for a in FAMILIES[fam]]
    out: list[Monomial] = []
    # The input batch has fixed dtypes (int64 ids, bool mask, fp32 loss mask): its bare atoms come first.
    scaled = [times(a, "e") for a in atoms]
    for m in (atoms + scaled if fam == "data" else scaled + atoms) + [parse_monomial(a) for a in OWN_ONLY.get(fam, [])]:
        if m not in out:
            out.append(m)
    return out
