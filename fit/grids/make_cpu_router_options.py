"""Writes fit/grids/cpu_router_options.json: DeepSeek-style MoE routing (--moe-router-score-function sigmoid,
--moe-router-enable-expert-bias, group-limited top-k: --moe-router-num-groups / --moe-router-group-topk,
--moe-router-topk-scaling-factor) on the GPU kernels' CPU stand-ins (fake process group). These options change
only the router's tensors (tokens x experts) and are read as softmax top-k routing: these runs, never fitted, check
that (benchmarks/packed_runs.py fit/traces/cpu_router_options). Each is a campaign MoE config with the options:
grouped-GEMM and sequential experts over EP 4, with TP 2 + SP, and with multi-latent attention; and shared experts
behind their sigmoid gate (--moe-shared-expert-gate, modelled with the shared experts), and top-1 routing with the
probabilities applied to the experts' input (--moe-apply-probs-on-input, modelled).
Run: python fit/grids/make_cpu_router_options.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import COMMON, configs as campaign  # noqa: E402

DEEPSEEK = {"--moe-router-score-function": "sigmoid", "--moe-router-num-groups": 4, "--moe-router-group-topk": 2,
            "--moe-router-topk-scaling-factor": 2.5, "--moe-router-enable-expert-bias": True}
PROBS_ON_INPUT = {"--moe-router-topk": 1, "--moe-router-pre-softmax": True, "--moe-apply-probs-on-input": True}
SHARED_GATE = {"--moe-shared-expert-intermediate-size": 96, "--moe-shared-expert-gate": True}
# name: (campaign config, flags set)
RUNS = {
    "sigmoid_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", {"--moe-router-score-function": "sigmoid"}),
    "deepseek_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", DEEPSEEK),
    "deepseek_tp2_sp_gg": ("llama_moe_tp2_sp_ep4_a2a_gg_s64_b2_h128", DEEPSEEK),
    "deepseek_sequential": ("llama_moe_ep4_a2a_s64_b2_h128", DEEPSEEK),
    "deepseek_mla_tp2_sp_gg": ("mla_moe_tp2_sp_ep4_a2a_s64_b2_h128_q48", DEEPSEEK),
    # shared experts behind a sigmoid gate (Qwen2-MoE's; modelled beside the programs, as shared experts are)
    "shared_gate_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", SHARED_GATE),
    "shared_gate_tp2_sp_sequential": ("llama_moe_tp2_sp_ep4_a2a_s48_b1_h128", SHARED_GATE),
    # top-1 routing with the probabilities applied to the experts' input (estimator/moe_probs_on_input.py)
    "probs_on_input_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", PROBS_ON_INPUT),
    "probs_on_input_tp2_sp_sequential": ("llama_moe_tp2_sp_ep4_a2a_s48_b1_h128", PROBS_ON_INPUT),
}


def configs() -> list:
    base = {c["name"]: c for c in campaign()}
    out = []
    for name, (src, changes) in RUNS.items():
        c = copy.deepcopy(base[src])
        c["name"] = f"rt_{name}"
        c["set"].update({k: v for k, v in changes.items() if v is not True})
        c["flags"] += [k for k, v in changes.items() if v is True]
        out.append(c)
    return out


if __name__ == "__main__":
    write_grid("cpu_router_options", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
