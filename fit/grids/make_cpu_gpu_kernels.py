"""Writes fit/grids/cpu_gpu_kernels.json: Megatron-LM's default GPU kernels on their CPU stand-ins (tracer/standins.py:
Transformer Engine's spec, flash attention, the fused bias-activation, RoPE and bias-dropout-add, 1-byte dropout
masks) across parallel layouts, each rank traced alone on torch's fake process group (tracer/fake_world.py), whose
collectives hand megatron-core's tensors on as NCCL does: one process (world 1), TP 2 and TP 4 with sequence
parallelism, PP 2 (both stages), and TP 2 x PP 2 x DP 2 with the distributed optimizer (a first and a last stage);
MoE (8 experts, top 2, grouped-query attention) over EP 4 with the all-to-all dispatcher (alone, with TP 2 + SP,
on both stages of PP 2) and with the allgather one, and over EP 8 (one expert per rank); and TP without sequence
parallelism (Megatron's default: TP 2, TP 4, TP 2 x PP 2) on the GQA Llama-style and the GPT-style bases; and MoE
experts as Transformer Engine's grouped GEMM (--moe-grouped-gemm) on the MoE layouts above and on a GPT-style MoE
base with the allgather dispatcher (alone over EP 4, with TP 2 + SP over EP 2 and EP 4); and Transformer Engine's
unfused attention backend (GPT-style with an fp32 softmax: one process, PP 2, TP 2 with and without SP; GQA
Llama-style: one process, TP 2 + SP); and the local spec with the GPU's kernels (torch's norms as CUDA runs them) on
the GQA Llama-style and GPT-style bases over one process, TP 2 with and without SP and PP 2, and with MoE; and the
fused cross entropy (--cross-entropy-loss-fusion) on the same two bases and layouts.
Three bases: Llama-style with multi-head and with grouped-query attention (no dropout), and GPT-style (LayerNorm,
GELU, biases, tied embeddings, dropout 0.1), all bf16; the GPT-style one without dropout on one process, TP 2 + SP
and PP 2, and in fp16 (its loss scale starting at 4096) on one process and TP 2 x PP 2 x DP 2; three shapes each, with
micro-batches of one sequence and of two. The campaigns before this one ran the stand-ins on one or two gloo
processes with the fusions toggled one at a time; these are the combinations a GPU user runs by default. And
squared-ReLU MLPs (--squared-relu, eager on a GPU too): Nemotron-style (the GQA Llama-style base with LayerNorm and
squared-ReLU) over one process, TP 2 + SP and PP 2, and GPT-style with biases (--no-bias-gelu-fusion, which
megatron-core requires with a bias) over one process. And multi-latent attention (DeepSeek-style, with its latent
norms) with unfused RoPE over one process, TP 2 with and without SP and PP 2, five shapes each (two without a query
latent), and in fp32 (TE's unfused attention) over one process; and with MLA's fused RoPE over one process, TP 2 +
SP and PP 2; and DeepSeek-style MoE layers with MLA over one process and TP 2 + SP, and as grouped GEMMs with the
all-to-all dispatcher over EP 4, alone and with TP 2 + SP.
Run: python fit/grids/make_cpu_gpu_kernels.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402

COMMON = ["--max-position-embeddings", "256", "--make-vocab-size-divisible-by", "64", "--transformer-impl",
          "transformer_engine", "--seed", "1234"]
LLAMA = {"--swiglu": True, "--normalization": "RMSNorm", "--position-embedding-type": "rope",
         "--disable-bias-linear": True, "--untie-embeddings-and-output-weights": True, "--hidden-dropout": 0,
         "--attention-dropout": 0, "--bf16": True}
BASES = {
    "llama": LLAMA,
    "llama_gqa": {**LLAMA, "--group-query-attention": True, "--num-query-groups": 4},
    "gpt": {"--hidden-dropout": 0.1, "--attention-dropout": 0.1, "--bf16": True},
    "gpt_nodrop": {"--hidden-dropout": 0, "--attention-dropout": 0, "--bf16": True},
    # fp16 starts its dynamic loss scale at 4096, not 2**32: from 2**32 the scaler skips every step of a short run
    # (its gradients overflow), and a run that never steps holds no optimizer state (fit.dataset refuses it)
    "gpt_fp16": {"--hidden-dropout": 0.1, "--attention-dropout": 0.1, "--fp16": True, "--initial-loss-scale": 4096},
}
# (seq, micro batch, hidden, heads, ffn, vocab)
SHAPES = [(64, 2, 128, 8, 352, 512), (96, 1, 96, 8, 256, 384), (48, 1, 128, 8, 320, 448)]
# name: (world, ranks traced, flags)
LAYOUTS = {
    "w1": (1, [0], {}),
    "tp2_sp": (2, [0], {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}),
    "tp4_sp": (4, [0], {"--tensor-model-parallel-size": 4, "--sequence-parallel": True}),
    "pp2": (2, [0, 1], {"--pipeline-model-parallel-size": 2, "--num-layers": 4}),
    "tp2_pp2_dp2_do": (8, [0, 4], {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                                   "--num-layers": 4, "--sequence-parallel": True,
                                   "--use-distributed-optimizer": True}),
}
MOE = {"--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64}
# MoE layouts, on the Llama-style base with grouped-query attention only (Mixtral's, GPT-OSS's and Qwen3's shape):
# the all-to-all dispatcher over EP 4 alone, with TP 2 + SP, and on both stages of PP 2, and over EP 8 (one expert
# per rank); the allgather dispatcher over EP 4
MOE_LAYOUTS = {
    "ep4_a2a": (4, [0], {**MOE, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "tp2_sp_ep4_a2a": (8, [0], {**MOE, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "pp2_ep4_a2a": (8, [0, 4], {**MOE, "--pipeline-model-parallel-size": 2, "--num-layers": 4,
                                "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "alltoall"}),
    "ep4_ag": (4, [0], {**MOE, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "allgather"}),
    "ep8_a2a": (8, [0], {**MOE, "--expert-model-parallel-size": 8, "--moe-token-dispatcher-type": "alltoall"}),
}
# Tensor parallelism without sequence parallelism (Megatron's default: --sequence-parallel is opt-in): each TP rank
# holds the full sequence, its column-parallel inputs need no all-gather and its row-parallel outputs are all-reduced
# in place. On the GQA Llama-style and the GPT-style bases (the latter is the shape of Megatron-LM's own TP tests).
NO_SP_LAYOUTS = {
    "tp2": (2, [0], {"--tensor-model-parallel-size": 2}),
    "tp4": (4, [0], {"--tensor-model-parallel-size": 4}),
    "tp2_pp2": (4, [0, 2], {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
                            "--num-layers": 4}),
}

# MoE experts as Transformer Engine's grouped GEMM (--moe-grouped-gemm: TEGroupedMLP, what Megatron-LM's MoE recipes
# and its own MoE tests run) rather than SequentialMLP: on the GQA Llama-style base over the layouts above, and on
# a GPT-style MoE base (no linear biases: TEGroupedMLP refuses biases under the fused bias-dropout-add; GELU unfused:
# it fuses only SwiGLU and quick-GEGLU) with the allgather dispatcher alone, with TP 2 + SP over EP 2 and over EP 4.
GG = {**MOE, "--moe-grouped-gemm": True}
# The grouped-GEMM runs vary the experts, top-k and expert FFN width too (the runs before kept 8, 2 and 64): a size
# of the experts' programs is then pinned in each of them, not fitted where they never moved. One per shape slot,
# independent of the shape itself (the shapes rotate from layout to layout, these do not). Balanced routing gives
# every expert the same count only where E divides a rank's tokens (s*b/st): elsewhere the first variant is used.
GG_VARIANTS = ({"--num-experts": 8, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64},
               {"--num-experts": 16, "--moe-router-topk": 4, "--moe-ffn-hidden-size": 96},
               {"--num-experts": 8, "--moe-router-topk": 4, "--moe-ffn-hidden-size": 48})
MOE_GG_LAYOUTS = {f"{name}_gg": (world, ranks, {**flags, "--moe-grouped-gemm": True})
                  for name, (world, ranks, flags) in MOE_LAYOUTS.items()}
GPT_MOE = {**BASES["gpt"], "--disable-bias-linear": True, "--no-bias-gelu-fusion": True}
GPT_MOE_GG_LAYOUTS = {
    "ep4_ag_gg": (4, [0], {**GG, "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "allgather"}),
    "tp2_sp_ep2_ag_gg": (4, [0], {**GG, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                  "--expert-model-parallel-size": 2, "--moe-token-dispatcher-type": "allgather"}),
    "tp2_sp_ep4_ag_gg": (8, [0], {**GG, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
                                  "--expert-model-parallel-size": 4, "--moe-token-dispatcher-type": "allgather"}),
}

# Transformer Engine's unfused attention backend (--attention-backend unfused, as several of Megatron-LM's own tests
# run; TE's choice for fp32): its scores are a new tensor per call (the `scores` switch), on the GPT-style base with
# the fp32 softmax those tests ask for, and on the GQA Llama-style base (k and v repeated per head).
UNFUSED = {"--attention-backend": "unfused"}
UNFUSED_BASES = {"gpt_unf": {**BASES["gpt"], **UNFUSED, "--attention-softmax-in-fp32": True},
                 "llama_gqa_unf": {**BASES["llama_gqa"], **UNFUSED}}
UNFUSED_LAYOUTS = {"gpt_unf": ("w1", "pp2", "tp2_sp"), "llama_gqa_unf": ("w1", "tp2_sp")}

# The local spec (--transformer-impl local: megatron's own modules, torch's LayerNorm and RMSNorm) with the GPU's
# kernels: the norms as CUDA runs them (the `torch_norm` switch), the fused masked softmax, bias-activation, RoPE and
# bias-dropout-add; on the GQA Llama-style and GPT-style bases over one process, TP 2 with and without SP and PP 2,
# and with MoE (Llama-style: all-to-all over EP 4; GPT-style, as Megatron-LM's local-spec MoE test: the allgather
# dispatcher with TP 2 + SP over EP 2).
LOCAL = {"--transformer-impl": "local"}
LOCAL_LAYOUTS = {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"], "pp2": LAYOUTS["pp2"], "tp2": NO_SP_LAYOUTS["tp2"]}
LOCAL_MOE_LAYOUTS = {"llama_moe_local": {"ep4_a2a": MOE_LAYOUTS["ep4_a2a"]},
                     "gpt_moe_local": {"tp2_sp_ep2_ag": (4, [0], {**MOE, "--tensor-model-parallel-size": 2,
                                                                  "--sequence-parallel": True,
                                                                  "--expert-model-parallel-size": 2})}}

# --cross-entropy-loss-fusion (impl native, what Megatron-LM's fused-loss tests run): megatron's compiled kernels on
# their stand-in, on the GQA Llama-style and GPT-style bases over one process, TP 2 with and without SP and PP 2
# (the loss on the last stage).
CE = {"--cross-entropy-loss-fusion": True}
CE_LAYOUTS = {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"], "pp2": LAYOUTS["pp2"], "tp2": NO_SP_LAYOUTS["tp2"]}


def squared_relu_configs(cfgs: list) -> list:
    """Squared-ReLU twins of configs above, their shapes and flags otherwise as they are: the GQA Llama-style base
    with LayerNorm (Nemotron's) over one process, TP 2 + SP and PP 2, and the GPT-style base over one process."""
    by = {c["name"]: c for c in cfgs}
    out = []
    for src, dst, layouts in (("llama_gqa", "nemo_sqrelu", ("w1", "tp2_sp", "pp2")), ("gpt", "gpt_sqrelu", ("w1",))):
        for layout in layouts:
            for s, b, h, *_ in SHAPES:
                c = copy.deepcopy(by[f"{src}_{layout}_s{s}_b{b}_h{h}"])
                c["name"] = f"{dst}_{layout}_s{s}_b{b}_h{h}"
                if src == "llama_gqa":
                    c["set"]["--normalization"] = "LayerNorm"
                    c["flags"] = ["--squared-relu" if f == "--swiglu" else f for f in c["flags"]]
                else:   # with linear biases megatron-core refuses any fused bias-activation but gelu and swiglu
                    c["flags"] += ["--squared-relu", "--no-bias-gelu-fusion"]
                out.append(c)
    return out


# Multi-latent attention (DeepSeek-V2/V3's): the Llama-style base with --multi-latent-attention and the latents'
# norms (--qk-layernorm, as DeepSeek's configs), with unfused RoPE (--no-rope-fusion) and with MLA's fused YaRN
# RoPE (Megatron-LM's default; its Triton kernels on CPU stand-ins).
# Shapes vary every width on its own: (seq, micro batch, hidden, heads, q rank (0: no query latent), kv rank, plain
# head, rotary head, value head, ffn, vocab).
MLA = {**LLAMA, "--multi-latent-attention": True, "--qk-layernorm": True, "--no-rope-fusion": True}
MLA_SHAPES = [(64, 2, 128, 8, 48, 32, 16, 8, 16, 352, 512), (96, 1, 96, 4, 40, 24, 24, 16, 12, 256, 384),
              (48, 2, 64, 4, 32, 48, 8, 8, 24, 320, 448), (32, 1, 128, 8, 0, 16, 16, 4, 8, 352, 512),
              (64, 2, 96, 4, 0, 40, 12, 8, 20, 256, 384), (48, 2, 160, 4, 0, 24, 20, 8, 12, 320, 448),
              (80, 1, 64, 8, 0, 32, 8, 4, 16, 256, 384)]
# MLA with MoE layers (DeepSeek's): the first three shapes, 4 experts, top 2, over one process and TP 2 + SP.
MLA_MOE = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 64}
# and as DeepSeek trains them: Transformer Engine's grouped GEMM with the all-to-all dispatcher over EP 4, alone and
# with TP 2 + SP (8 experts, top 2)
MLA_MOE_GG_LAYOUTS = {name: (world, ranks, {**flags, **GG}) for name, (world, ranks, flags) in MOE_LAYOUTS.items()
                      if name in ("ep4_a2a", "tp2_sp_ep4_a2a")}
MLA_LAYOUTS = {"w1": LAYOUTS["w1"], "tp2_sp": LAYOUTS["tp2_sp"], "tp2": NO_SP_LAYOUTS["tp2"], "pp2": LAYOUTS["pp2"]}


def mla_configs() -> list:
    """Multi-latent attention with unfused RoPE over one process, TP 2 with and without SP and PP 2 (both stages),
    every MLA_SHAPES shape on each, and in fp32 with TE's unfused attention backend (its choice in fp32) over one
    process; with the fused RoPE over one process, TP 2 + SP and PP 2; and with MoE layers (the first three shapes)
    over one process and TP 2 + SP, and as grouped GEMMs with the all-to-all dispatcher over EP 4, alone and with
    TP 2 + SP."""
    out = []
    fused = {k: v for k, v in MLA.items() if k != "--no-rope-fusion"}
    plan = [(f"mla_{name}", MLA, lay) for name, lay in MLA_LAYOUTS.items()] + \
        [("mla_fp32_w1", {k: v for k, v in MLA.items() if k != "--bf16"}, LAYOUTS["w1"])] + \
        [(f"mla_rope_{name}", fused, MLA_LAYOUTS[name]) for name in ("w1", "tp2_sp", "pp2")] + \
        [(f"mla_moe_{name}", {**fused, **MLA_MOE}, MLA_LAYOUTS[name]) for name in ("w1", "tp2_sp")] + \
        [(f"mla_moe_{name}", fused, lay) for name, lay in MLA_MOE_GG_LAYOUTS.items()]
    for base, base_flags, (world, ranks, lflags) in plan:
        flags = {**base_flags, **lflags}
        tp = flags.get("--tensor-model-parallel-size", 1)
        pp = flags.get("--pipeline-model-parallel-size", 1)
        dp = world // (tp * pp)
        for s, b, h, a, ql, kl, dq, dr, dv, f, v in MLA_SHAPES[:3] if "--num-experts" in flags else MLA_SHAPES:
            sett = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h, "--num-attention-heads": a,
                    "--kv-lora-rank": kl, "--qk-head-dim": dq, "--qk-pos-emb-head-dim": dr, "--v-head-dim": dv,
                    "--ffn-hidden-size": f, "--vocab-size": v, "--num-layers": 2,
                    "--global-batch-size": b * dp * (2 * pp if pp > 1 else 1),
                    **({"--q-lora-rank": ql} if ql else {}),
                    **{key: val for key, val in flags.items() if val is not True}}
            out.append({"name": f"{base}_s{s}_b{b}_h{h}_q{ql}", "set": sett,
                        "flags": [key for key, val in flags.items() if val is True],
                        "nproc": world, "ranks": ranks, "launcher": ["--gpu-kernels"]})
    return out


# Multi-token prediction (DeepSeek-V3's, one MTP layer: --mtp-num-layers 1, as Megatron-LM's MTP tests): its block
# on the loss's stage (the embedding of the shifted tokens, two norms, the projection of both joined, a transformer
# layer, a norm) and the MTP loss head before the main one. On the Llama-style base over one process and TP 2 + SP,
# with grouped-query attention over TP 2 without SP and PP 2 (both stages), in fp32 with TE's unfused attention,
# with the fused cross entropy; on the GPT-style base (tied, learned positions, dropout, biases) over one process,
# TP 2 + SP and PP 2, and on the local spec; and on DeepSeek-style layers: MLA, alone and with grouped-GEMM experts
# over EP 4 with TP 2 + SP.
MTP = {"--mtp-num-layers": 1}
MTP_PLAN = [("llama", BASES["llama"], ("w1", "tp2_sp")), ("llama_gqa", BASES["llama_gqa"], ("tp2", "pp2")),
            ("llama_fp32", {**{k: v for k, v in BASES["llama"].items() if k != "--bf16"}, **UNFUSED}, ("w1",)),
            ("llama_cefusion", {**BASES["llama"], **CE}, ("w1", "tp2_sp")),
            ("gpt", BASES["gpt"], ("w1", "tp2_sp", "pp2")),
            ("gpt_local", {**BASES["gpt"], **LOCAL}, ("w1",))]


def mtp_configs() -> list:
    """MTP_PLAN's layouts at every SHAPES shape (two on the one-process variants), and MLA's: dense over one
    process and with grouped-GEMM experts (all-to-all over EP 4, TP 2 + SP) at the first three MLA shapes."""
    all_layouts = {**LAYOUTS, **NO_SP_LAYOUTS}
    plan = [(f"mtp_{base}_{name}", {**flags, **all_layouts[name][2]}, all_layouts[name][:2],
             SHAPES if len(names) > 1 else SHAPES[:2]) for base, flags, names in MTP_PLAN for name in names]
    out = [_config(f"{base}_s{s}_b{b}_h{h}", shape, {**flags, **MTP}, world, ranks)
           for base, flags, (world, ranks), shapes in plan for shape in shapes for s, b, h, *_ in [shape]]
    fused = {k: v for k, v in MLA.items() if k != "--no-rope-fusion"}
    for base, flags, (world, ranks, lflags) in (("mtp_mla_w1", fused, LAYOUTS["w1"]),
                                                ("mtp_mla_moe_tp2_sp_ep4_a2a", fused,
                                                 MLA_MOE_GG_LAYOUTS["tp2_sp_ep4_a2a"])):
        flags = {**flags, **lflags}
        tp = flags.get("--tensor-model-parallel-size", 1)
        for s, b, h, a, ql, kl, dq, dr, dv, f, v in MLA_SHAPES[:3]:
            sett = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h, "--num-attention-heads": a,
                    "--kv-lora-rank": kl, "--qk-head-dim": dq, "--qk-pos-emb-head-dim": dr, "--v-head-dim": dv,
                    "--ffn-hidden-size": f, "--vocab-size": v, "--num-layers": 2,
                    "--global-batch-size": b * world // tp, "--q-lora-rank": ql,
                    **{key: val for key, val in {**flags, **MTP}.items() if val is not True}}
            out.append({"name": f"{base}_s{s}_b{b}_h{h}_q{ql}", "set": sett,
                        "flags": [key for key, val in flags.items() if val is True],
                        "nproc": world, "ranks": ranks, "launcher": ["--gpu-kernels"]})
    return out


def _config(name: str, shape: tuple, flags: dict, world: int, ranks: list) -> dict:
    """One grid entry of a SHAPES shape: two layers, one micro-batch per data-parallel rank (two per stage under
    PP); valued flags in `set`, switches (True) in `flags`."""
    s, b, h, a, f, v = shape
    tp = flags.get("--tensor-model-parallel-size", 1)
    pp = flags.get("--pipeline-model-parallel-size", 1)
    dp = world // (tp * pp)
    sett = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h, "--num-attention-heads": a,
            "--ffn-hidden-size": f, "--vocab-size": v, "--num-layers": 2,
            "--global-batch-size": b * dp * (2 * pp if pp > 1 else 1),
            **{key: val for key, val in flags.items() if val is not True}}
    return {"name": name, "set": sett, "flags": [key for key, val in flags.items() if val is True],
            "nproc": world, "ranks": ranks, "launcher": ["--gpu-kernels"]}


def configs() -> list:
    out = []
    k = 0
    # fp16 on two layouts: its programs are bf16's (2-byte elements); its loss scaler is static memory
    # without dropout on three layouts: the programs of a layer without dropout have other events
    few = {"gpt_fp16": ("w1", "tp2_pp2_dp2_do"), "gpt_nodrop": ("w1", "tp2_sp", "pp2")}
    plan = [(b, f, {name: LAYOUTS[name] for name in few[b]} if b in few else LAYOUTS) for b, f in BASES.items()] + \
        [("llama_moe", BASES["llama_gqa"], MOE_LAYOUTS)] + \
        [(b, BASES[b], NO_SP_LAYOUTS) for b in ("llama_gqa", "gpt")] + \
        [("llama_moe", BASES["llama_gqa"], MOE_GG_LAYOUTS), ("gpt_moe", GPT_MOE, GPT_MOE_GG_LAYOUTS)] + \
        [(b, f, {name: LAYOUTS[name] for name in UNFUSED_LAYOUTS[b]}) for b, f in UNFUSED_BASES.items()] + \
        [("gpt_unf", UNFUSED_BASES["gpt_unf"], {"tp2": NO_SP_LAYOUTS["tp2"]})] + \
        [(f"{b}_local", {**BASES[b], **LOCAL}, LOCAL_LAYOUTS) for b in ("llama_gqa", "gpt")] + \
        [("llama_moe_local", {**BASES["llama_gqa"], **LOCAL}, LOCAL_MOE_LAYOUTS["llama_moe_local"]),
         ("gpt_moe_local", {**GPT_MOE, **LOCAL}, LOCAL_MOE_LAYOUTS["gpt_moe_local"])] + \
        [(f"{b}_cefusion", {**BASES[b], **CE}, CE_LAYOUTS) for b in ("llama_gqa", "gpt")]
    # (each group appended after the ones before it, which keep their shapes)
    for base, base_flags, layouts in plan:
        for layout, (world, ranks, lflags) in layouts.items():
            flags = {**base_flags, **lflags}
            for j in range(len(SHAPES)):
                s, b, h, a, f, v = SHAPES[(k + j) % len(SHAPES)]
                if flags.get("--moe-grouped-gemm"):
                    st = flags.get("--tensor-model-parallel-size", 1) if flags.get("--sequence-parallel") else 1
                    var = GG_VARIANTS[j]
                    flags = {**flags, **(var if (s * b // st) % var["--num-experts"] == 0 else GG_VARIANTS[0])}
                out.append(_config(f"{base}_{layout}_s{s}_b{b}_h{h}", (s, b, h, a, f, v), flags, world, ranks))
            k += 1
    return out + squared_relu_configs(out) + mla_configs() + mtp_configs()


if __name__ == "__main__":
    write_grid("cpu_gpu_kernels", doc_description(__doc__), "cpu", 3, COMMON, configs(), __file__)
