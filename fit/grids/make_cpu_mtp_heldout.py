"""Writes fit/grids/cpu_mtp_heldout.json: multi-token prediction configs the program fit never sees, on the GPU
kernels' CPU stand-ins (fake process group), to judge the composition (benchmarks/packed_runs.py
fit/traces/cpu_mtp_heldout): shapes outside the campaign's (a longer sequence, micro-batches of three, wider and
narrower heads), TP 4 + SP, PP 2 over six layers with grouped-query attention, the last of PP 4 x 2 virtual stages,
the distributed optimizer over TP 2 x PP 2 x DP 2, selective and full recompute (composed from the plain layer), the
fused cross entropy on the tied GPT-style base, and DeepSeek-style layers (MLA, a dense first layer, grouped-GEMM
experts top 3 over EP 4 with TP 2 + SP).
Run: python fit/grids/make_cpu_mtp_heldout.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import COMMON, mtp_configs  # noqa: E402

SHAPE = ("--seq-length", "--micro-batch-size", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
         "--vocab-size")
# name: (campaign config it changes, world, ranks traced, flags set, flags added)
HELD_OUT = {
    "llama_tp4_sp_s128_b1": ("mtp_llama_tp2_sp_s64_b2_h128", 4, [0],
                             dict(zip(SHAPE, (128, 1, 192, 8, 512, 640)), **{"--tensor-model-parallel-size": 4}), ()),
    "llama_gqa_pp2_l6_s80_b3": ("mtp_llama_gqa_pp2_s64_b2_h128", 2, [0, 1],
                            dict(zip(SHAPE, (80, 3, 160, 4, 448, 448)), **{"--num-layers": 6,
                                                                           "--global-batch-size": 12}), ()),
    "llama_selective_s72_b2": ("mtp_llama_w1_s64_b2_h128", 1, [0],
                               dict(zip(SHAPE, (72, 2, 112, 8, 320, 512)), **{"--recompute-granularity":
                                                                              "selective"}), ()),
    "gpt_tp2_pp2_dp2_do_s112_b2": ("mtp_gpt_pp2_s64_b2_h128", 8, [0, 4],
                                   dict(zip(SHAPE, (112, 2, 128, 8, 384, 576)),
                                        **{"--tensor-model-parallel-size": 2, "--global-batch-size": 8}),
                                   ("--sequence-parallel", "--use-distributed-optimizer")),
    "gpt_cefusion_s128_b2": ("mtp_gpt_w1_s64_b2_h128", 1, [0], dict(zip(SHAPE, (128, 2, 96, 4, 256, 640))),
                             ("--cross-entropy-loss-fusion",)),
    # the last of PP 4 x 2 virtual stages (MTP on the model's last chunk), one layer per chunk
    "llama_gqa_pp4_vpp2_last_s96_b2": ("mtp_llama_gqa_pp2_s64_b2_h128", 4, [3],
                                       dict(zip(SHAPE, (96, 2, 128, 8, 352, 512)),
                                            **{"--pipeline-model-parallel-size": 4, "--num-layers": 8,
                                               "--num-layers-per-virtual-pipeline-stage": 1,
                                               "--global-batch-size": 16}), ()),
    # full recompute: MTP's layer is checkpointed too (uniform, one layer; composed without that checkpoint)
    "llama_full_s80_b2": ("mtp_llama_w1_s64_b2_h128", 1, [0],
                          dict(zip(SHAPE, (80, 2, 96, 4, 256, 448)), **{"--recompute-granularity": "full",
                                                                        "--recompute-method": "uniform",
                                                                        "--recompute-num-layers": 1}), ()),
    "mla_moe_tp2_sp_ep4_s128": ("mtp_mla_moe_tp2_sp_ep4_a2a_s64_b2_h128_q48", 8, [0],
                                {"--seq-length": 128, "--micro-batch-size": 1, "--hidden-size": 192,
                                 "--num-attention-heads": 8, "--q-lora-rank": 96, "--kv-lora-rank": 32,
                                 "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16,
                                 "--ffn-hidden-size": 512, "--moe-router-topk": 3, "--moe-ffn-hidden-size": 96,
                                 "--moe-layer-freq": "[0,1]", "--global-batch-size": 4}, ()),
}


def configs() -> list:
    base = {c["name"]: c for c in mtp_configs()}
    out = []
    for name, (src, world, ranks, changes, added) in HELD_OUT.items():
        c = copy.deepcopy(base[src])
        c.update(name=f"ho_mtp_{name}", nproc=world, ranks=ranks)
        c["set"].update(changes)
        c["flags"] += [f for f in added if f not in c["flags"]]
        out.append(c)
    return out


if __name__ == "__main__":
    write_grid("cpu_mtp_heldout", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
