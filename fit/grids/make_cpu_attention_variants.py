"""Writes fit/grids/cpu_attention_variants.json: the standard attention's variants of the models people train now,
on Megatron-LM's default GPU kernels' CPU stand-ins (tracer/standins.py), each rank alone on torch's fake process
group, as fit/grids/make_cpu_gpu_kernels.py runs its layouts. The query's and key's norms as separate modules of
the attention: RMSNorm (--qk-layernorm, Qwen3's) over one process, TP 2 with and without SP and PP 2, and with MoE
layers (grouped GEMM over EP 4: all-to-all alone and with TP 2 + SP, allgather alone); megatron's parameter-free
L2 norm (--qk-l2-norm, Llama-4's) over one process, TP 2 with and without SP, PP 2 and with MoE layers (all-to-all
over EP 4); the attention output gate (--attention-output-gate, Qwen3-Next's: linear_qkv also projects a gate, the
attention's output times its sigmoid) with the RMSNorm over the same layouts, and without a norm over one process
and TP 2 + SP. Grouped-query attention throughout, heads, groups and head width
varied between shapes (head widths other than hidden / heads: --kv-channels, as Qwen3's); and multi-head
attention with the RMSNorm, with the gate and with both over one process and TP 2 + SP, with the L2 norm over one
process.
The L2 norm and the gate are megatron's torch.compile'd functions, compiled here by inductor for the CPU: the
saved tensors are the AOT partition's, which does not depend on the device.
Run: python fit/grids/make_cpu_attention_variants.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402
from fit.grids.make_cpu_gpu_kernels import (BASES, COMMON, GG, LAYOUTS, NO_SP_LAYOUTS,  # noqa: E402
                                            _config)

QK_LN = {**BASES["llama_gqa"], "--qk-layernorm": True}
QK_L2 = {**BASES["llama_gqa"], "--qk-l2-norm": True}
GATE = {"--attention-output-gate": True}
# (seq, micro batch, hidden, heads, ffn, vocab, head width: None for hidden / heads, query groups: None for the
# base's). The grouped-query shapes vary heads, groups and head width between them; the last of the first three
# has as many groups as heads (multi-head attention), and MHA_SHAPES vary heads and head width for the
# multi-head runs.
SHAPES = [(64, 2, 128, 8, 352, 512, 24, None), (96, 1, 96, 8, 256, 384, None, None),
          (48, 2, 64, 4, 320, 448, 40, None), (80, 2, 96, 6, 288, 448, 32, 2),
          # two groups: one per rank under TP 2, where the query is a view of the QKV projection, not a copy
          (56, 1, 112, 8, 304, 448, 20, 2), (40, 3, 80, 4, 224, 384, 28, 2)]
MHA_SHAPES = [(48, 2, 64, 4, 320, 448, 40, None), (32, 3, 160, 10, 416, 512, 16, None),
              (96, 1, 96, 8, 256, 384, None, None)]
MOE_LAYOUTS = {
    "ep4_a2a": (4, [0], {**GG, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "tp2_sp_ep4_a2a": (8, [0], {**GG, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "ep4_ag": (4, [0], {**GG, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "allgather"}),
}
DENSE = {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"], "pp2": LAYOUTS["pp2"]}
MHA = BASES["llama"]
PLAN = [("qkln", QK_LN, {**DENSE, "tp2": NO_SP_LAYOUTS["tp2"]}, SHAPES),
        ("qkln_moe", QK_LN, MOE_LAYOUTS, SHAPES),
        ("qkl2", QK_L2, {**DENSE, "tp2": NO_SP_LAYOUTS["tp2"]}, SHAPES),
        ("qkl2_moe", QK_L2, {"ep4_a2a": MOE_LAYOUTS["ep4_a2a"]}, SHAPES),
        ("gate_qkln", {**QK_LN, **GATE}, {**DENSE, "tp2": NO_SP_LAYOUTS["tp2"]}, SHAPES),
        ("gate_qkln_moe", {**QK_LN, **GATE}, {"ep4_a2a": MOE_LAYOUTS["ep4_a2a"]}, SHAPES),
        ("gate_mha", {**MHA, **GATE}, {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"]}, MHA_SHAPES),
        ("gate_gqa", {**BASES["llama_gqa"], **GATE}, {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"]}, SHAPES),
        ("qkln_mha", {**MHA, "--qk-layernorm": True}, {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"]},
         MHA_SHAPES),
        ("gate_qkln_mha", {**MHA, "--qk-layernorm": True, **GATE}, {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"]},
         MHA_SHAPES),
        ("qkl2_mha", {**MHA, "--qk-l2-norm": True}, {"w1": LAYOUTS["w1"]}, MHA_SHAPES)]


def configs() -> list:
    out = []
    for base, base_flags, layouts, shapes in PLAN:
        for layout, (world, ranks, lflags) in layouts.items():
            for s, b, h, a, f, v, d, g in shapes:
                st = lflags.get("--tensor-model-parallel-size", 1) if lflags.get("--sequence-parallel") else 1
                if (s * b // st) % lflags.get("--num-experts", 1):
                    continue    # balanced routing gives every expert the same count where E divides the tokens
                out.append(entry(f"{base}_{layout}_s{s}_b{b}_h{h}", (s, b, h, a, f, v), {**base_flags, **lflags},
                                 world, ranks, d, g))
    return out


def entry(name: str, shape: tuple, flags: dict, world: int, ranks: list, d=None, g=None) -> dict:
    """A grid entry (make_cpu_gpu_kernels._config) with a head width and a query-group count of its own."""
    c = _config(name, shape, flags, world, ranks)
    if d:
        c["set"]["--kv-channels"] = d
    if g:
        c["set"]["--num-query-groups"] = g
    return c

if __name__ == "__main__":
    write_grid("cpu_attention_variants", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
