"""estimator.args: Megatron flag names, defaults, derived values and validation.

Derived values and messages are checked against megatron-core itself where it owns the rule (TransformerConfig,
the microbatch calculator); Megatron-LM's training-side rules (ffn 4h / swiglu, vocab padding) are checked by
their definitions. Messages are compared ignoring whitespace: megatron-core concatenates some strings without
spaces ("...divisible bythe middle...").
"""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.args import ConfigError, TrainingConfig, parse_args

REPO = Path(__file__).resolve().parents[1]
SMALL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --max-position-embeddings 64 "
         "--micro-batch-size 1 --vocab-size 1000 ")


def parse(extra: str) -> TrainingConfig:
    return parse_args(shlex.split(SMALL + extra))


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _megatron_error(**kwargs) -> str:
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError) as info:
        TransformerConfig(**kwargs)
    return str(info.value)


def test_example_launch_script_parses():
    # Run the bundled sed-replaced launch script with the command captured, i.e. exactly the argv a user passes.
    from estimator.cli import split_own_options
    script = REPO / "examples" / "estimate_llama2_7b.sh"
    captured = subprocess.run(["bash", "-c", 'get-training-info() { printf "%s\\0" "$@"; }; source "$0"',
                               str(script)], capture_output=True, check=True, cwd=REPO).stdout.decode()
    argv = captured.split("\0")[:-1]
    assert argv[:2] == ["--nproc_per_node", "8"] and argv[10] == "pretrain_gpt.py"   # a torchrun line
    cfg = parse_args(split_own_options(argv)[0])
    assert cfg.world_size == cfg.nproc_per_node * cfg.nnodes == 16
    assert cfg.data_parallel_size == cfg.world_size // (cfg.tensor_model_parallel_size
                                                        * cfg.pipeline_model_parallel_size)
    assert cfg.params_dtype == "bf16" and cfg.accumulate_allreduce_grads_in_fp32
    assert cfg.attention_kernel == "flash"
    assert "--lr" in cfg.ignored_args and "--data-path" in cfg.ignored_args
    flags = [a for a in cfg.ignored_args if a.startswith("--")]
    assert len(flags) == len(set(flags))


def test_defaults_are_megatrons():
    cfg = parse("")
    assert cfg.ffn_hidden_size == 4 * cfg.hidden_size
    assert cfg.kv_channels == cfg.hidden_size // cfg.num_attention_heads
    assert cfg.num_query_groups == cfg.num_attention_heads
    assert cfg.expert_tensor_parallel_size == cfg.tensor_model_parallel_size
    assert cfg.global_batch_size == cfg.micro_batch_size * cfg.data_parallel_size
    assert cfg.params_dtype == "fp32"
    assert cfg.add_bias_linear and cfg.add_qkv_bias
    assert (cfg.normalization, cfg.position_embedding_type, cfg.transformer_impl) == \
        ("LayerNorm", "learned_absolute", "transformer_engine")
    assert cfg.make_vocab_size_divisible_by == 128 and cfg.moe_router_topk == 2


def test_numerics_and_fusion_flags_are_megatron_lms():
    # Megatron-LM (megatron/training/arguments.py, core 0.16.1): --attention-softmax-in-fp32 and
    # --no-persist-layer-norm are store_true, the --no-*-fusion flags store_false; validate_args turns the gelu
    # fusion off without biases, the rope fusion off without rope, and --apply-query-key-layer-scaling sets
    # attention_softmax_in_fp32. None of them is ignored any more.
    cfg = parse("")
    assert not cfg.attention_softmax_in_fp32 and not cfg.apply_query_key_layer_scaling and not cfg.no_persist_layer_norm
    assert cfg.bias_gelu_fusion and cfg.bias_swiglu_fusion and cfg.masked_softmax_fusion and cfg.bias_dropout_fusion
    assert cfg.gradient_accumulation_fusion and not cfg.apply_rope_fusion       # learned positions: no rope fusion
    assert (cfg.cross_entropy_loss_fusion, cfg.cross_entropy_fusion_impl, cfg.calculate_per_token_loss) == \
        (False, "native", False)
    assert parse("--position-embedding-type rope").apply_rope_fusion
    assert not parse("--disable-bias-linear").bias_gelu_fusion
    assert parse("--disable-bias-linear --swiglu").bias_swiglu_fusion
    assert parse("--apply-query-key-layer-scaling").attention_softmax_in_fp32
    flags = ("--attention-softmax-in-fp32 --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
             "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-gradient-accumulation-fusion "
             "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te --rotary-interleaved --calculate-per-token-loss "
             "--apply-residual-connection-post-layernorm --bf16 --fp32-residual-connection")
    cfg = parse(flags)
    assert cfg.ignored_args == []
    assert cfg.attention_softmax_in_fp32 and cfg.no_persist_layer_norm and cfg.cross_entropy_fusion_impl == "te"
    assert not (cfg.masked_softmax_fusion or cfg.bias_gelu_fusion or cfg.bias_swiglu_fusion or cfg.bias_dropout_fusion
                or cfg.apply_rope_fusion or cfg.gradient_accumulation_fusion)
    assert cfg.rotary_interleaved and cfg.calculate_per_token_loss and cfg.apply_residual_connection_post_layernorm
    assert not any("fp32-residual" in w for w in cfg.warnings)   # modelled: estimator.residual
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg


def test_swiglu_ffn_rule():
    for hidden in (64, 4096, 5120, 8192):
        cfg = parse(f"--swiglu --hidden-size {hidden}")
        assert cfg.ffn_hidden_size == int((4 * hidden * 2 / 3) / 64) * 64


def test_num_query_groups_only_with_gqa_flag():
    assert parse("--num-query-groups 2").num_query_groups == 8  # Megatron ignores it without the flag
    assert parse("--group-query-attention --num-query-groups 2").num_query_groups == 2


def test_vocab_padding_and_tokenizers():
    cfg = parse("--tensor-model-parallel-size 2 --nproc_per_node 2")
    multiple = cfg.make_vocab_size_divisible_by * cfg.tensor_model_parallel_size
    assert cfg.padded_vocab_size % multiple == 0
    assert 0 <= cfg.padded_vocab_size - cfg.vocab_size < multiple
    gpt2 = parse_args(shlex.split(SMALL.replace("--vocab-size 1000", "--tokenizer-type GPT2BPETokenizer")))
    assert gpt2.padded_vocab_size % 128 == 0 and gpt2.padded_vocab_size >= 50257
    null = parse("--tokenizer-type NullTokenizer")
    assert null.padded_vocab_size % 128 == 0
    with pytest.raises(ConfigError, match="--vocab-size"):
        parse_args(shlex.split(SMALL.replace("--vocab-size 1000", "--tokenizer-type HuggingFaceTokenizer")))


def test_torchrun_spellings_and_elastic_nnodes():
    a = parse("--nproc_per_node 4 --nnodes 2 --node_rank 1 --master_addr h --master_port 1234")
    b = parse("--nproc-per-node=4 --nnodes 1:2 --node-rank 1 --master-addr h --master-port 1234")
    assert a.world_size == b.world_size == 8
    assert not a.ignored_args and not b.ignored_args


def test_megatron_flags_that_change_nothing_are_ignored_with_their_values():
    cfg = parse("--lr 3e-4 --split 949,50,1 --log-interval=10 --use-cpu-initialization --save /ckpt "
                "--rdzv_backend c10d --data-path 0.5 /a 0.5 /b --eval-iters 10")
    assert cfg.ignored_args == ["--lr", "3e-4", "--split", "949,50,1", "--log-interval=10",
                                "--use-cpu-initialization", "--save", "/ckpt", "--rdzv_backend", "c10d",
                                "--data-path", "0.5", "/a", "0.5", "/b", "--eval-iters", "10"]


@pytest.mark.parametrize("flag,hint", [
    ("--tensor-model-paralel-size 2", "--tensor-model-parallel-size"),
    ("--num-layer 4", "--num-layers"),
    ("--foo=bar", None),
    ("--preset llama3_8b", None),    # get-training-info's own option, not Megatron's: never suggested as itself
])
def test_a_flag_megatron_lm_lacks_is_an_error_with_a_suggestion(flag, hint):
    with pytest.raises(ConfigError) as err:
        parse(flag)
    msg = str(err.value)
    assert msg.startswith("unrecognized argument " + flag.split()[0].split("=")[0])
    assert (f"did you mean {hint}" in msg) if hint else ("did you mean" not in msg)
    if hint:
        names = msg.split("did you mean ", 1)[1].rstrip("?)").split(" or ")
        assert len(names) == len(set(names)), msg      # each suggestion once


@pytest.mark.parametrize("flags,reason", [
    ("--mtp-standalone", "multi-token prediction"),
    ("--cp-comm-type a2a", "other than p2p"),
    ("--outer-dp-sharding-strategy optim", "hybrid sharded data parallelism"),
    ("--optimizer muon", "Muon's states"),
    ("--enable-cuda-graph", "CUDA graphs"),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep", "DeepEP"),
    ("--num-experts 8 --moe-token-dispatcher-type flex", "DeepEP / HybridEP"),
])
def test_memory_relevant_flags_that_are_not_modelled_are_refused(flags, reason):
    with pytest.raises(ConfigError, match="changes memory or communication and cannot be estimated: .*" + reason):
        parse(flags)


def test_multi_latent_attention_is_parsed_with_megatron_lm_defaults():
    cfg = parse("--multi-latent-attention")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim,
            cfg.rope_type) == (None, 32, 128, 64, 128, None)
    cfg = parse("--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --rope-type rope")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_type) == (1536, 512, "rope")


@pytest.mark.parametrize("flags,message", [
    ("--multi-latent-attention --group-query-attention --num-query-groups 2", "mutually exclusive"),
    ("--multi-latent-attention --transformer-impl local", "Transformer Engine spec"),
    ("--rope-type yarn", "needs --multi-latent-attention"),
    ("--multi-latent-attention --rope-type ntk", "choose from rope, yarn"),
    ("--multi-latent-attention --qk-pos-emb-head-dim 63", "must be even"),
    ("--multi-latent-attention --q-lora-rank 0", "must be positive"),
])
def test_multi_latent_attention_refuses_what_megatron_refuses(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(flags)


@pytest.mark.parametrize("flags,message", [
    ("--recompute-granularity selective --recompute-modules core_attn mla_up_proj --multi-latent-attention "
     "--transformer-impl transformer_engine", "--recompute-modules mla_up_proj changes memory and cannot be estimated"),
    ("--recompute-granularity selective --recompute-modules moe_act --num-experts 4",
     "moe_act in recompute_modules is only supported with moe_grouped_gemm"),
    ("--recompute-granularity selective --recompute-modules mla_up_proj", "only supported with multi_latent_attention"),
    ("--recompute-modules attention", "Invalid choices for recompute_modules"),
    ("--num-experts 4 --moe-router-topk 2 --moe-apply-probs-on-input", "only works with `moe_router_topk`=1"),
])
def test_recompute_modules_refuse_what_megatron_refuses_and_what_is_not_modelled(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(flags)


def test_recompute_modules_parse():
    from estimator.args import recompute_modules
    cfg = parse("--recompute-granularity selective --recompute-modules mlp layernorm")
    assert recompute_modules(cfg) == ("mlp", "layernorm") and "--recompute-modules" not in cfg.ignored_args
    assert recompute_modules(parse("--recompute-granularity selective")) == ("core_attn",)
    assert recompute_modules(parse("--recompute-modules mlp")) == ()     # without selective recompute: none


def test_refused_unless_default_values_pass():
    cfg = parse("--cp-comm-type p2p --outer-dp-sharding-strategy no_shard --cuda-graph-impl none")
    assert "--cp-comm-type" in cfg.ignored_args


def test_flags_modelled_as_absent_are_labelled_not_ignored():
    cfg = parse("--moe-permute-fusion --lr 1e-4")
    assert cfg.conservative_args == ["--moe-permute-fusion"] and cfg.ignored_args == ["--lr", "1e-4"]


def test_every_megatron_flag_has_one_policy():
    from estimator import flag_policy
    from estimator.args import _FLAGS, TOOL_FLAGS
    from estimator.megatron_flags import MEGATRON_LM
    for table in (flag_policy.REFUSED, flag_policy.REFUSED_UNLESS, flag_policy.CONSERVATIVE):
        assert set(table) <= set(MEGATRON_LM), set(table) - set(MEGATRON_LM)   # no stale names
    parsed = set(_FLAGS) - set(TOOL_FLAGS)
    assert parsed <= set(MEGATRON_LM) | set(flag_policy.TORCHRUN), parsed - set(MEGATRON_LM)
    for a, b in ((parsed, flag_policy.REFUSED), (parsed, flag_policy.CONSERVATIVE),
                 (flag_policy.REFUSED, flag_policy.CONSERVATIVE), (parsed, flag_policy.REFUSED_UNLESS)):
        assert not set(a) & set(b), set(a) & set(b)


# The flags issue 14 found listed as ignored although they change memory: each is now parsed (modelled) or refused.
MEMORY_FLAGS = ["--fp8-format", "--fp8-param-gather", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                "--use-torch-fsdp2", "--cpu-offloading-num-layers", "--optimizer-cpu-offload",
                "--multi-latent-attention", "--mtp-num-layers", "--pipeline-model-parallel-layout",
                "--cross-entropy-loss-fusion", "--quick-geglu", "--tp-comm-overlap"]


@pytest.mark.parametrize("flag", MEMORY_FLAGS)
def test_issue14_memory_flags_are_never_ignored(flag):
    from estimator import flag_policy
    from estimator.args import _FLAGS
    assert flag in _FLAGS or flag in flag_policy.REFUSED


def test_recompute_activations_means_selective():
    assert parse("--recompute-activations").recompute_granularity == "selective"


@pytest.mark.parametrize("flags,kernel", [
    ("--transformer-impl local", "unfused"),
    ("--transformer-impl local --use-flash-attn", "unfused"),
    ("--use-flash-attn --bf16", "flash"),
    ("--bf16", "flash"),
    ("--fp16", "flash"),
    ("", "unfused"),                          # fp32: TE has no flash / fused attention, 'auto' falls back
    ("--attention-backend unfused --bf16", "unfused"),
    ("--attention-backend fused --bf16", "flash"),
    ("--transformer-impl local --attention-backend local", "unfused"),
])
def test_attention_kernel(flags, kernel):
    assert parse(flags).attention_kernel == kernel


@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_flash_backend_in_fp32_is_flagged(backend):
    cfg = parse(f"--attention-backend {backend}")
    assert cfg.attention_kernel == "flash" and any("16-bit" in w for w in cfg.warnings)
    assert not any("16-bit" in w for w in parse(f"--attention-backend {backend} --bf16").warnings)


def test_sequence_parallel_turned_off_without_tp():
    cfg = parse("--sequence-parallel")
    assert cfg.sequence_parallel is False and cfg.warnings


def test_virtual_pipeline_size():
    cfg = parse("--num-layers 8 --pipeline-model-parallel-size 2 --nproc_per_node 2 "
                "--num-layers-per-virtual-pipeline-stage 2")
    assert cfg.virtual_pipeline_model_parallel_size == 8 // 2 // 2
    assert parse("--pipeline-model-parallel-size 2 --nproc_per_node 2 --num-virtual-stages-per-pipeline-rank 2"
                 ).virtual_pipeline_model_parallel_size == 2
    # Megatron-LM 0.16 dropped the old spelling; its parser fails on it, and so does this one, naming the new one.
    with pytest.raises(ConfigError, match="did you mean --num-virtual-stages-per-pipeline-rank"):
        parse("--pipeline-model-parallel-size 2 --nproc_per_node 2 --virtual-pipeline-model-parallel-size 2")


@pytest.mark.megatron
def test_microbatches_and_batch_error_match_megatron_core():
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    cfg = parse("--nproc_per_node 4 --micro-batch-size 2 --global-batch-size 64")
    calc = ConstantNumMicroBatchesCalculator(64, 2, cfg.data_parallel_size, False, 0)
    assert cfg.num_microbatches == calc.get()
    with pytest.raises(AssertionError) as theirs:
        ConstantNumMicroBatchesCalculator(60, 8, 4, False, 0)
    with pytest.raises(ConfigError) as ours:
        parse("--nproc_per_node 4 --micro-batch-size 8 --global-batch-size 60")
    assert _squash(str(ours.value)) == _squash(str(theirs.value))


def test_expert_data_parallel_size():
    cfg = parse("--nproc_per_node 8 --tensor-model-parallel-size 2 --num-experts 8 --expert-model-parallel-size 4 "
                "--expert-tensor-parallel-size 1 --sequence-parallel")
    assert cfg.expert_data_parallel_size == cfg.world_size // (cfg.expert_model_parallel_size
                                                              * cfg.expert_tensor_parallel_size)


@pytest.mark.parametrize("flags,core_kwargs", [
    ("--hidden-size 96 --num-attention-heads 6 --tensor-model-parallel-size 4 --nproc_per_node 4",
     dict(num_layers=4, hidden_size=96, num_attention_heads=6, tensor_model_parallel_size=4)),
    ("--hidden-size 96 --num-attention-heads 12 --group-query-attention --num-query-groups 6 "
     "--tensor-model-parallel-size 4 --nproc_per_node 4",
     dict(num_layers=4, hidden_size=96, num_attention_heads=12, num_query_groups=6, tensor_model_parallel_size=4)),
    ("--num-layers 7 --pipeline-model-parallel-size 4 --nproc_per_node 4 --decoder-first-pipeline-num-layers 1 "
     "--decoder-last-pipeline-num-layers 1",
     dict(num_layers=7, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=4,
          num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)),
    ("--num-layers 4 --pipeline-model-parallel-size 4 --nproc_per_node 4 --decoder-first-pipeline-num-layers 2 "
     "--decoder-last-pipeline-num-layers 2",
     dict(num_layers=4, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=4,
          num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)),
    ("--num-layers 12 --pipeline-model-parallel-size 4 --nproc_per_node 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--decoder-first-pipeline-num-layers 3",
     dict(num_layers=12, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=4,
          virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3)),
    ("--num-experts 4 --moe-router-topk 1",
     dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_moe_experts=4, moe_router_topk=1)),
])
@pytest.mark.megatron
def test_validation_messages_match_megatron_core(flags, core_kwargs):
    import torch

    core_kwargs.setdefault("pipeline_dtype", torch.float32)
    theirs = _megatron_error(**core_kwargs)
    with pytest.raises(ConfigError) as ours:
        parse(flags)
    assert _squash(str(ours.value)) == _squash(theirs)


@pytest.mark.parametrize("flags,message", [
    ("--nproc_per_node 3 --tensor-model-parallel-size 2", "is not divisible by total_model_size"),
    ("--num-layers 3 --pipeline-model-parallel-size 2 --nproc_per_node 2", "Number of layers should be divisible"),
    ("--num-experts 6 --expert-model-parallel-size 4 --nproc_per_node 4", "Number of experts should be a multiple"),
    ("--expert-model-parallel-size 2 --nproc_per_node 2", "num_experts must be non None"),
    ("--recompute-granularity full", "recompute_method must be"),
    ("--bf16 --fp16", "Only one of"),
    ("--fp32-residual-connection", "residual connection in fp32 only supported when using fp16 or bf16."),
    ("--cross-entropy-fusion-impl fast", "invalid choice"),
    ("--overlap-param-gather", "--overlap-param-gather only supported with distributed optimizer"),
    ("--seq-length 128", "must be greater than or equal to seq_length"),
    ("--num-layers x", "invalid int value"),
    ("--normalization BatchNorm", "invalid choice"),
    ("--batch-size 4", "--batch-size argument is no longer valid"),
    ("--context-parallel-size 2 --nproc_per_node 2 --seq-length 30", "multiple of 2 * context-parallel-size"),
    ("--pipeline-model-parallel-size 2 --nproc_per_node 2 --num-virtual-stages-per-pipeline-rank 2 "
     "--no-overlap-p2p-communication", "should be greater than 2"),
])
def test_invalid_combinations(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(flags)


@pytest.mark.parametrize("extra", ["--moe-router-pre-softmax", "--moe-router-load-balancing-type sinkhorn",
                                   "--moe-router-score-function sigmoid"])
def test_top1_routing_is_valid_with_what_megatron_core_accepts(extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = parse("--num-experts 4 --moe-router-topk 1 " + extra)
    TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_moe_experts=4, moe_router_topk=1,
                      moe_router_pre_softmax=cfg.moe_router_pre_softmax,
                      moe_router_score_function=cfg.moe_router_score_function,
                      moe_router_load_balancing_type=cfg.moe_router_load_balancing_type[0]
                      if isinstance(cfg.moe_router_load_balancing_type, list)
                      else cfg.moe_router_load_balancing_type)   # accepted by megatron-core too


def test_missing_required():
    with pytest.raises(ConfigError, match="num_layers"):
        parse_args(shlex.split(SMALL.replace("--num-layers 4 ", "")))


def test_round_trip():
    cfg = parse("--num-experts 4 --moe-layer-freq ([1]*2+[0]*2)")
    assert cfg.moe_layer_freq == [1, 1, 0, 0]
    again = TrainingConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ConfigError):
        TrainingConfig.from_dict({"not_a_field": 1})


def test_hf_config_llama_and_override(tmp_path):
    hf = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 1000,
          "hidden_act": "silu", "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    cfg = parse_args(shlex.split(f"--hf-config {path} --seq-length 128 --micro-batch-size 1 --num-layers 2"))
    assert cfg.num_layers == 2  # flags win over the file
    assert cfg.hidden_size == hf["hidden_size"] and cfg.ffn_hidden_size == hf["intermediate_size"]
    assert cfg.num_query_groups == hf["num_key_value_heads"] and cfg.group_query_attention
    assert cfg.swiglu and cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
    assert not cfg.add_bias_linear and cfg.untie_embeddings_and_output_weights


def test_hf_config_mixtral_qwen_gpt2(tmp_path):
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64,
               "vocab_size": 1000, "num_local_experts": 8, "num_experts_per_tok": 2}
    qwen = dict(mixtral, model_type="qwen2")
    del qwen["num_local_experts"], qwen["num_experts_per_tok"]
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 8, "n_positions": 64, "vocab_size": 1000}
    configs = {}
    for name, hf in (("mixtral", mixtral), ("qwen", qwen), ("gpt2", gpt2)):
        (tmp_path / f"{name}.json").write_text(json.dumps(hf))
        configs[name] = parse_args(shlex.split(f"--hf-config {tmp_path / name}.json --seq-length 32 "
                                               "--micro-batch-size 1"))
    assert configs["mixtral"].num_experts == mixtral["num_local_experts"]
    assert configs["mixtral"].moe_ffn_hidden_size == mixtral["intermediate_size"]
    assert configs["qwen"].add_qkv_bias and not configs["qwen"].add_bias_linear
    qwen_moe = dict(mixtral, model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=96)
    del qwen_moe["num_local_experts"]
    qwen_moe["num_experts"] = 8
    (tmp_path / "qwen_moe.json").write_text(json.dumps(qwen_moe))
    cfg = parse_args(shlex.split(f"--hf-config {tmp_path / 'qwen_moe.json'} --seq-length 32 --micro-batch-size 1"))
    assert cfg.moe_shared_expert_intermediate_size == 96 and cfg.moe_shared_expert_gate
    assert configs["gpt2"].ffn_hidden_size == 4 * gpt2["n_embd"]
    assert not configs["gpt2"].untie_embeddings_and_output_weights
    assert configs["gpt2"].position_embedding_type == "learned_absolute"


# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3 on the HF hub), the fields that shape the model and its router's
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
               "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
               "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
               "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
               "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
               "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
               "vocab_size": 129280}


def test_hf_config_deepseek_v3_is_the_preset_and_names_what_it_does_not_use(tmp_path):
    """DeepSeek-V3's config.json: multi-latent attention with its latents' norms, three dense layers then MoE with
    one shared expert, one MTP layer, YaRN; the same model as `--preset deepseek_v3`, parameter for parameter, and
    without its MTP layer the report's 671B (DeepSeek-V3 technical report, arXiv 2412.19437). Its router options
    are listed as unused; DeepSeek-V2-Lite's form (no query latent) reads too."""
    from estimator.model import model_total_params
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    run = "--seq-length 4096 --micro-batch-size 1 --transformer-impl transformer_engine"
    cfg = parse_args(shlex.split(f"--hf-config {path} {run}"))
    assert cfg.multi_latent_attention and cfg.qk_layernorm and cfg.q_lora_rank == 1536 and cfg.mtp_num_layers == 1
    assert cfg.moe_layer_freq[:4] == [0, 0, 0, 1] and cfg.moe_shared_expert_intermediate_size == 2048
    assert cfg.rope_type == "yarn" and cfg.rotary_scaling_factor == 40
    assert sorted(a.split(":")[-1] for a in cfg.ignored_args) == sorted(
        ["scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"])
    from estimator.cli import _preset_flags
    assert model_total_params(cfg) == model_total_params(parse_args(_preset_flags("deepseek_v3") + shlex.split(run)))
    path.write_text(json.dumps({k: v for k, v in DEEPSEEK_V3.items() if k != "num_nextn_predict_layers"}))
    assert abs(model_total_params(parse_args(shlex.split(f"--hf-config {path} {run}"))) / 671e9 - 1) < 0.001
    lite = dict(DEEPSEEK_V3, model_type="deepseek_v2", q_lora_rank=None, num_hidden_layers=27, first_k_dense_replace=1)
    path.write_text(json.dumps(lite))
    assert parse_args(shlex.split(f"--hf-config {path} {run}")).q_lora_rank is None


def test_hf_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        parse(f"--hf-config {tmp_path}/missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse(f"--hf-config {tmp_path}/bad.json")
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="not supported"):
        parse(f"--hf-config {tmp_path}/t5.json")


def test_presets_parse():
    presets = sorted((REPO / "estimator" / "presets").glob("*.json"))
    assert len(presets) >= 7
    for preset in presets:
        data = json.loads(preset.read_text())
        cfg = parse_args(data["args"] + ["--micro-batch-size", "1", "--nproc_per_node", "8",
                                         "--nnodes", "8"])
        assert not cfg.ignored_args, preset.name


def test_estimator_modules_import_no_torch():
    code = ("import sys, estimator.args, estimator.model, estimator.hf_config; "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; sys.exit(bool(bad))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_pipeline_layout_sets_the_virtual_stages_and_layers():
    from estimator.model import layers_per_pp_rank, stage_layers
    cfg = parse("--num-layers 6 --pipeline-model-parallel-size 2 --nproc_per_node 2 "
                "--pipeline-model-parallel-layout Ett|tt|t,|(t)*1L")
    assert cfg.virtual_pipeline_model_parallel_size == 2
    assert [stage_layers(cfg, 0, 0), stage_layers(cfg, 1, 0), stage_layers(cfg, 0, 1), stage_layers(cfg, 1, 1)] \
        == [[0, 1], [2, 3], [4], [5]]
    assert [layers_per_pp_rank(cfg, p) for p in range(2)] == [3, 3]
    assert parse("--num-layers 2 --pipeline-model-parallel-size 2 --nproc_per_node 2 "
                 "--pipeline-model-parallel-layout Et|tL").virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("layout,extra,message", [
    ("tE|tL", "", "The first layer must be embedding"),
    ("Et|t", "", "The last layer must be loss"),
    ("Ett|tL", "", "Number of decoder layers 3must match num_layers 2"),
    ("Et|t|L", "", "must be divisible by pipeline_model_parallel_size"),
    ("Et|tx|L|", "", "Invalid layer character: x"),
    ("Et|tmL", "", "mtp"),
    ("Etm|tL", "--mtp-num-layers 1", "decoder layers must be placed before MTP layers"),
    ("Et|t|m|L", "--mtp-num-layers 1", "MTP layers on a stage other than the loss's"),
    ("Et|tL", "--num-virtual-stages-per-pipeline-rank 1", "No more than one of the following"),
    ("Et|tL", "--decoder-first-pipeline-num-layers 1", "cannot be set with other pipeline layout arguments"),
])
def test_pipeline_layout_errors(layout, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(f"--num-layers 2 --pipeline-model-parallel-size 2 --nproc_per_node 2 "
              f"--pipeline-model-parallel-layout {layout} {extra}")


def test_squared_relu_is_a_plain_mlp_and_refuses_what_megatron_refuses():
    from estimator import formulas as F
    from estimator.model import layer_ops
    cfg = parse("--squared-relu --disable-bias-linear")
    fc1 = next(op for op in layer_ops(cfg, 0) if op.op.endswith("linear_fc1"))
    assert fc1.shapes[0][0] == cfg.ffn_hidden_size == 4 * cfg.hidden_size
    sw = F.switches(cfg)
    assert sw["activation"] == "squared_relu" and F.kernels(cfg)["fuse_act"] is False
    assert F.switches(parse("--squared-relu --no-bias-gelu-fusion"))["activation"] == "squared_relu"
    with pytest.raises(ConfigError, match="--no-bias-gelu-fusion"):
        parse("--squared-relu")     # biases on, fusion on: megatron-core's TransformerConfig raises
    with pytest.raises(ConfigError, match="--squared-relu cannot be used with --swiglu"):
        parse("--squared-relu --swiglu --disable-bias-linear")


def test_quick_geglu_is_a_gated_mlp():
    from estimator import formulas as F
    from estimator.model import layer_ops
    cfg = parse("--quick-geglu")
    fc1 = next(op for op in layer_ops(cfg, 0) if op.op.endswith("linear_fc1"))
    assert fc1.shapes[0] == (2 * cfg.ffn_hidden_size, cfg.hidden_size) and cfg.ffn_hidden_size == 4 * cfg.hidden_size
    assert F.switches(cfg)["activation"] == "swiglu"
    with pytest.raises(ConfigError, match="--quick-geglu and --swiglu"):
        parse("--quick-geglu --swiglu")


def test_multi_latent_attention_needs_a_set_that_measured_it():
    # a set whose runs never had MLA (the H100 set; the modelled one) stops in one line: composing it from standard
    # attention's ops would be a wrong number. The default set measured it: its MLA labels answer.
    from estimator.cli import build_report
    argv = shlex.split("--preset llama2_7b --micro-batch-size 1 --multi-latent-attention --q-lora-rank 64 "
                       "--qk-layernorm")
    for name in ("gpu_h100", "modelled"):
        with pytest.raises(ConfigError, match="--multi-latent-attention changes memory .* measured no run with it") as err:
            build_report(argv + ["--formulas", name], reserved=False)
        assert "\n" not in str(err.value)
    report = build_report(argv, reserved=False)
    ops = report.estimate.ranks[0].per_op
    assert ops["layers.*.self_attention.linear_q_up_proj"]["saved"] > 0 and "layers.*.self_attention.linear_qkv" \
        not in ops
