"""--moe-apply-probs-on-input (top-1 routing): the experts scale their input tokens by the routing probability
before their first linear instead of scaling the activation (megatron-core's experts: the product is a new
[routed tokens, h] tensor, which the first linear keeps for its backward, and the multiplication keeps the tokens it
scaled). Modelled: one more routed-token hidden state per MoE layer; two traced runs without it and with it
(fit/grids/make_cpu_router_options.py) read the same after it as before."""
from __future__ import annotations

from .transforms import layer_transform

LABEL = "layers.*.mlp.probs_on_input"


@layer_transform("probs on input", LABEL)
def layer_row(cfg, env: dict, moe: bool, modelled: bool = False):
    if not moe or not getattr(cfg, "moe_apply_probs_on_input", False):
        return None
    # a rank's experts receive s*b*k*etp/st routed tokens (fit.basis _MOE), each of width h
    tokens = env["s"] * env["b"] * env["k"] * env["etp"] / env["st"]
    saved = env["e"] * tokens * env["h"]
    return (LABEL, saved, saved, saved)
