"""Writes modelled.json: the hand-derived ("modelled") formula set. Run: python -m estimator.formula_sets.build_modelled

Terms are written compactly as "coef var var^exp ..." (e.g. "1 e s b h st^-1" = e*s*b*h/st bytes).
Per-rank shorthand used in comments: H = s*b*h/st (sequence-sharded hidden), Q = s*b*(a+2g)*d/t (qkv output),
A = s*b*a*d/t (attention context), S2 = a*s*s*b/t (scores), T = s*b/st tokens, R = T*k*etp rows at the experts.
Attribution follows allocation (what the tracer measures): a tensor belongs to the op whose forward allocated it.
"""
import json
import os
from fractions import Fraction

H = "1 e s b h st^-1"
HS = "8 s b st^-1"          # LayerNorm mean + rstd, fp32
HR = "4 s b st^-1"          # RMSNorm rstd, fp32
FULLH = "1 e s b h"           # an all-gathered / pre-reduce-scatter hidden (sequence not sharded)
Q = ["1 e s b a d t^-1", "2 e s b g d t^-1"]
A = "1 e s b a d t^-1"
S2 = "a s^2 b t^-1"          # times a byte count
LOGITS = "s b v t^-1"


def term(txt):
    coef, *vs = txt.split()
    out = {}
    assert not coef[0].isalpha(), txt
    for v in vs:
        name, _, exp = v.partition("^")
        out[name] = out.get(name, 0) + int(exp or 1)
    c = Fraction(coef)
    return {"coef": str(c) if c.denominator != 1 else int(c), "vars": out}


def mul(k, txt):
    c, rest = txt.split(" ", 1)
    return f"{Fraction(c) * k} {rest}"


FORMULAS = []


def add(op, per="layer", when=None, saved=(), fwd=(), bwd=(), note=None):
    fo = {"op": op, "per": per, "when": dict(when or {}),
          "saved": [term(t) for t in saved], "fwd_peak": [term(t) for t in fwd], "bwd_peak": [term(t) for t in bwd]}
    if note:
        fo["note"] = note
    FORMULAS.append(fo)


def norm_op(op, when):
    """A standalone norm module: output saved by the next linear, stats saved for its own backward."""
    for normalization, stats in (("LayerNorm", HS), ("RMSNorm", HR)):
        add(op, when={**when, "normalization": normalization}, saved=[H, stats], fwd=[H, stats], bwd=[mul(2, H)],
            note="output (saved by the following linear; under SP the un-gathered input is what it saves) + fp32 stats")


def build():
    for attn in ("unfused", "flash"):
        W = {"attention": attn}
        te = attn == "flash"
        wgrad = [] if te else ["1 e h a d t^-1", "2 e h g d t^-1"]  # local spec: weight grad temp (no fused accumulation)

        # --- attention block -------------------------------------------------------------------------------------
        if te:  # TELayerNormColumnParallelLinear: fused input norm + qkv
            for normalization, stats in (("LayerNorm", HS), ("RMSNorm", HR)):
                for sp in (False, True):
                    add("layers.*.self_attention.linear_qkv", when={**W, "normalization": normalization, "sp": sp},
                        saved=[H, stats, *Q], fwd=[H, stats, *Q] + ([FULLH] if sp else []),
                        bwd=[FULLH, mul(2, H)] + ([FULLH] if sp else []),
                        note="TE LayerNormLinear: ln_out + stats + qkv output (q/k/v are views of it)")
            add("layers.*.input_layernorm", when=W, note="IdentityOp in the TE spec (fused into linear_qkv)")
        else:
            norm_op("layers.*.input_layernorm", W)
            for sp in (False, True):
                add("layers.*.self_attention.linear_qkv", when={**W, "sp": sp},
                    saved=Q, fwd=Q + ([FULLH] if sp else []), bwd=[FULLH] + wgrad + ([FULLH] if sp else []),
                    note="qkv output; q, k, v are views of it that core attention saves")

        # core attention
        if te:
            base_saved = [A, "4 s b a t^-1"]  # output + fp32 softmax_lse; flash keeps no s^2 tensor, no dropout mask
            cp_kv = ["2 e s b g d cp t^-1", "-2 e s b g d t^-1"]  # KV chunks from the other CP ranks, kept for backward
            bwd = [*Q, "4 s b a d t^-1", "4 s b a t^-1"]
            add("layers.*.self_attention.core_attention", when=W, saved=base_saved + cp_kv,
                fwd=base_saved + cp_kv, bwd=bwd + cp_kv,
                note="flash attention (TE): output + lse; with CP the KV received from other ranks")
            add("layers.*.self_attention.core_attention", when={**W, "recompute": "selective"}, saved=[A],
                fwd=base_saved + cp_kv, bwd=base_saved + cp_kv + bwd,
                note="selective recompute: only the output survives the forward")
        else:
            gqa_kv = [mul(2, A)]  # repeat_interleave'd K and V (a heads) when g < a
            # The forward keeps the raw scores (e) to its end; the peak is the S2 bytes live at once, plus 2A
            # for the context (bmm output and its contiguous copy) as an upper bound where the two do not meet.
            variants = {  # (dtype, softmax in fp32?, dropout) -> (saved S2 bytes, fwd S2 bytes, bwd S2 bytes)
                # fp32: softmax output (e=4) saved by bmm; with dropout add its output (e) and mask (1 byte on GPU);
                # forward: scores + softmax output (+ mask + dropout output)
                ("fp32", True, False): (4, 8, 12), ("fp32", True, True): (9, 13, 12),
                # 16-bit: on a GPU the masked-softmax fusion (Megatron-LM's default) runs whenever its kernel
                # takes the shape, and --attention-softmax-in-fp32 / --apply-query-key-layer-scaling only select
                # the precision of the unfused torch fallback: the kernel computes in fp32 internally and returns,
                # and saves for backward, probabilities in the input dtype (megatron-core 0.16.1
                # fusions/fused_softmax.py FusedScaleMaskSoftmax.forward_fused_softmax -> ScaledUpperTriangMasked
                # Softmax.forward save_for_backward(softmax_results); Transformer Engine's unfused backend:
                # attention/dot_product_attention/softmax.py, same kernels, NVTE_MASKED_SOFTMAX_FUSION=1 by
                # default). So the s^2 terms are those of a 16-bit softmax, like fp32 with e = 2: scores (2, the
                # baddbmm output, alive to the end of the forward) + probs (2) [+ 1-byte mask + 2-byte dropout
                # output]. Outside the kernel's shapes (local spec s/cp > 4096, TE s/cp >= 16384) or with
                # --no-masked-softmax-fusion an fp32 softmax keeps 4 bytes more per score (features.modelled
                # says so; the CPU stand-ins measure that path).
                (None, None, False): (2, 4, 6), (None, None, True): (5, 7, 6),
            }
            for (dtype, fp32_softmax, drop), (sv, fw, bw) in variants.items():
                for gqa in (False, True):
                    w = {**W, "dropout": drop, "gqa": gqa}
                    if fp32_softmax is not None:
                        w["softmax_fp32"] = fp32_softmax
                    if dtype:
                        w["dtype"] = dtype
                    extra = gqa_kv if gqa else []
                    saved = [f"{sv} {S2}", A] + extra
                    fwd = [f"{fw} {S2}", mul(2, A)] + extra
                    bwd = [f"{bw} {S2}", mul(3, A)] + extra
                    add("layers.*.self_attention.core_attention", when=w, saved=saved, fwd=fwd, bwd=bwd,
                        note="unfused (local spec): scores/softmax a*s^2*b terms; context copy saved by linear_proj")
                    add("layers.*.self_attention.core_attention", when={**w, "recompute": "selective"}, saved=[A],
                        fwd=fwd, bwd=saved + bwd, note="selective recompute drops the s^2 tensors")

        add("layers.*.self_attention.linear_proj", when={**W, "sp": False}, saved=[],
            fwd=[FULLH], bwd=[A] + ([] if te else ["1 e h a d t^-1"]))
        add("layers.*.self_attention.linear_proj", when={**W, "sp": True}, saved=[],
            fwd=[FULLH, H], bwd=[A, FULLH] + ([] if te else ["1 e h a d t^-1"]))
        rope = ["1 e s b a d t^-1", "1 e s b g d t^-1"]
        add("layers.*.self_attention", when={**W, "position": "rope"}, saved=rope, fwd=rope, bwd=rope,
            note="RoPE: rotated q and k are new tensors that attention saves")
        add("layers.*.self_attention", when=W, note="nothing beyond the submodules without RoPE")

        # --- layer level: the two bias-dropout-add outputs (inputs of the next norms) ---------------------------
        add("layers.*", when={**W, "dropout": False}, saved=[mul(2, H)], fwd=[mul(2, H)], bwd=[mul(2, H)],
            note="attention residual output + layer output (the next norm's input)")
        add("layers.*", when={**W, "dropout": True}, saved=[mul(2, H), "2 s b h st^-1"],
            fwd=[mul(2, H), "2 s b h st^-1"], bwd=[mul(2, H)], note="+ two 1-byte dropout masks (GPU)")

        # --- dense MLP ------------------------------------------------------------------------------------------
        # squared-ReLU keeps what gelu keeps, one f-wide tensor each: relu's output (saved by relu and by the square)
        # in place of the fc1 output, and the square (fc2's input)
        for act, mult in (("gelu", 1), ("swiglu", 2), ("squared_relu", 1)):
            F1 = f"{mult} e s b f t^-1"
            D = {**W, "moe": False, "activation": act}
            wg = [] if te else [f"{mult} e h f t^-1"]
            if te:
                for normalization, stats in (("LayerNorm", HS), ("RMSNorm", HR)):
                    for sp in (False, True):
                        add("layers.*.mlp.linear_fc1", when={**D, "normalization": normalization, "sp": sp},
                            saved=[H, stats, F1], fwd=[H, stats, F1] + ([FULLH] if sp else []),
                            bwd=[FULLH, mul(2, H)] + ([FULLH] if sp else []),
                            note="TE LayerNormLinear: ln_out + stats + fc1 output (activation input)")
            else:
                for sp in (False, True):
                    add("layers.*.mlp.linear_fc1", when={**D, "sp": sp}, saved=[F1],
                        fwd=[F1] + ([FULLH] if sp else []), bwd=[FULLH] + wg + ([FULLH] if sp else []),
                        note="fc1 output (saved by the activation)")
            add("layers.*.mlp", when=D, saved=["1 e s b f t^-1"], fwd=["1 e s b f t^-1"],
                bwd=[F1, "1 e s b f t^-1"], note=f"{act} output (fc2 input); fused bias-{act} saves only its input")
        for sp in (False, True):
            add("layers.*.mlp.linear_fc2", when={**W, "moe": False, "sp": sp}, saved=[],
                fwd=[FULLH] + ([H] if sp else []),
                bwd=["1 e s b f t^-1"] + ([] if te else ["1 e h f t^-1"]) + ([FULLH] if sp else []))
        if te:
            add("layers.*.pre_mlp_layernorm", when={**W, "moe": False}, note="IdentityOp in the TE spec")
        norm_op("layers.*.pre_mlp_layernorm", {**W, "moe": True} if te else W)

        # --- MoE (alltoall dispatcher) ---------------------------------------------------------------------------
        M = {**W, "moe": True}
        T_E = "s b E st^-1"
        add("layers.*.mlp.router", when=M, saved=[f"9 {T_E}"], fwd=[f"9 {T_E}", f"1 e {T_E}"], bwd=[f"8 {T_E}"],
            note="fp32 scores + fp32 dense probs + 1-byte routing map")
        R_h = "1 e s b k etp h st^-1"
        Tk_h = "1 e s b k h st^-1"
        add("layers.*.mlp", when=M, saved=[R_h, Tk_h, "16 s b k st^-1"], fwd=[R_h, Tk_h, "16 s b k st^-1", R_h, Tk_h],
            bwd=[mul(2, R_h), Tk_h], note="dispatched tokens (experts' input) + unpermute input + int64 indices")
        # The router's probabilities scale the activation output (megatron-core 0.16.1 experts.py, TEGroupedMLP
        # bias_act_func and SequentialMLP's MLP(per_token_scale)): swiglu takes the fused weighted_bias_swiglu
        # (default bias-swiglu fusion: saves its input and the probs, returns the weighted output, saved by fc2);
        # gelu has no weighted fusion, so the activation output (saved by the multiply) and the weighted product
        # (saved by fc2) are two tensors: 3 x R*fe/etp in all. (probs are in the router's logits dtype: the
        # product stays 16-bit; moe_utils.topk_softmax_with_capacity .type_as(logits).)
        for act, mult, kept in (("gelu", 1, 2), ("swiglu", 2, 1), ("squared_relu", 1, 2)):
            F_e = "e s b k etp fe st^-1 etp^-1"
            sv = [f"{mult} {F_e}", f"{kept} {F_e}"]
            add("layers.*.mlp.experts", when={**M, "activation": act}, saved=sv, fwd=sv + [R_h],
                bwd=[sv[0], R_h], note="expert fc1 output + activation output (gelu: + its probs-weighted product) "
                                       "over R = T*k*etp rows")
            svs = [f"{mult} e s b fs t^-1", "1 e s b fs t^-1"]
            add("layers.*.mlp.shared_experts", when={**M, "activation": act}, saved=svs, fwd=svs + [FULLH],
                bwd=[svs[0], FULLH], note="shared expert fc1 + activation outputs (zero when fs = 0)")

    # --- non-layer ops (per model, on the stage that holds them) ---------------------------------------------------
    add("embedding", per="model", when={"dropout": False}, saved=[H], fwd=[H, FULLH], bwd=["1 e v h t^-1", FULLH],
        note="embedding output (first layer's input); backward makes a dense vocab-shard weight grad")
    add("embedding", per="model", when={"dropout": True}, saved=[H, "1 s b h st^-1"], fwd=[H, FULLH, "1 s b h st^-1"],
        bwd=["1 e v h t^-1", FULLH])
    for normalization, stats in (("LayerNorm", HS), ("RMSNorm", HR)):
        add("final_layernorm", per="model", when={"normalization": normalization}, saved=[H, stats], fwd=[H, stats],
            bwd=[mul(2, H)])
    # --- the input batch (Megatron-LM pretrain_gpt.py get_batch -> get_batch_on_this_tp_rank /
    # get_batch_on_this_cp_rank): int64 tokens, labels and position ids, fp32 loss mask, and (default
    # --create-attention-mask-in-dataloader, GPTDataset's causal mask) a [b, 1, s, s] bool mask, each sliced to
    # s/cp query positions under CP. The mask is alive through the microbatch's forward (the causal fused softmax /
    # flash kernels do not save it; forward_step drops it on return): counted as saved until the backward, which
    # errs high by one mask per other microbatch in flight, and on middle stages (Megatron-LM gives them no batch).
    add("data.mask", per="model", when={}, saved=["1 s^2 b cp"], fwd=["1 s^2 b cp"],
        note="attention mask, bool [b, 1, s/cp, s]")
    add("data.tokens", per="model", when={}, saved=["16 s b"], fwd=["16 s b"],
        note="token ids (saved by the embedding lookup) + position ids, int64")
    add("data.labels", per="model", when={}, saved=["12 s b"], fwd=["12 s b"],
        note="labels (int64, alive through the forward) + fp32 loss mask (saved by the loss)")
    add("output_layer", per="model", when={}, saved=[], fwd=[f"1 e {LOGITS}", FULLH],
        bwd=[f"1 e {LOGITS}", FULLH, "1 e v h t^-1"],
        note="logits (s*b*v/t, activation dtype) live until the loss; grads of logits and input in backward")
    add("loss", per="model", when={}, saved=[f"4 {LOGITS}", "16 s b"], fwd=[f"1 e {LOGITS}", f"4 {LOGITS}", "16 s b"],
        bwd=[f"1 e {LOGITS}"], note="vocab-parallel cross-entropy: fp32 softmax over the vocab shard saved for backward")
    add("loss", per="model", when={"fuse_ce": "native"}, saved=[f"4 {LOGITS}", "16 s b"],
        fwd=[f"1 e {LOGITS}", f"8 {LOGITS}", "16 s b"], bwd=[f"1 e {LOGITS}"],
        note="--cross-entropy-loss-fusion (native): megatron-core's scripted CE kernels on a GPU hold a second fp32 "
             "copy of the logits in forward (measured on H100: loss forward peak 8*s*b*v bytes against 4*s*b*v "
             "unfused)")
    return FORMULAS


def main():
    doc = {
        "format": "megatron-memtrace-formulas", "version": 1, "name": "modelled", "kind": "modelled",
        "description": (
            "Modelled (not fitted) per-op activation formulas for megatron-core GPT layers. Derived from the per-op "
            "breakdown of Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
            "(arXiv:2205.05198), adapted to megatron-core 0.16: local spec (unfused attention, a*s^2*b terms, "
            "the softmax in fp32 for fp32 models; 16-bit models keep it in their dtype, as the GPU's fused "
            "masked-softmax kernel does with or without --attention-softmax-in-fp32; reproduces the CPU-measured e*(16sbh + as^2b) per layer in fp32 without dropout) "
            "and TE spec with flash attention (no s^2 terms, fused LayerNorm-linear), SP, selective recompute, "
            "gelu/swiglu, GQA, RoPE copies, CP KV chunks, MoE router/dispatch/expert buffers, embedding, final norm, "
            "fp32 logits and vocab-parallel cross-entropy. GPU dropout masks are 1 byte/element."),
        "provenance": {"source": "Korthikanti et al. 2022 (arXiv:2205.05198) + reading of megatron-core 0.16.1",
                       "generator": "estimator/formula_sets/build_modelled.py", "megatron_core": "0.16.1",
                       "full_recompute": "handled by the estimator: a recomputed chunk keeps only its input"},
        "formulas": build(),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modelled.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(path, len(doc["formulas"]), "formulas")


if __name__ == "__main__":
    main()
