"""Per-rank, per-op parameter counts of estimator.model == megatron-core's own GPTModel, built on CPU.

One spawn of 4 real gloo processes builds every case below (initialize_model_parallel per case), so each rank's
model is the one megatron-core builds for that rank's coordinates: TP/EP shards, PP stages incl. uneven first/last
and virtual stages, the tied embedding copy on the last stage.
"""
import shlex

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from conftest import TP_REPLICATED, run_on_gloo_world  # noqa: E402
from estimator.args import ConfigError, parse_args  # noqa: E402
from estimator.model import rank_params  # noqa: E402

WORLD = 4
BASE = (f"--nproc_per_node {WORLD} --seq-length 32 --max-position-embeddings 64 --micro-batch-size 1 "
        "--hidden-size 64 --num-attention-heads 8 --vocab-size 1000 --transformer-impl local ")

CASES = {
    # GPT-2 style: gelu, LayerNorm, biases, learned positions, tied; vocab 1000 pads to 1024 (128 x TP2)
    "gpt_tp2_pp2_tied": "--num-layers 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    # Llama style: swiglu, RMSNorm, rope, no biases, untied, GQA, qk-layernorm
    "llama_gqa_tp2_pp2": "--num-layers 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
                         "--disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention "
                         "--num-query-groups 2 --qk-layernorm --tensor-model-parallel-size 2 "
                         "--pipeline-model-parallel-size 2",
    # Qwen2 style: QKV bias only, GQA with groups == TP, odd ffn
    "qwen_qkv_bias_tp4": "--num-layers 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                         "--disable-bias-linear --add-qkv-bias --group-query-attention --num-query-groups 4 "
                         "--ffn-hidden-size 96 --untie-embeddings-and-output-weights --tensor-model-parallel-size 4",
    # uneven first/last stages, tied (last stage holds the embedding copy)
    "uneven_pp4": "--num-layers 7 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
                  "--decoder-last-pipeline-num-layers 2",
    # interleaved: 2 virtual stages per rank
    "vpp2_tp2_pp2": "--num-layers 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                    "--num-layers-per-virtual-pipeline-stage 2 --swiglu --normalization RMSNorm "
                    "--position-embedding-type rope",
    # uneven + interleaved
    "uneven_vpp2_pp4": "--num-layers 12 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                       "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2",
    # embedding and loss counted as pipeline layers
    "account_embedding_loss_pp4": "--num-layers 6 --pipeline-model-parallel-size 4 "
                                  "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
    # --pipeline-model-parallel-layout: uneven chunks over 2 ranks x 2 virtual stages
    "layout_pp2_vpp2": "--num-layers 6 --pipeline-model-parallel-size 2 "
                       "--pipeline-model-parallel-layout 'Ett|tt|t|tL'",
    # --quick-geglu: a gated MLP (fc1 holds 2 x ffn rows) with the quick-GELU
    "quick_geglu_tp2": "--num-layers 2 --quick-geglu --tensor-model-parallel-size 2",
    # Nemotron style: squared-ReLU MLP (not gated), LayerNorm, RoPE, no biases, untied, TP 2 x PP 2
    "squared_relu_tp2_pp2": "--num-layers 4 --squared-relu --disable-bias-linear --position-embedding-type rope "
                            "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
                            "--pipeline-model-parallel-size 2",
    # gpt-oss style: a learnable softmax offset per head (sharded over TP)
    "learnable_softmax_tp2": "--num-layers 2 --softmax-type learnable --tensor-model-parallel-size 2",
    # MoE: EP4, shared experts, a dense layer in the pattern, swiglu, no biases
    "moe_ep4_shared": "--num-layers 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
                      "--disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
                      "--moe-shared-expert-intermediate-size 48 --moe-layer-freq [1,0,1,1] "
                      "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall",
    # Qwen2-MoE style: shared experts behind a sigmoid gate (one weight row per layer), TP 2 x EP 2
    "moe_shared_gate_tp2_ep2": "--num-layers 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                               "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
                               "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate "
                               "--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                               "--moe-token-dispatcher-type alltoall",
    # Qwen3-MoE style (presets qwen3_30b_a3b, qwen3_235b_a22b): head dim above hidden / heads, QK RMSNorm, GQA,
    # every layer MoE with a small expert ffn and top-k of 4, no shared experts, untied
    "qwen3_moe_ep4": "--num-layers 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                     "--disable-bias-linear --group-query-attention --num-query-groups 2 --kv-channels 16 "
                     "--qk-layernorm --untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 4 "
                     "--moe-ffn-hidden-size 24 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall",
    # DeepSeek-V3 style multi-latent attention: query and key-value latents with their norms, rope on a
    # separate head part, value heads narrower than query heads, TP 2 x PP 2 (built with the TE spec's CPU
    # stand-ins: replicated down projections, norms fused into the up projections)
    "mla_q_lora_tp2_pp2": "--num-layers 4 --transformer-impl transformer_engine --multi-latent-attention "
                          "--q-lora-rank 24 --kv-lora-rank 16 "
                          "--qk-head-dim 12 --qk-pos-emb-head-dim 4 --v-head-dim 8 --qk-layernorm --swiglu "
                          "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
                          "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
                          "--pipeline-model-parallel-size 2",
    # DeepSeek-V2-Lite style: no query latent (one query projection), LayerNorm without --qk-layernorm, biases
    # on the output projection and the MLP, TP 4
    "mla_no_q_lora_tp4": "--num-layers 2 --transformer-impl transformer_engine --multi-latent-attention "
                         "--kv-lora-rank 28 --qk-head-dim 8 "
                         "--qk-pos-emb-head-dim 4 --v-head-dim 12 --position-embedding-type rope "
                         "--tensor-model-parallel-size 4",
    # multi-token prediction, two layers on the last stage: tied (the last stage's output weight is the embedding
    # group's copy) with learned positions (the MTP block's own embedding holds a position table too)
    "mtp2_tied_tp2_pp2": "--num-layers 4 --mtp-num-layers 2 --tensor-model-parallel-size 2 "
                         "--pipeline-model-parallel-size 2",
    # DeepSeek-V3 style: MTP over an MLA + MoE last layer (the MTP layer repeats its spec), untied, on a layout
    # whose last stage holds one decoder layer, the MTP layer and the loss
    "mtp_mla_moe_layout": "--num-layers 3 --mtp-num-layers 1 --transformer-impl transformer_engine "
                          "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12 "
                          "--qk-pos-emb-head-dim 4 --v-head-dim 8 --swiglu --normalization RMSNorm "
                          "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
                          "--num-experts 4 --moe-layer-freq [0,0,1] --moe-ffn-hidden-size 32 "
                          "--moe-shared-expert-intermediate-size 16 --expert-model-parallel-size 2 "
                          "--moe-token-dispatcher-type alltoall --pipeline-model-parallel-size 2 "
                          "--pipeline-model-parallel-layout 'Ett|tmL'",
    # the two MoE cases above and below with sequence parallelism (Transformer Engine's spec, on its CPU stand-ins:
    # torch's norms refuse SP): the router's weight and bias and the shared-expert gate are all-reduced over TP
    # too (test_tp_replicated_grads_equal_megatron)
    "moe_shared_gate_tp2_ep2_sp": "--num-layers 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                                  "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
                                  "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate "
                                  "--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                                  "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall "
                                  "--sequence-parallel --transformer-impl transformer_engine",
    "moe_tp2_ep2_etp1_sp": "--num-layers 4 --num-experts 4 --moe-layer-freq 2 --tensor-model-parallel-size 2 "
                           "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
                           "--moe-token-dispatcher-type alltoall --sequence-parallel --qk-layernorm "
                           "--transformer-impl transformer_engine",
    # Qwen3-Next style attention: an output gate (linear_qkv projects one more head-width per head), QK RMSNorm,
    # GQA, TP 2 x PP 2
    "output_gate_tp2_pp2": "--num-layers 4 --attention-output-gate --qk-layernorm --swiglu --normalization RMSNorm "
                           "--position-embedding-type rope --disable-bias-linear --group-query-attention "
                           "--num-query-groups 2 --untie-embeddings-and-output-weights "
                           "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    # Llama-4 style: QK L2 norm (no weights, so nothing for TP to all-reduce), with --qk-layernorm given too (the
    # L2 norm takes its place), TP 4 + SP on the TE spec's stand-ins
    "qk_l2_norm_tp4_sp": "--num-layers 2 --qk-l2-norm --qk-layernorm --swiglu --normalization RMSNorm "
                         "--position-embedding-type rope --disable-bias-linear --group-query-attention "
                         "--num-query-groups 4 --tensor-model-parallel-size 4 --sequence-parallel "
                         "--transformer-impl transformer_engine",
    # both with MoE layers and a QKV bias: TP 2 x EP 2 with sequence parallelism
    "gate_l2_moe_tp2_ep2_sp": "--num-layers 2 --attention-output-gate --qk-l2-norm --add-qkv-bias --num-experts 4 "
                              "--moe-router-topk 2 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                              "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall "
                              "--sequence-parallel --transformer-impl transformer_engine",
    # MoE: TP2 with EP2 and expert-TP1, gelu with biases (router bias too), every 2nd layer MoE
    "moe_tp2_ep2_etp1": "--num-layers 4 --num-experts 4 --moe-layer-freq 2 --tensor-model-parallel-size 2 "
                        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
                        "--moe-token-dispatcher-type alltoall",
}


@pytest.fixture(scope="module")
def megatron_results():
    cases = [(case_id, parse_args(shlex.split(BASE + argv))) for case_id, argv in CASES.items()]
    return dict(cases), run_on_gloo_world(WORLD, cases)


def _estimated(cfg, pp_rank):
    counts = {}
    for op in rank_params(cfg, pp_rank).ops:
        counts[(op.op, op.layer)] = counts.get((op.op, op.layer), 0) + op.numel
    return counts


@pytest.mark.parametrize("case_id", list(CASES))
def test_rank_params_equal_megatron(megatron_results, case_id):
    configs, results = megatron_results
    cfg = configs[case_id]
    ranks = [r for r in results if r[0] == case_id]
    assert len(ranks) == WORLD
    for _, rank, coords, measured, error in ranks:
        assert error is None, f"rank {rank}: megatron-core failed to build: {error}"
        measured = {k: v for k, v in measured.items() if k != TP_REPLICATED}
        estimated = _estimated(cfg, coords["pp"])
        assert estimated == measured, f"rank {rank} {coords}"
        assert rank_params(cfg, coords["pp"]).total == sum(measured.values())


def test_expert_params_are_the_expert_ops(megatron_results):
    configs, _ = megatron_results
    cfg = configs["moe_ep4_shared"]
    stage = rank_params(cfg, 0)
    expert_ops = {op.op for op in stage.ops if op.is_expert}
    assert expert_ops == {"layers.*.mlp.experts.linear_fc1", "layers.*.mlp.experts.linear_fc2"}
    assert stage.expert + stage.dense == stage.total


def test_tied_copy_only_on_last_stage(megatron_results):
    configs, _ = megatron_results
    cfg = configs["gpt_tp2_pp2_tied"]
    last = [op for op in rank_params(cfg, 1).ops if op.op == "output_layer"]
    assert len(last) == 1 and last[0].shared_embedding
    assert not [op for op in rank_params(cfg, 0).ops if op.op == "output_layer"]


@pytest.mark.parametrize("case_id", [c for c in CASES if "tensor-model-parallel-size" in CASES[c]])
def test_tp_replicated_grads_equal_megatron(megatron_results, case_id):
    """The gradient elements megatron-core all-reduces over TP after the backward (parameters tagged
    sequence_parallel under SP, qk-layernorm weights), per rank, equal the communication model's per stage."""
    from estimator.comm import tp_replicated_grad_elements
    configs, results = megatron_results
    cfg = configs[case_id]
    per_stage = tp_replicated_grad_elements(cfg)
    for _, rank, coords, measured, error in [r for r in results if r[0] == case_id]:
        assert error is None, error
        assert per_stage[coords["pp"]] == measured.get(TP_REPLICATED, 0), f"rank {rank} {coords}"



def test_ddp_num_buckets_sets_the_bucket_size_from_megatrons_parameter_count(megatron_results):
    """--ddp-num-buckets N: Megatron-LM's get_model takes the bucket size as the rank's parameters (every model
    chunk megatron-core builds for it) // N; the first stage's, as only its first chunk is bucketed."""
    _, results = megatron_results
    case = "vpp2_tp2_pp2"
    built = {sum(v for k, v in counts.items() if k != TP_REPLICATED)
             for c, _, coords, counts, _ in results if c == case and coords["pp"] == 0}
    assert len(built) == 1    # the TP ranks hold equal counts
    (total,) = built
    cfg = parse_args(shlex.split(BASE + CASES[case] + " --overlap-grad-reduce --ddp-num-buckets 3"))
    assert cfg.ddp_bucket_size == total // 3
    with pytest.raises(ConfigError, match="Cannot specify both"):
        parse_args(shlex.split(BASE + CASES[case] + " --ddp-num-buckets 3 --ddp-bucket-size 1000"))
