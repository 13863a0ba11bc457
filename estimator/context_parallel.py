"""--context-parallel-size > 1: Transformer Engine's context-parallel attention (megatron-core runs CP only through
TE's DotProductAttention) passes the key and value chunks around the CP ring and keeps those it received from the
other CP - 1 ranks for its backward: 2 x e x s x b x g x d / t bytes per other rank and layer (s: this rank's
share of the sequence; with multi-latent attention e x s x b x a x (dq + dr + dv) / t, its heads' own widths).
Modelled, not measured: no traced run had CP (CP has no CPU stand-in). The hand-modelled set counts the same bytes
in its core-attention formulas (estimator/formula_sets/build_modelled.py), which the published context-parallel
H100 runs bear out; its activations are not changed here."""
from __future__ import annotations

from .transforms import layer_transform

LABEL = "layers.*.self_attention.core_attention_cp_kv"


@layer_transform("context-parallel KV chunks", LABEL)
def layer_row(cfg, env: dict, moe: bool, modelled: bool):
    cp = int(getattr(cfg, "context_parallel_size", 1) or 1)
    if cp <= 1 or modelled or getattr(cfg, "transformer_impl", "transformer_engine") != "transformer_engine":
        return None
    # multi-latent attention: every head's key (plain and rotary parts) and value, of their own widths
    kv = env["a"] * (env["dq"] + env["dr"] + env["dv"]) if getattr(cfg, "multi_latent_attention", False) \
        else 2 * env["g"] * env["d"]
    saved = env["e"] * env["s"] * env["b"] * kv * (cp - 1) / env["t"]
    return (LABEL, saved, saved, 0.0)
