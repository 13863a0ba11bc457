"""--moe-shared-expert-intermediate-size: shared experts (an MLP every token passes beside the routed experts, as in
Qwen- and DeepSeek-style MoE). No traced run had them, so a fitted set's MoE layer holds no program for them: their
row is the hand-modelled set's formula for them (modelled, and counted so in the report's measured share), with
their sigmoid gate's tensors under --moe-shared-expert-gate. The modelled set counts them itself."""
from __future__ import annotations

from . import formulas as F
from .args import recompute_modules
from .transforms import layer_transform

LABEL = "layers.*.mlp.shared_experts"


@layer_transform("shared experts", LABEL)
def layer_row(cfg, env: dict, moe: bool, modelled: bool):
    if modelled or not moe or not getattr(cfg, "moe_shared_expert_intermediate_size", None):
        return None
    formula = F.select(F.load(F.MODELLED_SET), LABEL, F.switches(cfg, env))
    if formula is None:
        return None
    saved, fwd, bwd = formula.evaluate(env)
    if getattr(cfg, "moe_shared_expert_gate", False):
        # --moe-shared-expert-gate: output * sigmoid(hidden @ gate_weight) keeps the shared experts' output and
        # the gate's score per token for its backward, and makes the product (SharedExpertMLP.forward)
        out = env["e"] * env["s"] * env["b"] * env["h"] / env["st"]
        saved, fwd, bwd = saved + out + env["e"] * env["s"] * env["b"] / env["st"], fwd + out, bwd + out
    if {"shared_experts", "moe"} & set(recompute_modules(cfg)):
        # checkpointed (alone, or with the whole MoE layer): its input is the router's, it keeps nothing else; its
        # backward re-runs its forward first
        return (LABEL, 0.0, fwd, saved + bwd)
    return (LABEL, saved, fwd, bwd)
