"""Writes fit/grids/cpu_recompute_modules.json: selective recompute of megatron-core's modules other than core
attention (--recompute-modules mlp, moe, shared_experts, layernorm, moe_act, and combinations), on the GPU kernels'
CPU stand-ins (fake process group). Recompute is never fitted: the estimate composes it from the plain layer's
programs (estimator/compose.py: `mlp`, `moe` and `shared_experts` checkpoint their module, `layernorm` and `moe_act`
release their output once its consumer has run), and these runs judge that composition
(benchmarks/packed_runs.py fit/traces/cpu_recompute_modules). Each is a campaign config (make_cpu_gpu_kernels.py)
with the recompute flags, some with another shape; over one process, TP 2 + SP, PP 2 and EP 4, dense (Llama-style,
TE and local spec; without linear biases: a GPT-style run of `mlp` with them did not finish on the stand-ins), MoE
with grouped-GEMM and sequential experts, shared experts, and DeepSeek-style (MLA with grouped-GEMM experts).
Run: python fit/grids/make_cpu_recompute_modules.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import COMMON, configs as campaign  # noqa: E402

SHAPE = ("--seq-length", "--micro-batch-size", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
         "--vocab-size")
SHARED = {"--moe-shared-expert-intermediate-size": 96}
# name: (campaign config, modules, flags set)
RUNS = {
    "mlp_llama_w1": ("llama_gqa_w1_s64_b2_h128", ["mlp"], {}),
    "mlp_llama_tp2_sp_s80_b2": ("llama_gqa_tp2_sp_s64_b2_h128", ["mlp"], dict(zip(SHAPE, (80, 2, 96, 8, 288, 448)))),
    "mlp_llama_pp2": ("llama_gqa_pp2_s64_b2_h128", ["mlp", "core_attn"], {}),
    "layernorm_mlp_local_w1": ("llama_gqa_local_w1_s64_b2_h128", ["layernorm", "mlp"], {}),
    "layernorm_local_tp2_sp": ("llama_gqa_local_tp2_sp_s64_b2_h128", ["layernorm"], {}),
    "moe_act_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", ["moe_act"], {}),
    "layernorm_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", ["layernorm"], {}),
    "moe_act_layernorm_tp2_sp_gg": ("llama_moe_tp2_sp_ep4_a2a_gg_s64_b2_h128", ["moe_act", "layernorm"], {}),
    "moe_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", ["moe"], {}),
    "moe_sequential": ("llama_moe_ep4_a2a_s64_b2_h128", ["moe"], {}),
    "moe_sequential_tp2_sp": ("llama_moe_tp2_sp_ep4_a2a_s48_b1_h128", ["moe"], {}),
    "shared_experts_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", ["shared_experts"], SHARED),
    "core_attn_moe_act_layernorm_gg": ("llama_moe_ep4_a2a_gg_s64_b2_h128", ["core_attn", "moe_act", "layernorm"],
                                       {}),
    # DeepSeek-style: MLA (its input norm a module of its own), grouped-GEMM experts, shared experts
    "mla_moe_act_layernorm_shared_tp2_sp": ("mla_moe_tp2_sp_ep4_a2a_s64_b2_h128_q48",
                                            ["moe_act", "layernorm", "shared_experts"], SHARED),
}


def configs() -> list:
    base = {c["name"]: c for c in campaign()}
    out = []
    for name, (src, modules, changes) in RUNS.items():
        c = copy.deepcopy(base[src])
        c["name"] = f"rm_{name}"
        c["set"].update(changes)
        c["set"].update({"--recompute-granularity": "selective", "--recompute-modules": modules})
        out.append(c)
    return out


if __name__ == "__main__":
    write_grid("cpu_recompute_modules", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
