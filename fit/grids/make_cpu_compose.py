"""Writes fit/grids/cpu_compose.json: the campaign behind composed (per-segment) formula sets.

Two bases, a GPT-style one (gelu, LayerNorm, learned positions, MHA, biases, tied) and a Llama-style one (swiglu,
RMSNorm, rope, GQA, no biases, untied), each with every switch toggled alone (and TP with and without SP, bf16,
dropout, selective recompute, MoE), each combination traced at several shapes drawn from a rotating list, so every
segment label's formula is determined within the switch values that change it and pooled over those that do not.
Squared-ReLU twins (--squared-relu) of a few of those families: GPT- and Llama-style, bf16, TP 2 + SP, and MoE with 4
and 8 experts, top-k 1 to 3, both dispatchers and EP 2, so that no size of the experts' programs is pinned.
Run: python fit/grids/make_cpu_compose.py
"""
import copy
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fit.campaign import doc_description, write_grid  # noqa: E402

COMMON = ["--num-layers", "2", "--max-position-embeddings", "256", "--make-vocab-size-divisible-by", "64",
          "--transformer-impl", "local", "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0"]
# (seq, micro batch, hidden, heads, kv-channels or None, ffn or None, vocab): every variable moves on its own.
SHAPES = [
    (64, 2, 64, 4, None, None, 256),
    (96, 1, 96, 6, None, 256, 320),
    (48, 3, 128, 8, 24, None, 384),
    (128, 1, 64, 8, 32, 192, 512),
    (80, 2, 96, 4, None, 320, 448),
    (32, 3, 128, 4, 48, 384, 320),
]
GPT = {}
LLAMA = {"--swiglu": True, "--normalization": "RMSNorm", "--position-embedding-type": "rope",
         "--group-query-attention": True, "--num-query-groups": 2, "--disable-bias-linear": True,
         "--untie-embeddings-and-output-weights": True}
TOGGLES = [  # (name, flags to add, flags to remove)
    ("base", {}, ()),
    ("swiglu", {"--swiglu": True}, ()),
    ("gelu", {}, ("--swiglu",)),
    ("rms", {"--normalization": "RMSNorm"}, ()),
    ("ln", {}, ("--normalization",)),
    ("rope", {"--position-embedding-type": "rope"}, ()),
    ("learned", {}, ("--position-embedding-type",)),
    ("nobias", {"--disable-bias-linear": True}, ()),
    ("bias", {}, ("--disable-bias-linear",)),
    ("gqa", {"--group-query-attention": True, "--num-query-groups": 2}, ()),
    ("mha", {}, ("--group-query-attention", "--num-query-groups")),
    ("untied", {"--untie-embeddings-and-output-weights": True}, ()),
    ("tied", {}, ("--untie-embeddings-and-output-weights",)),
    ("dropout", {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}, ()),
    ("selective", {"--recompute-activations": True}, ()),
    ("tp2", {"--tensor-model-parallel-size": 2}, ()),
    ("tp2sp", {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}, ()),
    ("bf16", {"--bf16": True}, ()),
    # megatron-core 0.16.1's SequentialMLP adds a bias in place to a view at one expert rank: MoE runs unbiased,
    # as Megatron's MoE recipes do.
    ("moe", {"--num-experts": 4, "--moe-router-topk": 2, "--disable-bias-linear": True}, ()),
    ("moe_ep2", {"--num-experts": 4, "--moe-router-topk": 2, "--expert-model-parallel-size": 2,
                 "--disable-bias-linear": True}, ()),
]


TOGGLE = {name: (add, drop) for name, add, drop in TOGGLES}


# Pairs of toggles whose ops interact (dropout, recompute, rotary positions, GQA, biases and sequence parallelism all
# change what the attention and the bias-dropout-add keep): each pair applied together to each base.
PAIRS = [("dropout", "selective"), ("dropout", "tp2sp"), ("selective", "tp2sp"), ("dropout", "nobias"),
         ("dropout", "bias"), ("selective", "rope"), ("selective", "learned"), ("selective", "gqa"),
         ("selective", "mha"), ("dropout", "rope"), ("dropout", "learned")]


def shape_flags(shape) -> dict:
    s, b, h, a, kv, f, v = shape
    d = {"--seq-length": s, "--micro-batch-size": b, "--hidden-size": h, "--num-attention-heads": a,
         "--vocab-size": v}
    if kv:
        d["--kv-channels"] = kv
    if f:
        d["--ffn-hidden-size"] = f
    return d


def _entry(prefix: str, flags: dict, shape, short: bool = True) -> dict:
    """One grid config: the flags at one shape (GQA groups that divide the heads; bf16 small unless not `short`, as
    it is ~14x slower on CPU), named by the prefix and the shape."""
    f = dict(flags)
    f.update(shape_flags(shape))
    if "--num-query-groups" in f and f["--num-attention-heads"] % 2:
        f["--num-query-groups"] = 3 if f["--num-attention-heads"] % 3 == 0 else 1
    if "--bf16" in f and short:
        f["--seq-length"], f["--micro-batch-size"] = min(f["--seq-length"], 48), min(f["--micro-batch-size"], 2)
    nproc = 2 if any(x in f for x in ("--tensor-model-parallel-size", "--expert-model-parallel-size")) else 1
    s, b, h = f["--seq-length"], f["--micro-batch-size"], f["--hidden-size"]
    entry = {"name": f"{prefix}_s{s}_b{b}_h{h}_a{f['--num-attention-heads']}",
             "set": {key: val for key, val in f.items() if val is not True},
             "flags": [key for key, val in f.items() if val is True]}
    if nproc > 1:
        entry["nproc"] = nproc
    return entry


def toggled(base: dict, names) -> dict | None:
    """The base's flags with the named toggles applied together; None where one of them would leave the base as it
    is (the base already has that value: a combination another entry covers)."""
    flags = dict(base)
    for name in names:
        add, drop = TOGGLE[name]
        if (drop and not any(key in base for key in drop)) or (add and all(base.get(key) == val
                                                                           for key, val in add.items())):
            return None
        for key in drop:
            flags.pop(key, None)
        flags.update(add)
    return flags


def configs() -> list:
    out, k = [], 0
    for base_name, base in (("gpt", GPT), ("llama", LLAMA)):
        for name, add, drop in TOGGLES:
            flags = {key: val for key, val in base.items() if key not in drop}
            if add and all(flags.get(key) == val for key, val in add.items()):
                continue            # already the base's value: the base covers it
            if not add and not drop and name != "base":
                continue
            if drop and not any(key in base for key in drop):
                continue
            flags.update(add)
            # TP, SP and bf16 change many segments through terms of their own: as many shapes as the base. Each
            # combination starts where the previous one's first shapes ended (`first`), so adding shapes to one
            # combination leaves every other's configs as they were.
            first = 5 if name == "base" else 2 if name in ("bf16", "moe_ep2") else 3
            n_shapes = 5 if name in ("base", "tp2", "tp2sp", "bf16") else first
            start, k = k, k + first
            for j in range(n_shapes):
                out.append(_entry(f"{base_name}_{name}", flags, SHAPES[(start + j) % len(SHAPES)]))
    pairs, _ = combinations(PAIRS, 3, k)
    return out + pairs


def combinations(combos, n_shapes: int, k: int) -> tuple:
    """Each combination of toggles applied together to each base, at n_shapes shapes from the rotating list
    starting at k: (the configs, where the next rotation starts)."""
    out = []
    for base_name, base in (("gpt", GPT), ("llama", LLAMA)):
        for names in combos:
            flags = toggled(base, names)
            if flags is None:
                continue
            for j in range(n_shapes):
                out.append(_entry(f"{base_name}_{'_'.join(names)}", flags, SHAPES[(k + j) % len(SHAPES)]))
            k += n_shapes
    return out, k


# GPU kernel families on CPU stand-ins (tracer/standins.py, profiler option --gpu-kernels). Their base has every
# fusion off (then it runs what the configs above run, but for the 1-byte dropout mask), and each family is switched
# on alone, then all together as Megatron-LM's defaults have them (Transformer Engine spec, flash attention, fused
# bias-activation and RoPE; the fused masked softmax where attention is unfused and 16-bit).
NO_FUSION = {"--no-bias-gelu-fusion": True, "--no-bias-swiglu-fusion": True, "--no-masked-softmax-fusion": True,
             "--no-rope-fusion": True}
TE = {"--transformer-impl": "transformer_engine"}
KERNEL_TOGGLES = [  # (name, flags to add, flags to remove from NO_FUSION, shapes)
    ("gk_base", {}, (), 2),
    ("gk_te", TE, (), 3),
    ("gk_teunf", {**TE, "--attention-backend": "unfused"}, (), 2),
    ("gk_fact", {}, ("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion"), 2),
    ("gk_fsm", {"--bf16": True}, ("--no-masked-softmax-fusion",), 2),
    ("gk_fsm_off", {"--bf16": True}, (), 1),
    ("gk_frope", {"--position-embedding-type": "rope"}, ("--no-rope-fusion",), 2),
    ("gk_dropout", {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}, (), 3),
    ("gk_te_dropout", {**TE, "--hidden-dropout": 0.1, "--attention-dropout": 0.1}, (), 2),
    ("gk_dropout_sel", {"--hidden-dropout": 0.1, "--attention-dropout": 0.1, "--recompute-activations": True}, (), 2),
    ("gk_te_sel", {**TE, "--recompute-activations": True}, (), 2),
    ("gk_te_tp2sp", {**TE, "--tensor-model-parallel-size": 2, "--sequence-parallel": True}, (), 2),
    ("gk_default", {**TE, "--hidden-dropout": 0.1, "--attention-dropout": 0.1}, tuple(NO_FUSION), 2),
    ("gk_default_bf16", {**TE, "--bf16": True}, tuple(NO_FUSION), 2),
]
# Shapes where the fused softmax kernel runs in bf16 (b x heads a multiple of 8 at s <= 128) for gk_fsm.
FSM_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[4]]


# Selective recompute keeps what the checkpointed attention frees in forward, which depends on dropout, GQA and the
# position type together: the triples the pairs above leave out, on each base.
TRIPLES = [("selective", "dropout", "rope"), ("selective", "dropout", "gqa"), ("selective", "dropout", "learned"),
           ("selective", "dropout", "mha")]


def triple_configs(start: int) -> list:
    out, k = [], start
    for base_name, base in (("gpt", GPT), ("llama", LLAMA)):
        for names in TRIPLES:
            flags = toggled(base, names)
            if flags is None:
                continue
            for j in range(3):
                out.append(_entry(f"{base_name}_{'_'.join(names)}", flags, SHAPES[(k + j) % len(SHAPES)]))
                # and with the GPU's 1-byte dropout masks (stand-ins, nothing fused)
                gk = _entry(f"{base_name}_gk_{'_'.join(names)}", {**flags, **{f: True for f in NO_FUSION}},
                            SHAPES[(k + j + 1) % len(SHAPES)])
                gk["launcher"] = ["--gpu-kernels"]
                out.append(gk)
            k += 3
    return out


# Attention and MoE layouts the toggles above leave out. The query copy SelfAttention makes (heads and groups
# reshaped: a copy only with more than one group and more than one head per group on a rank) and multi-query
# attention (one group): alone, under TP with two groups per rank, and with rope. MoE with TP (sequence parallel, as
# megatron-core requires; expert TP = TP, so the dispatcher gathers over the TP group) and the all-to-all dispatcher.
# bf16 runs are short (_entry): shapes of their own, with micro-batches of one sequence and of two, so that each
# part of a bf16 fit split by `mb1` has enough runs.
BF16_SHAPES = ((40, 1, 128, 4, None, 256, 640), (32, 1, 96, 6, None, None, 512), (48, 1, 128, 8, 16, None, 384),
               (40, 1, 64, 4, None, 192, 448), (40, 2, 64, 8, None, None, 512), (32, 2, 96, 4, None, 256, 448),
               (48, 2, 96, 6, None, None, 384))
LAYOUTS = [  # (name, base, flags, shapes: indices into SHAPES or shapes)
    ("gpt_mqa", GPT, {"--group-query-attention": True, "--num-query-groups": 1}, (0, 1, 3, 2, 4, 5)),
    ("llama_mqa", LLAMA, {"--num-query-groups": 1}, (2, 4, 5, 3, 0, 1)),
    # MQA with and without rope on both bases (a rotated query is contiguous: no copy in core attention's reshape)
    ("gpt_mqa_rope", GPT, {"--group-query-attention": True, "--num-query-groups": 1,
                           "--position-embedding-type": "rope"}, (3, 2, 0, 4)),
    ("llama_mqa_learned", LLAMA, {"--num-query-groups": 1, "--position-embedding-type": "learned_absolute"},
     (3, 5, 2, 1)),
    ("llama_mqa_dropout", LLAMA, {"--num-query-groups": 1, "--hidden-dropout": 0.1, "--attention-dropout": 0.1},
     (0, 3)),
    ("llama_tp2_g4", LLAMA, {"--tensor-model-parallel-size": 2, "--num-query-groups": 4}, (2, 3)),
    ("gpt_tp2_g4", GPT, {"--tensor-model-parallel-size": 2, "--group-query-attention": True,
                         "--num-query-groups": 4}, (2, 3)),
    ("gpt_moe_tp2sp", GPT, {**TOGGLE["moe"][0], **TOGGLE["tp2sp"][0]}, (0, 2, 4)),
    ("llama_moe_tp2sp", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["tp2sp"][0]}, (1, 3, 5)),
    ("gpt_moe_a2a_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall"}, (1, 3)),
    ("llama_moe_a2a_ep2", LLAMA, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall"}, (0, 2)),
    # the expert count and top-k (every MoE run above has 4 experts, top-2)
    ("gpt_moe_e8k1", GPT, {**TOGGLE["moe"][0], "--num-experts": 8, "--moe-router-topk": 1,
                               "--moe-router-pre-softmax": True}, (1, 3, 5)),
    ("llama_moe_e8k3", LLAMA, {**TOGGLE["moe"][0], "--num-experts": 8, "--moe-router-topk": 3}, (0, 2, 4)),
    ("gpt_moe_a2a_e8k3_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                   "--num-experts": 8, "--moe-router-topk": 3}, (2, 5)),
    ("llama_moe_a2a_e2k1_ep2", LLAMA, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                       "--num-experts": 2, "--moe-router-topk": 1,
                                       "--moe-router-pre-softmax": True}, (1, 3)),
    # The token dispatchers over every expert count, top-k and expert layout a config can have: the all-to-all one
    # without EP (no exchange), under TP with SP, with one expert per rank (no sort by local expert), and top-1 /
    # top-3 with EP; the allgather one likewise.
    ("gpt_moe_a2a", GPT, {**TOGGLE["moe"][0], "--moe-token-dispatcher-type": "alltoall"}, (0, 3, 4)),
    ("llama_moe_a2a_e8k2", LLAMA, {**TOGGLE["moe"][0], "--moe-token-dispatcher-type": "alltoall",
                                   "--num-experts": 8}, (1, 5)),
    ("gpt_moe_a2a_tp2sp", GPT, {**TOGGLE["moe"][0], **TOGGLE["tp2sp"][0], "--moe-token-dispatcher-type": "alltoall"},
     (1, 3, 5, 0, 2)),
    ("llama_moe_a2a_e8k3_tp2sp", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["tp2sp"][0],
                                         "--moe-token-dispatcher-type": "alltoall", "--num-experts": 8,
                                         "--moe-router-topk": 3}, (0, 2, 4)),
    ("llama_moe_a2a_e8k1_ep2", LLAMA, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                       "--num-experts": 8, "--moe-router-topk": 1,
                                       "--moe-router-pre-softmax": True}, (0, 4)),
    ("gpt_moe_a2a_k3_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                 "--moe-router-topk": 3}, (1, 5)),
    ("gpt_moe_a2a_e2k2_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                   "--num-experts": 2}, (2, 4)),
    ("gpt_moe_e8k2_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--num-experts": 8}, (0, 4)),
    ("llama_moe_k1_ep2", LLAMA, {**TOGGLE["moe_ep2"][0], "--moe-router-topk": 1, "--moe-router-pre-softmax": True},
     (1, 3)),
    ("gpt_moe_e2k1_ep2", GPT, {**TOGGLE["moe_ep2"][0], "--num-experts": 2, "--moe-router-topk": 1,
                               "--moe-router-pre-softmax": True}, (2, 5)),
    ("llama_moe_e8k3_tp2sp", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["tp2sp"][0], "--num-experts": 8,
                                     "--moe-router-topk": 3}, (2, 4)),
    ("gpt_moe_k3", GPT, {**TOGGLE["moe"][0], "--moe-router-topk": 3}, (1, 3)),
    # The all-to-all dispatcher over one rank with top-1 and top-3: its runs were all top-2, so its dispatch
    # (2*s*b*k*h*e) could not be told from 4*s*b*h*e.
    ("gpt_moe_a2a_k3", GPT, {**TOGGLE["moe"][0], "--moe-token-dispatcher-type": "alltoall",
                             "--moe-router-topk": 3}, (2, 5)),
    ("llama_moe_a2a_e8k1", LLAMA, {**TOGGLE["moe"][0], "--moe-token-dispatcher-type": "alltoall",
                                   "--num-experts": 8, "--moe-router-topk": 1, "--moe-router-pre-softmax": True},
     (0, 4)),
    # TP and TP + SP with the other position type, norm and tie than each base has (the GPT-style TP runs were all
    # tied with learned positions and LayerNorm, the Llama-style ones untied with rope and RMSNorm: the word
    # embedding's backward and the loss head's own code under TP were measured for those two corners only), and
    # bf16 under TP + SP; one micro-batch of one sequence and one of more in each.
    ("gpt_tp2_rope", GPT, {**TOGGLE["tp2"][0], **TOGGLE["rope"][0]}, (0, 1)),
    ("gpt_tp2sp_rope", GPT, {**TOGGLE["tp2sp"][0], **TOGGLE["rope"][0]}, (2, 3, 0, 4)),
    # (the word embedding's fp32 backward under SP also differs by position type: untied with learned positions)
    ("gpt_tp2sp_untied", GPT, {**TOGGLE["tp2sp"][0], **TOGGLE["untied"][0]},
     (0, 5, 4, 3, 2, (112, 2, 64, 4, None, None, 320), (96, 3, 96, 6, None, None, 448))),
    ("gpt_tp2sp_rms", GPT, {**TOGGLE["tp2sp"][0], **TOGGLE["rms"][0]}, (4, 1)),
    ("llama_tp2_learned", LLAMA, {**TOGGLE["tp2"][0], "--position-embedding-type": "learned_absolute"}, (0, 3)),
    ("llama_tp2sp_learned", LLAMA, {**TOGGLE["tp2sp"][0], "--position-embedding-type": "learned_absolute"},
     (2, 1)),
    ("llama_tp2sp_ln", LLAMA, {**TOGGLE["tp2sp"][0], "--normalization": "LayerNorm"}, (4, 3)),
    ("gpt_bf16_tp2sp", GPT, {**TOGGLE["tp2sp"][0], **TOGGLE["bf16"][0]}, (0, 1, 2, 3, 5) + BF16_SHAPES),
    ("llama_bf16_tp2sp", LLAMA, {**TOGGLE["tp2sp"][0], **TOGGLE["bf16"][0]},
     (2, 3, 0, 1, 5, (40, 1, 96, 6, None, 320, 576)) + BF16_SHAPES),
    # MoE with dropout (the bias-dropout-add after an MoE layer, and a router that must not see it) and MoE in bf16
    # (the router's and the dispatcher's tensors in the model's dtype), each dispatcher on one base.
    ("gpt_moe_dropout", GPT, {**TOGGLE["moe"][0], **TOGGLE["dropout"][0]}, (1, 3)),
    ("llama_moe_a2a_dropout", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["dropout"][0],
                                      "--moe-token-dispatcher-type": "alltoall"}, (0, 4, 1, 2, 3)),
    ("gpt_moe_k3_dropout", GPT, {**TOGGLE["moe"][0], **TOGGLE["dropout"][0], "--moe-router-topk": 3}, (0, 2)),
    ("gpt_moe_bf16", GPT, {**TOGGLE["moe"][0], **TOGGLE["bf16"][0]}, (2, 4, 0, 1)),
    ("llama_moe_a2a_bf16", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["bf16"][0],
                                   "--moe-token-dispatcher-type": "alltoall"}, (1, 5, 3, 0)),
    # The query copy under TP + SP (four groups, two per rank), MoE with dropout over two expert ranks on each
    # dispatcher, routing by softmax over all experts before a top-2 (--moe-router-pre-softmax: its runs above are
    # all top-1), MoE in bf16 under TP + SP on each dispatcher and with 8 experts, top-3 (the bf16 runs above are
    # all 4 experts, top-2), and bf16 with dropout at three sequence lengths; with the shapes added to layouts
    # above, every part of the dispatch, the bf16 MoE and bf16 TP + SP has enough runs for a formula of four terms.
    ("llama_tp2sp_g4", LLAMA, {**TOGGLE["tp2sp"][0], "--num-query-groups": 4},
     (2, 3, (96, 2, 128, 8, None, None, 448))),
    ("gpt_moe_ep2_dropout", GPT, {**TOGGLE["moe_ep2"][0], **TOGGLE["dropout"][0]}, (0, 2, 3)),
    ("llama_moe_a2a_ep2_dropout", LLAMA, {**TOGGLE["moe_ep2"][0], **TOGGLE["dropout"][0],
                                          "--moe-token-dispatcher-type": "alltoall"}, (1, 3, 4)),
    ("gpt_moe_presoft", GPT, {**TOGGLE["moe"][0], "--moe-router-pre-softmax": True}, (0, 2, 4)),
    ("llama_moe_a2a_presoft_ep2", LLAMA, {**TOGGLE["moe_ep2"][0], "--moe-token-dispatcher-type": "alltoall",
                                          "--moe-router-pre-softmax": True, "--num-experts": 8}, (1, 3, 5)),
    ("llama_moe_a2a_bf16_tp2sp", LLAMA, {**TOGGLE["moe"][0], **TOGGLE["bf16"][0], **TOGGLE["tp2sp"][0],
                                         "--moe-token-dispatcher-type": "alltoall"}, (0, 1, 3, 5)),
    ("gpt_moe_bf16_tp2sp", GPT, {**TOGGLE["moe"][0], **TOGGLE["bf16"][0], **TOGGLE["tp2sp"][0]}, (2, 4)),
    ("gpt_moe_bf16_e8k3", GPT, {**TOGGLE["moe"][0], **TOGGLE["bf16"][0], "--num-experts": 8, "--moe-router-topk": 3},
     (0, 1, 5)),
    ("gpt_bf16_dropout_s", GPT, {**TOGGLE["bf16"][0], **TOGGLE["dropout"][0]},
     ((40, 2, 96, 4, None, None, 448), (32, 1, 128, 8, 16, 256, 384))),
    # bf16 with dropout under rope (the attention projection's backward after its dropout) had two runs; the
    # all-to-all MoE with dropout on one rank too (the combine's transient)
    ("llama_bf16_dropout_s", LLAMA, {**TOGGLE["bf16"][0], **TOGGLE["dropout"][0]}, BF16_SHAPES[3:6]),
]


# bf16 changes what several ops keep (a norm that computes in fp32 saves its own copy, not its input), so each switch
# of the bases toggled once more in bf16: the bf16 runs above differ from each other only by the whole base.
BF16_PAIRS = [("bf16", t) for t in ("rms", "ln", "swiglu", "gelu", "rope", "learned", "gqa", "mha", "nobias", "bias",
                                    "untied", "tied", "dropout")]


def bf16_configs() -> list:
    return combinations(BF16_PAIRS, 2, 0)[0]


# One sequence per micro-batch under TP 2 with vocabularies that are not 4 * s: every TP run above at b = 1 has
# v = 4 * s once the vocabulary is padded to 128 (s 96 v 384, s 128 v 512), so a formula in s*b*h and v*h could
# not be told apart there (the word embedding's backward: its weight's gradient beside the gathered output
# gradient); each position type, tie and TP with and without SP, on the layouts above and the bases' TP toggles.
B1_VOCAB_SHAPES = ((112, 1, 64, 4, None, None, 640), (64, 1, 128, 8, None, None, 384))
_FLAGS = {name: (base, add) for name, base, add, _ in LAYOUTS}
_FLAGS.update({f"{b}_{t}": (base, TOGGLE[t][0]) for b, base in (("gpt", GPT), ("llama", LLAMA))
               for t in ("tp2", "tp2sp")})
LAYOUTS += [(name + "_b1v", *_FLAGS[name], B1_VOCAB_SHAPES)
            for name in ("gpt_tp2", "gpt_tp2_rope", "llama_tp2", "llama_tp2_learned", "gpt_tp2sp", "gpt_tp2sp_rope",
                         "gpt_tp2sp_untied", "llama_tp2sp", "llama_tp2sp_learned")]


# The untied output layer's backward in bf16 peaks at the larger of two patterns: the gathered input, the input
# gradient and the weight gradient (s*b*h*e/st + 2*s*b*h*e [SP] + v*h*e/t), or, once the logits' gradient is freed,
# the weight gradient with its fp32 copy for the main gradient (3*v*h*e/t - s*b*v*e/t). The short bf16 shapes above
# are mostly on the second side (s*b < 2*h*v/(h + v)); these longer sequences, with and without SP and with
# micro-batches of one sequence and of two, are on the first.
# The linear layers' bf16 backward likewise: the short shapes put its weight gradient's pattern above its
# activation gradients'.
BF16_LONG = [("llama_bf16_long", LLAMA, TOGGLE["bf16"][0]),
             ("llama_bf16_tp2sp_long", LLAMA, {**TOGGLE["tp2sp"][0], **TOGGLE["bf16"][0]}),
             ("gpt_bf16_long", GPT, TOGGLE["bf16"][0]),
             ("gpt_bf16_tp2sp_long", GPT, {**TOGGLE["tp2sp"][0], **TOGGLE["bf16"][0]})]
BF16_LONG_SHAPES = ((128, 1, 64, 4, None, None, 256), (96, 2, 64, 4, None, 192, 384), (128, 2, 96, 6, None, None, 320),
                    (160, 1, 64, 8, None, None, 256), (64, 3, 64, 4, None, None, 320), (112, 2, 96, 4, None, 256, 384),
                    (192, 1, 64, 4, None, None, 256), (176, 1, 96, 6, None, 256, 256), (144, 2, 64, 4, None, None, 256),
                    (192, 2, 64, 4, None, None, 256), (128, 3, 96, 6, None, 256, 320), (240, 2, 96, 4, None, None, 384))

# The same bases at short sequences with micro-batches of three and four: every short bf16 run above has one or two
# sequences, so the weight gradient's side of those maxima could not tell s*b*h from 2*s*h (b = 2 on all of a part).
BF16_BATCH_SHAPES = ((24, 3, 128, 4, None, None, 512), (16, 4, 96, 6, None, 256, 640))


def layout_configs() -> list:
    out = [_entry(name, {**base, **add}, shape, short=False) for name, base, add in BF16_LONG
           for shape in BF16_LONG_SHAPES]
    out += [_entry(name.replace("_long", "_batch"), {**base, **add}, shape, short=False)
            for name, base, add in BF16_LONG for shape in BF16_BATCH_SHAPES]
    for name, base, add, shapes in LAYOUTS:
        for j in shapes:   # an index into SHAPES, or a shape of its own
            e = _entry(name, {**base, **add}, SHAPES[j] if isinstance(j, int) else j)
            if "--num-query-groups" in add:   # the groups asked for, whatever the heads (_entry fits them to odd heads)
                e["set"]["--num-query-groups"] = add["--num-query-groups"]
            out.append(e)
    return out


def kernel_configs() -> list:
    out, k = [], 0
    for base_name, base in (("gpt", GPT), ("llama", LLAMA)):
        for name, add, drop, n in KERNEL_TOGGLES:
            flags = {**base, **{key: True for key in NO_FUSION if key not in drop}, **add}
            if "--transformer-impl" in add and "--bf16" not in flags and "--attention-backend" not in flags:
                flags["--attention-backend"] = "flash"   # fp32 'auto' would be unfused; the CPU stand-in runs flash
            shapes = FSM_SHAPES if name == "gk_fsm" else SHAPES
            for j in range(n):
                e = _entry(f"{base_name}_{name}", flags, shapes[(k + j) % len(shapes)])
                e["launcher"] = ["--gpu-kernels"]
                out.append(e)
            k += n
    return out


# A covering array of strength 3, extended to strength 4, over the dense layer's switches: every four of them take
# every combination of their values together in some run. The toggles, pairs and layouts above vary switches one or two at a time from two
# bases, so some switches always moved together there (in bf16 with dropout, swiglu only ever with RMSNorm; with
# dropout and RMSNorm, GQA only ever with the query copy), and the fitter, which cuts a label's runs by the switch
# that explains their event structures, could cut on the wrong one of two that coincide: a config that separates
# them was then answered from runs unlike it (seeds 20261124 and 20261208 of benchmarks/accuracy_random.py: a
# hidden state the next layer's LayerNorm keeps, freed as RMSNorm runs free it; the query copy in core attention).
# Greedy (each row the candidate covering the most uncovered triples), from a fixed random stream: reproducible.
COVER = {  # switch: (value -> flags)
    "activation": {"gelu": {}, "swiglu": {"--swiglu": True}},
    "norm": {"ln": {}, "rms": {"--normalization": "RMSNorm"}},
    "position": {"learned": {}, "rope": {"--position-embedding-type": "rope"}},
    "bias": {True: {}, False: {"--disable-bias-linear": True}},
    "tied": {True: {}, False: {"--untie-embeddings-and-output-weights": True}},
    "dropout": {False: {}, True: {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}},
    "dtype": {"fp32": {}, "bf16": {"--bf16": True}},
    "layout": {"1": {}, "tp2": {"--tensor-model-parallel-size": 2},
               "tp2sp": {"--tensor-model-parallel-size": 2, "--sequence-parallel": True}},
    # per rank: every head its own group; more than one group and more than one head per group (the query copy in
    # SelfAttention); one group (the copy, if any, in core attention)
    "heads": {"mha": None, "groups": None, "one_group": None},
    "mb1": {True: None, False: None},
}
# (seq, micro batch, hidden, heads, kv-channels, ffn, vocab) per micro-batch kind; 8 heads so that every head
# layout exists under TP 2 (4 groups: 2 per rank; 2 groups: 1 per rank); in each, s*b != h and v != 4*s (a size
# formula fitted on these runs alone could otherwise take one for the other)
COVER_SHAPES = {True: [(80, 1, 64, 8, None, None, 448), (112, 1, 96, 8, None, 256, 320)],
                False: [(48, 2, 64, 8, None, 192, 384), (40, 3, 96, 8, None, None, 256)]}


def covering_rows(strengths: tuple = (3, 4), candidates: int = 300, cover: dict | None = None,
                  seed: int = 20261206) -> list:
    """Rows (switch -> value) in which every `strength` switches take every combination of their values, for each
    strength in turn: the rows of the lower strength come first and stay as they are (their runs are traced)."""
    import itertools
    import random
    cover = COVER if cover is None else cover
    names = list(cover)
    values = [list(cover[n]) for n in names]
    rng, rows = random.Random(seed), []
    for strength in strengths:
        tuples = list(itertools.combinations(range(len(names)), strength))
        uncovered = {(idx, combo) for idx in tuples
                     for combo in itertools.product(*(range(len(values[i])) for i in idx))}
        for row in rows:
            uncovered -= {(idx, tuple(values[i].index(row[names[i]]) for i in idx)) for idx in tuples}
        while uncovered:
            best = None
            for _ in range(candidates):
                row = [rng.randrange(len(v)) for v in values]
                gain = sum((idx, tuple(row[i] for i in idx)) in uncovered for idx in tuples)
                if best is None or gain > best[0]:
                    best = (gain, row)
            row = best[1]
            uncovered -= {(idx, tuple(row[i] for i in idx)) for idx in tuples}
            rows.append({n: values[i][row[i]] for i, n in enumerate(names)})
    return rows


def covering_configs() -> list:
    out = []
    for j, row in enumerate(covering_rows()):
        flags = {}
        for k, v in row.items():
            flags.update(COVER[k][v] or {})
        tp = 2 if row["layout"] != "1" else 1
        groups = {"mha": None, "groups": 2 * tp, "one_group": tp}[row["heads"]]
        if groups:
            flags.update({"--group-query-attention": True, "--num-query-groups": groups})
        shape = COVER_SHAPES[row["mb1"]][j % 2]
        e = _entry(f"cover{j:02d}", flags, shape)
        if groups:
            e["set"]["--num-query-groups"] = groups
        out.append(e)
    return out


# The same over an MoE layer's switches (strength 3, extended to 4): the MoE toggles and layouts above vary them
# one or two at a time, so a config pairing some of them (an all-to-all dispatcher under TP 2 + SP with dropout:
# seed 20261206 of benchmarks/accuracy_random.py) reached a cell whose runs all lacked one of its values, and its
# MLP's own code (the bias-dropout-add after the experts) was answered without dropout's mask and output: -0.8%.
# Experts as (E, top-k): local experts 2 to 8, a top-1 router with the softmax before it. MoE runs are unbiased
# (TOGGLES `moe`). Its own grid (cpu_moe_cover), traced into fit/traces/cpu_moe_cover and not yet fitted into
# cpu_compose: with these runs the greedy cell tree cuts some dense labels differently (docs/ACCURACY.md).
MOE_COVER = {
    "dispatcher": {"allgather": {}, "alltoall": {"--moe-token-dispatcher-type": "alltoall"}},
    "layout": {"1": {}, "tp2sp": {"--tensor-model-parallel-size": 2, "--sequence-parallel": True},
               "ep2": {"--expert-model-parallel-size": 2}},
    "experts": {"e4k2": {"--num-experts": 4, "--moe-router-topk": 2},
                "e8k1": {"--num-experts": 8, "--moe-router-topk": 1, "--moe-router-pre-softmax": True},
                "e8k3": {"--num-experts": 8, "--moe-router-topk": 3}},
    "dropout": {False: {}, True: {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}},
    "dtype": {"fp32": {}, "bf16": {"--bf16": True}},
    "activation": {"gelu": {}, "swiglu": {"--swiglu": True}},
    "norm": {"ln": {}, "rms": {"--normalization": "RMSNorm"}},
    "mb1": {True: None, False: None},
}


# COVER_SHAPES, but every shape's tokens per rank (s*b, halved under SP) a multiple of 8, so that balanced routing
# gives every expert the same count for each (E, top-k) above (40 x 3 under SP: 60 tokens x 3 / 8 experts is not)
MOE_SHAPES = {True: COVER_SHAPES[True], False: [COVER_SHAPES[False][0], (32, 3, 128, 8, None, None, 256)]}


def moe_covering_configs() -> list:
    out = []
    for j, row in enumerate(covering_rows((3, 4), cover=MOE_COVER, seed=20261207)):
        flags = {"--disable-bias-linear": True}
        for k, v in row.items():
            flags.update(MOE_COVER[k][v] or {})
        out.append(_entry(f"moecover{j:02d}", flags, MOE_SHAPES[row["mb1"]][j % 2]))
    return out


# (family to copy, its squared-ReLU twin, configs taken): the first configs of each family, as they come above
SQUARED_RELU = [("gpt_base", "gpt_sqrelu", 3), ("llama_base", "llama_sqrelu", 3), ("gpt_bf16", "gpt_bf16_sqrelu", 3),
                ("gpt_tp2sp", "gpt_tp2sp_sqrelu", 3), ("gpt_moe", "gpt_moe_sqrelu", 3),
                ("gpt_moe_a2a", "gpt_moe_a2a_sqrelu", 3), ("gpt_moe_e8k1", "gpt_moe_sqrelu_e8k1", 3),
                ("gpt_moe_a2a_e8k3_ep2", "gpt_moe_sqrelu_a2a_e8k3_ep2", 2), ("gpt_moe_k3", "gpt_moe_sqrelu_k3", 2)]


def squared_relu_configs(cfgs: list) -> list:
    """Squared-ReLU twins of the SQUARED_RELU families: the same shapes and flags, the activation squared-ReLU (with
    linear biases the bias-GeLU fusion off, as megatron-core requires)."""
    def family(name):
        return re.sub(r"_s\d+_b\d+_h\d+_a\d+$", "", name)

    out = []
    for src, dst, n in SQUARED_RELU:
        for c in [c for c in cfgs if family(c["name"]) == src][:n]:
            c = copy.deepcopy(c)
            c["name"] = dst + c["name"][len(src):]
            c["flags"] = [f for f in c["flags"] if f != "--swiglu"] + ["--squared-relu"]
            if "--disable-bias-linear" not in c["flags"]:
                c["flags"].append("--no-bias-gelu-fusion")
            out.append(c)
    return out


def main():
    cfgs = (configs() + kernel_configs() + triple_configs(1) + layout_configs() + bf16_configs()
            + covering_configs())
    cfgs += squared_relu_configs(cfgs)
    names = [c["name"] for c in cfgs]
    assert len(set(names)) == len(names), "duplicate config names"
    write_grid("cpu_compose", doc_description(__doc__), "cpu", 2, COMMON, cfgs, __file__)
    # traced into fit/traces/cpu_moe_cover, not yet fitted into cpu_compose (docs/ACCURACY.md, MoE covering array)
    write_grid("cpu_moe_cover", "The MoE covering array of fit/grids/make_cpu_compose.py (MOE_COVER).", "cpu", 2,
               COMMON, moe_covering_configs(), __file__)


if __name__ == "__main__":
    main()
