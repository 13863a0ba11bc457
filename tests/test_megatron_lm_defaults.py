"""The harness builds the TransformerConfig that Megatron-LM builds for the same command line.

The expected values below are Megatron-LM's, written from a reading of `megatron/training/arguments.py` at the tag
core_v0.16.1 (the megatron-core version this project pins), not from megatron-core's TransformerConfig defaults,
which differ in places that change memory:
- argparse: `--attention-softmax-in-fp32` is store_true (off unless given; `_add_mixed_precision_args`), while
  TransformerConfig defaults `attention_softmax_in_fp32` to True; `--no-masked-softmax-fusion`,
  `--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion`, `--no-bias-dropout-fusion`, `--no-rope-fusion`,
  `--no-gradient-accumulation-fusion` are store_false (the fusions default on; TransformerConfig: off) and
  `--no-persist-layer-norm` is store_true (`_add_training_args`); the other fields' flags are generated from
  TransformerConfig's own defaults by `ArgumentGroupFactory` in `_add_network_size_args` (hidden and attention
  dropout 0.1, `--disable-bias-linear`, `--add-qkv-bias`, `--apply-query-key-layer-scaling`, `--norm-epsilon`
  1e-5 with dest layernorm_epsilon, `--init-method-std` 0.02, `--rotary-interleaved`, ...).
- validate_args: `--disable-bias-linear` turns bias_gelu_fusion off (not bias_swiglu_fusion); a bias everywhere
  sets add_qkv_bias; apply_rope_fusion is turned off unless the position embedding is rope;
  `--apply-query-key-layer-scaling` sets attention_softmax_in_fp32.
- core_transformer_config_from_args: copies every TransformerConfig field that is an args attribute, then
  persist_layer_norm = not no_persist_layer_norm, deallocate_pipeline_outputs = True, pipeline_dtype =
  params_dtype, num_query_groups only with --group-query-attention, num_layers_in_first/last_pipeline_stage from
  --decoder-first/last-pipeline-num-layers, and with --swiglu activation silu, gated_linear_unit and
  bias_activation_fusion = bias_swiglu_fusion (else bias_gelu_fusion).
On CPU, and only there, the fused kernels are off and a few CPU-only settings differ (harness.CPU_OVERRIDES).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
import torch.nn.functional as F  # noqa: E402

from estimator.args import parse_args  # noqa: E402
from tracer import harness  # noqa: E402

pytestmark = pytest.mark.megatron

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128",
        "--transformer-impl", "local"]

# Megatron-LM's values with no other flag (see the module docstring for where each comes from).
MEGATRON_LM = dict(
    attention_softmax_in_fp32=False, apply_query_key_layer_scaling=False, hidden_dropout=0.1, attention_dropout=0.1,
    add_bias_linear=True, add_qkv_bias=True, bias_activation_fusion=True, masked_softmax_fusion=True,
    bias_dropout_fusion=True, apply_rope_fusion=False, persist_layer_norm=True, gradient_accumulation_fusion=True,
    gated_linear_unit=False, activation_func=F.gelu, normalization="LayerNorm", layernorm_epsilon=1e-5,
    qk_layernorm=False, init_method_std=0.02, fp32_residual_connection=False,
    apply_residual_connection_post_layernorm=False, rotary_interleaved=False, cross_entropy_loss_fusion=False,
    cross_entropy_fusion_impl="native", calculate_per_token_loss=False, test_mode=False,
    layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False, num_query_groups=None,
    bf16=False, fp16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    deallocate_pipeline_outputs=True, num_layers_in_first_pipeline_stage=None, use_cpu_initialization=None)

BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)

# name -> (flags, Megatron-LM's values that differ from MEGATRON_LM)
CASES = {
    "plain": ([], {}),
    "bf16": (["--bf16"], BF16),
    "bf16_softmax_fp32": (["--bf16", "--attention-softmax-in-fp32"], {**BF16, "attention_softmax_in_fp32": True}),
    "qk_layer_scaling": (["--bf16", "--apply-query-key-layer-scaling"],
                         {**BF16, "apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True}),
    "no_bias": (["--disable-bias-linear"], dict(add_bias_linear=False, add_qkv_bias=False,
                                                bias_activation_fusion=False)),
    "swiglu": (["--swiglu"], dict(gated_linear_unit=True, activation_func=F.silu)),
    "swiglu_no_bias": (["--swiglu", "--disable-bias-linear"],   # only the gelu fusion needs the bias
                       dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False)),
    "rmsnorm": (["--normalization", "RMSNorm", "--norm-epsilon", "1e-6"],
                dict(normalization="RMSNorm", layernorm_epsilon=1e-6)),
    "no_dropout": (["--hidden-dropout", "0", "--attention-dropout", "0"], dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "rope": (["--position-embedding-type", "rope", "--rotary-interleaved"],
             dict(apply_rope_fusion=True, rotary_interleaved=True)),
    "gqa_qk_norm": (["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm", "--add-qkv-bias",
                     "--disable-bias-linear"],
                    dict(num_query_groups=2, qk_layernorm=True, add_bias_linear=False, bias_activation_fusion=False)),
    "no_fusions": (["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                    "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                    "--position-embedding-type", "rope"],
                   dict(masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                        persist_layer_norm=False, gradient_accumulation_fusion=False)),
    "fp16_misc": (["--fp16", "--fp32-residual-connection", "--apply-residual-connection-post-layernorm",
                   "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--init-method-std", "0.01",
                   "--use-cpu-initialization"],
                  dict(fp16=True, params_dtype=torch.float16, pipeline_dtype=torch.float16,
                       fp32_residual_connection=True, apply_residual_connection_post_layernorm=True,
                       cross_entropy_loss_fusion=True, calculate_per_token_loss=True, init_method_std=0.01,
                       use_cpu_initialization=True)),
    # --moe-expert-capacity-factor (float), --moe-pad-expert-input-to-capacity (store_true) and
    # --moe-token-drop-policy (choices probs|position) from _add_moe_args, copied as they are
    "moe_capacity": (["--num-experts", "4", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
                      "--moe-token-drop-policy", "position"],
                     dict(num_moe_experts=4, moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
                          moe_token_drop_policy="position")),
    "uneven_pp": (["--nproc_per_node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "5",
                   "--decoder-first-pipeline-num-layers", "2"],
                  dict(num_layers_in_first_pipeline_stage=2)),
}

# The harness's deliberate differences on CPU: no fused CUDA kernel runs there, weights are created on CPU, and
# pipeline sends over gloo are not overlapped. Nothing else may differ.
CPU_ONLY = {"bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
            "persist_layer_norm", "gradient_accumulation_fusion", "moe_permute_fusion", "use_cpu_initialization",
            "overlap_p2p_comm", "batch_p2p_comm"}


def _config(flags):
    cfg = parse_args(BASE + flags)
    return cfg, harness.extra_flags(cfg.ignored_args)


def _expected(name):
    return {**MEGATRON_LM, **CASES[name][1]}


def _mismatches(actual, expected):
    return {k: (actual(k), v) for k, v in expected.items() if actual(k) != v}


@pytest.mark.parametrize("name", CASES)
def test_megatron_lm_kwargs_equal_megatron_lm(name):
    # What core_transformer_config_from_args passes, before any device-specific change.
    from megatron.core.transformer.transformer_config import TransformerConfig
    defaults = TransformerConfig.__dataclass_fields__
    cfg, extra = _config(CASES[name][0])
    kw = harness.megatron_lm_kwargs(cfg, extra)   # a field it leaves out keeps TransformerConfig's default
    assert _mismatches(lambda k: kw[k] if k in kw else defaults[k].default, _expected(name)) == {}
    # Every flag above is one the estimator parses (so a trace header records it), but the harness's own.
    harness_only = {flag for flag, _, _ in harness._EXTRA_FLAGS.values()}
    assert [t for t in cfg.ignored_args if t.startswith("--") and t not in harness_only] == []


@pytest.mark.parametrize("name", CASES)
def test_cpu_transformer_config_differs_only_in_cpu_overrides(name):
    cfg, extra = _config(CASES[name][0])
    tc = harness.transformer_config(cfg, extra)     # this machine has no GPU: the CPU path
    assert harness.on_cpu()
    assert set(harness.CPU_OVERRIDES) == CPU_ONLY
    expected = {**_expected(name), **harness.CPU_OVERRIDES}
    expected["num_query_groups"] = expected["num_query_groups"] or cfg.num_attention_heads  # TransformerConfig's own
    assert _mismatches(lambda k: getattr(tc, k), expected) == {}


def test_softmax_precision_is_megatron_lm_s_not_megatron_core_s():
    # The difference this file exists for: megatron-core's own default would keep a bf16 run's softmax in fp32
    # (b * a/t * s * s * 4 bytes more per layer on the unfused path).
    from megatron.core.transformer.transformer_config import TransformerConfig
    assert TransformerConfig.__dataclass_fields__["attention_softmax_in_fp32"].default is True
    for flags, want in ((["--bf16"], False), (["--bf16", "--attention-softmax-in-fp32"], True),
                        (["--bf16", "--apply-query-key-layer-scaling"], True)):
        cfg, extra = _config(flags)
        assert harness.transformer_config(cfg, extra).attention_softmax_in_fp32 is want


def test_gpu_path_turns_off_only_kernels_megatron_core_cannot_find(monkeypatch):
    # On a GPU the harness keeps Megatron-LM's values except where megatron-core would refuse to build the model:
    # gradient-accumulation fusion without apex's extension, the persistent layer norm with the local spec's torch
    # norm (no apex), RoPE fusion without TE's kernel, the masked softmax without its extension (the stand-ins turn
    # the last two back on after construction). This machine has none of them, so they go off; the rest stays
    # Megatron-LM's.
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import layers
    monkeypatch.setattr(harness, "on_cpu", lambda: False)
    cfg, extra = _config(["--bf16"])
    kw = harness.megatron_lm_kwargs(cfg, extra)
    gpu = harness._gpu_overrides(cfg)
    assert set(gpu) <= {"gradient_accumulation_fusion", "persist_layer_norm", "apply_rope_fusion",
                        "masked_softmax_fusion"}
    assert ("gradient_accumulation_fusion" in gpu) == (not layers._grad_accum_fusion_available)
    assert ("persist_layer_norm" in gpu) == (not gpt_layer_specs.HAVE_APEX)
    assert ("apply_rope_fusion" in gpu) == (rope_utils.fused_apply_rotary_pos_emb is None)
    tc = harness.transformer_config(cfg, extra)
    assert _mismatches(lambda k: getattr(tc, k), {**_expected("bf16"), **gpu, "num_query_groups": 4}) == {}
    assert kw["masked_softmax_fusion"] and kw["bias_activation_fusion"] and kw["bias_dropout_fusion"]
