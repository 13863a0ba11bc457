"""Writes fit/grids/cpu_router_options.json: DeepSeek-style MoE routing (--moe-router-score-function sigmoid,
--moe-router-enable-expert-bias, group-limited top-k: --moe-router-num-groups / --moe-router-group-topk,
--moe-router-topk-scaling-factor) on the GPU kernels' CPU stand-ins (fake process group). These options change
only the router's tensors (tokens x experts) and are read as softmax top-k routing: these runs, never fitted, check
that (benchmarks/packed_runs.py fit/traces/cpu_router_options). Each is a campaign MoE config with the options:
grouped-GEMM and sequential experts over EP 4, with TP 2 + SP, and with multi-latent attention.
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
# name: (campaign config, flags set)
RUNS = {
    "sigmoid_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", {"--moe-router-score-function": "sigmoid"}),
    "deepseek_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", DEEPSEEK),
    "deepseek_tp2_sp_gg": ("llama_moe_tp2_sp_ep4_a2a_gg_s64_b2_h128", DEEPSEEK),
    "deepseek_sequential": ("llama_moe_ep4_a2a_s64_b2_h128", DEEPSEEK),
    "deepseek_mla_tp2_sp_gg": ("mla_moe_tp2_sp_ep4_a2a_s64_b2_h128_q48", DEEPSEEK),
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
