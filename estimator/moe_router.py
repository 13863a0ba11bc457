"""--moe-router-dtype fp32 / fp64: the router's logits and the probabilities computed from them in that dtype
(megatron-core's router_gating_linear saves its 16-bit input and returns the logits in router_dtype). Modelled:
the [tokens, experts] logits and scores each take (router bytes - activation bytes) more per element than the
16-bit formulas count, on every MoE layer."""
from __future__ import annotations

from .transforms import layer_transform

BYTES = {"fp32": 4, "fp64": 8}


@layer_transform("router dtype", "layers.*.mlp.router_dtype")
def layer_row(cfg, env: dict, moe: bool, modelled: bool = False):
    """The row to append to a MoE layer's rows, or None."""
    extra = BYTES.get(cfg.moe_router_dtype, 0) - env["e"]
    if not moe or extra <= 0:
        return None
    saved = 2 * extra * env["s"] * env["b"] * env["E"] / env["st"]
    return ("layers.*.mlp.router_dtype", saved, saved, 0.0)
