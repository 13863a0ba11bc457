"""--fp32-residual-connection: megatron-core 0.16.1 casts the embedding's output to fp32
(LanguageModelEmbedding.forward) and nothing casts it back, so the residual stream stays fp32 through every
layer (a 16-bit sublayer output added to it promotes to fp32). Modelled, not measured: each layer's two norms save
their input, a residual-stream tensor, in fp32 instead of the activation dtype."""
from __future__ import annotations

from .transforms import layer_transform

LABEL = "layers.*.fp32_residual"


@layer_transform("fp32 residual stream", LABEL)
def layer_row(cfg, env: dict, moe: bool, modelled: bool):
    if not getattr(cfg, "fp32_residual_connection", False) or env["e"] >= 4:
        return None
    extra = 2 * (4 - env["e"]) * env["s"] * env["b"] * env["h"] / env["st"]
    return (LABEL, extra, extra, 0.0)
