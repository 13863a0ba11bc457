"""--qk-layernorm: megatron-core's SelfAttention normalizes the query and the key per head (q_layernorm,
k_layernorm) after splitting the QKV projection's output. Measured where a set's runs had it (cpu_compose: the
qk_norm switch); for a set without such runs (gpu_h100, modelled) modelled here: each norm
saves its input, views of the projection's output that nothing else keeps, so the query's and the key's share
of that output stays alive per layer until the backward (the norms' statistics are per token and head: ignored)."""
from __future__ import annotations

from .formulas import qk_norm_of
from .transforms import layer_transform

LABEL = "layers.*.self_attention.qk_layernorm"


@layer_transform("qk layernorm", LABEL, stands_for=("qk_norm", "layernorm"))
def layer_row(cfg, env: dict, moe: bool, modelled: bool):
    if qk_norm_of(cfg) != "layernorm":
        return None     # (multi-latent attention's latent norms are in its measured programs; an L2 norm is measured)
    saved = env["e"] * env["s"] * env["b"] * (env["a"] + env["g"]) * env["d"] / env["t"]
    return (LABEL, saved, saved, 0.0)
