"""Writes fit/grids/cpu_mla_heldout.json: multi-latent attention configs the program fit never sees, on the GPU
kernels' CPU stand-ins (fake process group), to judge the composition (benchmarks/packed_runs.py
fit/traces/cpu_mla_heldout): shapes outside the campaign's (a DeepSeek-like query rank three times the key-value
rank, wider heads, a longer sequence, micro-batches of three), TP 4 + SP, PP 2 over four layers, no query latent,
selective recompute of core attention (never traced with MLA: composed from the plain layer), MoE layers, and
DeepSeek-style experts (grouped GEMMs, all-to-all over EP 4, top 3, with TP 2 + SP); each with MLA's fused RoPE (the
default) and with --no-rope-fusion.
Run: python fit/grids/make_cpu_mla_heldout.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import COMMON, mla_configs  # noqa: E402

# name: (world, ranks traced, flags set, flags dropped)
HELD_OUT = {
    "tp4_sp_s128_b1": (4, [0], {"--seq-length": 128, "--micro-batch-size": 1, "--hidden-size": 192,
                                "--num-attention-heads": 8, "--q-lora-rank": 96, "--kv-lora-rank": 32,
                                "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16,
                                "--ffn-hidden-size": 512, "--tensor-model-parallel-size": 4,
                                "--global-batch-size": 1}, ()),
    "pp2_l4_s80_b3": (2, [0, 1], {"--seq-length": 80, "--micro-batch-size": 3, "--hidden-size": 160,
                                  "--num-attention-heads": 4, "--q-lora-rank": 56, "--kv-lora-rank": 40,
                                  "--qk-head-dim": 24, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 24,
                                  "--num-layers": 4, "--pipeline-model-parallel-size": 2, "--global-batch-size": 12},
                      ("--tensor-model-parallel-size", "--sequence-parallel")),
    "w1_noq_s112_b2": (1, [0], {"--seq-length": 112, "--micro-batch-size": 2, "--hidden-size": 128,
                                "--num-attention-heads": 4, "--kv-lora-rank": 64, "--qk-head-dim": 32,
                                "--qk-pos-emb-head-dim": 16, "--v-head-dim": 32, "--global-batch-size": 2},
                       ("--q-lora-rank", "--tensor-model-parallel-size", "--sequence-parallel")),
    "tp2_sp_selective": (2, [0], {"--recompute-granularity": "selective"}, ()),
    "moe_w1": (1, [0], {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64,
                        "--global-batch-size": 2}, ("--tensor-model-parallel-size", "--sequence-parallel")),
    # DeepSeek-style experts: grouped GEMMs, the all-to-all dispatcher over EP 4, with TP 2 + SP
    "moe_gg_tp2_sp_ep4_s128": (8, [0], {"--seq-length": 128, "--micro-batch-size": 1, "--hidden-size": 192,
                                        "--num-attention-heads": 8, "--q-lora-rank": 96, "--kv-lora-rank": 32,
                                        "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16,
                                        "--ffn-hidden-size": 512, "--num-experts": 8, "--moe-router-topk": 3,
                                        "--moe-ffn-hidden-size": 96, "--moe-grouped-gemm": True,
                                        "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall",
                                        "--global-batch-size": 4}, ()),
}


def configs() -> list:
    base = next(c for c in mla_configs() if c["name"] == "mla_tp2_sp_s64_b2_h128_q48")
    out = []
    for prefix, rope in (("ho_mla", False), ("ho_mlarope", True)):
        for name, (world, ranks, changes, drop) in HELD_OUT.items():
            c = copy.deepcopy(base)
            c.update(name=f"{prefix}_{name}", nproc=world, ranks=ranks)
            c["set"] = {k: v for k, v in c["set"].items() if k not in drop}
            c["set"].update({k: v for k, v in changes.items() if v is not True})
            c["flags"] += [k for k, v in changes.items() if v is True]
            c["flags"] = [f for f in c["flags"] if f not in drop and not (rope and f == "--no-rope-fusion")]
            out.append(c)
    return out


if __name__ == "__main__":
    write_grid("cpu_mla_heldout", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
