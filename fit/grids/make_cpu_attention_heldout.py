"""Writes fit/grids/cpu_attention_heldout.json: configs with the attention variants of
fit/grids/make_cpu_attention_variants.py that the program fit never sees, on the same GPU kernels' stand-ins (fake
process group), to judge the composition (benchmarks/packed_runs.py fit/traces/cpu_attention_heldout): shapes
outside the campaign's (longer sequences, micro-batches of three, wider heads, 12 heads in 4 groups), TP 4 + SP,
TP 2 without SP, PP 2 over four layers, selective and full recompute (never fitted: composed from the plain layer),
and MoE layers with grouped GEMMs over EP 4 (top 3 of 12, all-to-all with TP 2 + SP).
Run: python fit/grids/make_cpu_attention_heldout.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_attention_variants import GATE, QK_L2, QK_LN, entry  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import COMMON  # noqa: E402

TP4_SP = {"--tensor-model-parallel-size": 4, "--sequence-parallel": True}
PP2 = {"--pipeline-model-parallel-size": 2, "--num-layers": 4}
MOE = {"--num-experts": 12, "--moe-router-topk": 3, "--moe-ffn-hidden-size": 80, "--moe-grouped-gemm": True,
       "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}
# name: (base flags, layout flags, world, ranks traced, (seq, micro batch, hidden, heads, ffn, vocab), head width)
HELD_OUT = {
    "ho_qkln_tp4_sp_s128_b1": (QK_LN, TP4_SP, 4, [0], (128, 1, 192, 12, 512, 640), 32),
    "ho_qkln_pp2_s80_b3": (QK_LN, PP2, 2, [0, 1], (80, 3, 160, 8, 448, 512), None),
    "ho_qkln_selective_s112_b2": (QK_LN, {"--recompute-granularity": "selective"}, 1, [0],
                                  (112, 2, 128, 8, 384, 512), 40),
    "ho_qkln_moe_tp2_sp_ep4_s96_b2": (QK_LN, {**MOE, "--tensor-model-parallel-size": 2, "--sequence-parallel": True},
                                      8, [0], (96, 2, 160, 8, 448, 512), 32),
    "ho_qkl2_tp2_s80_b2": (QK_L2, {"--tensor-model-parallel-size": 2}, 2, [0], (80, 2, 160, 8, 448, 512), None),
    "ho_qkl2_moe_ep4_s96_b2": (QK_L2, MOE, 4, [0], (96, 2, 128, 8, 384, 512), 24),
    "ho_gate_qkln_tp4_sp_s128_b1": ({**QK_LN, **GATE}, TP4_SP, 4, [0], (128, 1, 192, 12, 512, 640), 32),
    "ho_gate_qkln_pp2_s80_b3": ({**QK_LN, **GATE}, PP2, 2, [0, 1], (80, 3, 160, 8, 448, 512), None),
    "ho_gate_qkln_moe_tp2_sp_ep4_s96_b2": ({**QK_LN, **GATE}, {**MOE, "--tensor-model-parallel-size": 2,
                                                               "--sequence-parallel": True},
                                           8, [0], (96, 2, 128, 8, 384, 512), 40),
    "ho_gate_qkln_full_s112_b2": ({**QK_LN, **GATE}, {"--recompute-granularity": "full", "--recompute-method": "uniform",
                                                      "--recompute-num-layers": 1}, 1, [0],
                                  (112, 2, 128, 8, 384, 512), 40),
}


def configs() -> list:
    return [entry(name, shape, {**base, **layout}, world, ranks, d)
            for name, (base, layout, world, ranks, shape, d) in HELD_OUT.items()]


if __name__ == "__main__":
    write_grid("cpu_attention_heldout", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
