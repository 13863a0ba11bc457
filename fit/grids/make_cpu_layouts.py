"""Writes fit/grids/cpu_layouts.json: parallel layouts larger than two processes, traced one rank at a time on
torch's fake process group (tracer/fake_world.py; the grid's `ranks`): TP 4 and 8 with sequence parallelism (heads
and query groups split down to one per rank), PP 4 with and without interleaving (first, a middle and the last
stage), TP x PP x DP with the distributed optimizer, MoE with EP 4 and 8 (all-to-all and allgather dispatchers,
with TP), in fp32 and bf16, each at two shapes. The CPU campaign (fit/grids/cpu_compose.json) has two processes at
most: these runs test how its programs carry to larger layouts, and can join a refit.
Run: python fit/grids/make_cpu_layouts.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402

COMMON = ["--max-position-embeddings", "256", "--make-vocab-size-divisible-by", "64", "--transformer-impl", "local",
          "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0", "--swiglu", "--normalization",
          "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights"]
# (seq, micro batch, hidden, heads, ffn, vocab): two shapes per layout
SHAPES = [(64, 2, 128, 8, 256, 512), (96, 1, 96, 8, 320, 384)]
MOE = {"--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64}
# name: (world, ranks traced, set, flags)
LAYOUTS = {
    "tp4_sp": (4, [0], {"--tensor-model-parallel-size": 4}, ["--sequence-parallel"]),
    "tp8_sp": (8, [0], {"--tensor-model-parallel-size": 8}, ["--sequence-parallel"]),
    "tp4_sp_gqa4": (4, [0], {"--tensor-model-parallel-size": 4, "--num-query-groups": 4},
                    ["--sequence-parallel", "--group-query-attention"]),
    "tp8_gqa2": (8, [0], {"--tensor-model-parallel-size": 8, "--num-query-groups": 2},
                 ["--group-query-attention"]),
    "pp4": (4, [0, 1, 3], {"--pipeline-model-parallel-size": 4, "--num-layers": 4}, []),
    "pp4_vpp2": (4, [0, 1, 3], {"--pipeline-model-parallel-size": 4, "--num-layers": 8,
                                "--num-layers-per-virtual-pipeline-stage": 1}, []),
    "tp2_pp2_dp2_do": (8, [0, 4], {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                                   "--num-layers": 4}, ["--sequence-parallel", "--use-distributed-optimizer"]),
    "ep4_a2a": (4, [0], {**MOE, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}, []),
    "ep8_ag": (8, [0], {**MOE, "--expert-model-parallel-size": 8, "--moe-token-dispatcher-type": "allgather"}, []),
    "tp2_ep4_a2a": (8, [0], {**MOE, "--tensor-model-parallel-size": 2, "--expert-model-parallel-size": 4,
                             "--moe-token-dispatcher-type": "alltoall"}, ["--sequence-parallel"]),
}
BF16 = ("tp4_sp", "pp4", "ep4_a2a")


def configs() -> list:
    out = []
    for name, (world, ranks, setf, flags) in LAYOUTS.items():
        for dtype in ("fp32", "bf16") if name in BF16 else ("fp32",):
            for s, b, h, a, f, v in SHAPES:
                pp = setf.get("--pipeline-model-parallel-size", 1)
                dp = world // (setf.get("--tensor-model-parallel-size", 1) * pp)
                sett = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h, "--num-attention-heads": a,
                        "--ffn-hidden-size": f, "--vocab-size": v, "--num-layers": 2,
                        "--global-batch-size": b * dp * (2 * pp if pp > 1 else 1), **setf}
                out.append({"name": f"{name}_{dtype}_s{s}_b{b}_h{h}", "set": sett,
                            "flags": flags + (["--bf16"] if dtype == "bf16" else []), "nproc": world,
                            "ranks": ranks})
    return out


if __name__ == "__main__":
    write_grid("cpu_layouts", doc_description(__doc__), "cpu", 2, COMMON, configs(), __file__)
