"""Writes fit/grids/gpu_layouts.json: the layout campaign for one GPU (python -m fit.gpu_campaign --grid
fit/grids/gpu_layouts.json), each config's ranks traced one at a time on torch's fake process group
(tracer/fake_world.py; the grid's `ranks`), with the GPU's own kernels (stand-ins where Transformer Engine is
missing): TP 2, 4 and 8 with sequence parallelism, PP 2 and 4 (interleaved too), TP x PP x DP with the
distributed optimizer, MoE with EP 4 and 8 (all-to-all and allgather, with TP), in bf16 with fp16, fp32, selective
and full recompute toggled, on both bases of the GPU campaign (GPT-style and Llama-style), two shapes each.
Not yet run on a GPU.
Run: python fit/grids/make_gpu_layouts.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit.campaign import doc_description, write_grid  # noqa: E402
from make_gpu import COMMON  # noqa: E402

BASES = {"gpt": {}, "llama": {"--swiglu": True, "--normalization": "RMSNorm", "--position-embedding-type": "rope",
                              "--group-query-attention": True, "--num-query-groups": 4,
                              "--disable-bias-linear": True, "--untie-embeddings-and-output-weights": True}}
# (seq, micro batch, hidden, heads, ffn, vocab)
SHAPES = [(1024, 2, 1024, 16, 4096, 32000), (2048, 1, 1536, 16, 4096, 50304)]
MOE = {"--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 1024, "--moe-grouped-gemm": True}
SP = {"--sequence-parallel": True}
# name: (world, ranks, flags)
LAYOUTS = {
    "tp2": (2, [0], {"--tensor-model-parallel-size": 2, **SP}),
    "tp4": (4, [0], {"--tensor-model-parallel-size": 4, **SP}),
    "tp8": (8, [0], {"--tensor-model-parallel-size": 8, **SP}),
    "pp2": (2, [0, 1], {"--pipeline-model-parallel-size": 2, "--num-layers": 4}),
    "pp4_vpp2": (4, [0, 1, 3], {"--pipeline-model-parallel-size": 4, "--num-layers": 8,
                                "--num-layers-per-virtual-pipeline-stage": 1}),
    "tp2_pp2_dp2_do": (8, [0, 4], {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                                   "--num-layers": 4, "--use-distributed-optimizer": True, **SP}),
    "ep4_a2a": (4, [0], {**MOE, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "ep8_ag": (8, [0], {**MOE, "--expert-model-parallel-size": 8, "--moe-token-dispatcher-type": "allgather"}),
    "tp2_ep4_a2a": (8, [0], {**MOE, "--tensor-model-parallel-size": 2, "--expert-model-parallel-size": 4,
                             "--moe-token-dispatcher-type": "alltoall", **SP}),
}
# toggles on some layouts: (name, flags to add, flags to remove)
TOGGLES = {"tp4": [("fp16", {"--fp16": True}, ("--bf16",)), ("fp32", {}, ("--bf16",)),
                   ("selective", {"--recompute-granularity": "selective"}, ())],
           "pp2": [("full", {"--recompute-granularity": "full", "--recompute-method": "uniform",
                             "--recompute-num-layers": 1}, ())]}


def configs() -> list:
    out = []
    for layout, (world, ranks, flags) in LAYOUTS.items():
        variants = [("", {}, ())] + TOGGLES.get(layout, [])
        for base, base_flags in BASES.items():
            if layout.startswith(("ep", "tp2_ep")) and base == "gpt":
                continue        # MoE on the Llama base only (no biases: megatron-core's grouped GEMM has none)
            for vname, add, drop in variants:
                for s, b, h, a, f, v in SHAPES:
                    pp = flags.get("--pipeline-model-parallel-size", 1)
                    tp = flags.get("--tensor-model-parallel-size", 1)
                    dp = world // (tp * pp)
                    sett = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h,
                            "--num-attention-heads": a, "--ffn-hidden-size": f, "--vocab-size": v,
                            "--global-batch-size": b * dp * (2 * pp if pp > 1 else 1)}
                    allf = {**base_flags, **flags, **add}
                    for k, val in allf.items():
                        if val is not True:
                            sett[k] = val
                    switches = [k for k, val in allf.items() if val is True]
                    name = f"{base}_{layout}{'_' + vname if vname else ''}_s{s}_b{b}_h{h}"
                    cfg = {"name": name, "set": sett, "flags": switches, "nproc": world, "ranks": ranks}
                    if drop:
                        cfg["unset"] = list(drop)
                    out.append(cfg)
    return out


if __name__ == "__main__":
    write_grid("gpu_layouts", doc_description(__doc__), "cuda", 3, COMMON, configs(), __file__)
