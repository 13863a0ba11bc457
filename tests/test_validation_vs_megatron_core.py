"""Accept/reject decisions of the estimator against megatron-core 0.16.1's own checks, on a grid of edge configs.

For each command line the reference runs what Megatron-LM runs at start-up with the same values: megatron-core's
TransformerConfig (its __post_init__ validation), parallel_state.initialize_model_parallel on a fake world of the
job's size (torch's "fake" backend: real rank arithmetic and assertions, no communication) and the constant
microbatch calculator. Any exception there is a rejection. The estimator must decide the same, except on the cases
listed in STRICTER, each with the reason megatron-core's start-up checks miss it; for those the test checks that
megatron-core does accept them (so a change in megatron-core shows here) and that the estimator's message is the
stated one.
"""
import shlex
import warnings

import pytest

from estimator.args import ConfigError, _tokenize, parse_args

warnings.filterwarnings("ignore")
torch = pytest.importorskip("torch")
ps = pytest.importorskip("megatron.core.parallel_state")
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.megatron

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --vocab-size 1000 ")
MOE = "--num-experts 4 --disable-bias-linear "
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "

GRID = [
    "", "--tensor-model-parallel-size 0", "--tensor-model-parallel-size 3 --nproc_per_node 3",
    "--tensor-model-parallel-size 2 --nproc_per_node 3", "--pipeline-model-parallel-size 0",
    "--num-attention-heads 0", "--group-query-attention --num-query-groups 0",
    "--group-query-attention --num-query-groups 3",
    "--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4 --nproc_per_node 4",
    "--ffn-hidden-size -1", "--kv-channels -1", "--hidden-size 0", "--num-layers 0",
    "--num-experts 0", "--num-experts -4", "--num-experts 4", "--num-experts 4 --moe-router-topk 1",
    MOE + "--moe-router-topk 1 --moe-router-pre-softmax", MOE + "--moe-router-topk 5",
    MOE + "--expert-model-parallel-size 2 --nproc_per_node 2",
    MOE + "--expert-model-parallel-size 3 --nproc_per_node 2",
    "--num-experts 6 --disable-bias-linear --expert-model-parallel-size 4 --nproc_per_node 4",
    "--expert-model-parallel-size 2 --nproc_per_node 2",
    "--num-experts 4 --tensor-model-parallel-size 2 --nproc_per_node 2 --sequence-parallel",
    MOE + "--tensor-model-parallel-size 2 --nproc_per_node 2 --sequence-parallel",
    MOE + "--expert-tensor-parallel-size 0", MOE + "--expert-tensor-parallel-size 2 --nproc_per_node 2",
    MOE + "--moe-shared-expert-intermediate-size 0", MOE + "--moe-shared-expert-intermediate-size 64",
    "--recompute-granularity full", FULL,
    "--recompute-granularity full --recompute-method block --recompute-num-layers 0",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 0",
    "--recompute-granularity selective --recompute-num-layers 1",
    "--recompute-granularity selective --recompute-method uniform", "--recompute-activations",
    "--distribute-saved-activations --sequence-parallel --tensor-model-parallel-size 2 --nproc_per_node 2 " + FULL,
    "--distribute-saved-activations --tensor-model-parallel-size 2 --nproc_per_node 2 " + FULL,
    "--bf16 --fp16", "--bf16",
    "--pipeline-model-parallel-size 2 --nproc_per_node 2 --num-layers 3",
    "--pipeline-model-parallel-size 2 --nproc_per_node 2 --num-layers 3 --decoder-first-pipeline-num-layers 1",
    "--pipeline-model-parallel-size 2 --nproc_per_node 2 --decoder-first-pipeline-num-layers 0",
    "--pipeline-model-parallel-size 2 --nproc_per_node 2 --decoder-first-pipeline-num-layers 1 "
    "--account-for-embedding-in-pipeline-split",
    "--pipeline-model-parallel-size 4 --nproc_per_node 4 --num-layers 8 --num-virtual-stages-per-pipeline-rank 2",
    "--pipeline-model-parallel-size 4 --nproc_per_node 4 --num-layers 8 --num-virtual-stages-per-pipeline-rank 3",
    "--context-parallel-size 2 --nproc_per_node 2", "--context-parallel-size 0",
    "--micro-batch-size 2 --global-batch-size 3", "--micro-batch-size 2 --global-batch-size 4 --nproc_per_node 2",
    "--micro-batch-size 0", "--global-batch-size 0", "--hidden-dropout 1.5", "--hidden-dropout nan",
    "--nproc_per_node 2 --nnodes 2 --tensor-model-parallel-size 4",
    MOE + "--moe-router-load-balancing-type aux_loss seq_aux_loss",
    MOE + "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001",
    MOE + "--moe-expert-capacity-factor 1.5", MOE + "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity",
    MOE + "--moe-pad-expert-input-to-capacity", MOE + "--moe-expert-capacity-factor -1 --moe-pad-expert-input-to-capacity",
    MOE + "--moe-expert-capacity-factor 1 --moe-router-load-balancing-type sinkhorn",
    MOE + "--moe-expert-capacity-factor -1 --moe-router-load-balancing-type sinkhorn",
    MOE + "--moe-expert-capacity-factor 1 --moe-router-load-balancing-type aux_loss sinkhorn "
          "--moe-aux-loss-coeff 0.01 0.001",
]

# Refused by the estimator although megatron-core's start-up checks pass: the run would fail later, or Megatron-LM's
# own argument checks refuse it. command line -> (reason, words of the estimator's message)
STRICTER = {
    "--ffn-hidden-size -1": ("the model build fails (a tensor of negative size)", "must be positive"),
    "--kv-channels -1": ("the model build fails (a tensor of negative size)", "must be positive"),
    "--hidden-size 0": ("zero-size weights everywhere: no model to train, none for the estimator to model",
                        "must be positive"),
    MOE + "--moe-router-topk 5": ("the router's top-k over 4 experts fails at the first forward",
                                  "must not exceed num_experts"),
    "--num-experts 6 --disable-bias-linear --expert-model-parallel-size 4 --nproc_per_node 4":
        ("megatron-core's MoELayer asserts it when built; Megatron-LM's arguments refuse it",
         "Number of experts should be a multiple of expert model parallel_size"),
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 0":
        ("megatron-core's uniform recompute loop never advances (a hung run)", "never advances"),
    "--pipeline-model-parallel-size 2 --nproc_per_node 2 --num-layers 3":
        ("Megatron-LM's arguments refuse it", "Number of layers should be divisible"),
    "--group-query-attention --num-query-groups 0": ("megatron-core's attention divides heads by query groups "
                                                    "when built", "must be positive"),
    "--group-query-attention --num-query-groups 3": ("megatron-core's attention divides heads by query groups "
                                                    "when built", "must be a multiple of num_query_groups"),
    "--pipeline-model-parallel-size 4 --nproc_per_node 4 --num-layers 8 --num-virtual-stages-per-pipeline-rank 3":
        ("megatron-core's TransformerBlock asserts it when built", "should be divisible by vp_size"),
    "--hidden-dropout 1.5": ("torch.nn.Dropout refuses it when the model is built", "dropout probability"),
    "--hidden-dropout nan": ("torch.nn.Dropout refuses it when the model is built", "dropout probability"),
}


def _core_kwargs(given: dict) -> dict:
    """TransformerConfig arguments for the given flag values, as Megatron-LM's core_transformer_config_from_args
    fills them (its derived defaults included)."""
    g = given.get
    tp = g("tensor_model_parallel_size", 1)
    granularity = "selective" if g("recompute_activations") else g("recompute_granularity")
    return dict(
        num_layers=g("num_layers"), hidden_size=g("hidden_size"), num_attention_heads=g("num_attention_heads"),
        ffn_hidden_size=g("ffn_hidden_size"), kv_channels=g("kv_channels"),
        num_query_groups=g("num_query_groups") if g("group_query_attention") else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=g("pipeline_model_parallel_size", 1),
        context_parallel_size=g("context_parallel_size", 1),
        sequence_parallel=bool(g("sequence_parallel")) and tp > 1,   # Megatron-LM turns it off at TP 1
        expert_model_parallel_size=g("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=g("expert_tensor_parallel_size", tp),
        virtual_pipeline_model_parallel_size=g("num_virtual_stages_per_pipeline_rank"),
        num_layers_in_first_pipeline_stage=g("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=g("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=bool(g("account_for_embedding_in_pipeline_split")),
        num_moe_experts=g("num_experts"), moe_router_topk=g("moe_router_topk", 2),
        moe_router_pre_softmax=bool(g("moe_router_pre_softmax")),
        # nargs='+' lists; Megatron-LM unpacks a single value
        moe_router_load_balancing_type=_unpack(g("moe_router_load_balancing_type", "aux_loss")),
        moe_aux_loss_coeff=_unpack([float(c) for c in g("moe_aux_loss_coeff", [0.0])]),
        moe_ffn_hidden_size=g("moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=g("moe_shared_expert_intermediate_size"),
        moe_expert_capacity_factor=g("moe_expert_capacity_factor"),
        moe_pad_expert_input_to_capacity=bool(g("moe_pad_expert_input_to_capacity")),
        add_bias_linear=g("add_bias_linear", True),
        recompute_granularity=granularity, recompute_method=g("recompute_method"),
        recompute_num_layers=g("recompute_num_layers"),
        distribute_saved_activations=bool(g("distribute_saved_activations")),
        bf16=bool(g("bf16")), fp16=bool(g("fp16")),
        hidden_dropout=g("hidden_dropout", 0.1), attention_dropout=g("attention_dropout", 0.1),
        pipeline_dtype=torch.float32,
    )


def _unpack(values):
    return values[0] if isinstance(values, list) and len(values) == 1 else values


def megatron_core_accepts(argv: list) -> tuple:
    """(accepted, what refused it) from megatron-core's own start-up checks."""
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    given = _tokenize(argv)[0]
    nproc = given.get("nproc_per_node", 1)
    world = nproc * given.get("nnodes", 1)
    try:
        TransformerConfig(**_core_kwargs(given))
    except Exception as exc:   # ValueError, AssertionError, ZeroDivisionError, TypeError: megatron-core refused
        return False, f"TransformerConfig: {exc}"
    g = given.get
    tp, pp, cp = g("tensor_model_parallel_size", 1), g("pipeline_model_parallel_size", 1), g("context_parallel_size", 1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=g("expert_model_parallel_size", 1),
                                     expert_tensor_parallel_size=g("expert_tensor_parallel_size", tp),
                                     create_gloo_process_groups=False)
    except Exception as exc:
        return False, f"initialize_model_parallel: {exc}"
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    dp = world // (tp * pp * cp)
    mbs = g("micro_batch_size")
    try:
        ConstantNumMicroBatchesCalculator(g("global_batch_size", mbs * dp), mbs, dp, False, 0)
    except Exception as exc:
        return False, f"microbatch calculator: {exc}"
    return True, ""


@pytest.mark.parametrize("extra", GRID)
def test_same_decision_as_megatron_core(extra):
    argv = shlex.split(BASE + extra)
    theirs, why = megatron_core_accepts(argv)
    try:
        parse_args(argv)
        ours, message = True, ""
    except ConfigError as exc:
        ours, message = False, str(exc)
    if extra in STRICTER:
        reason, words = STRICTER[extra]
        assert theirs, f"megatron-core now refuses it too ({why}): move it out of STRICTER"
        assert not ours and words in message, message
        return
    assert ours == theirs, f"estimator {'accepts' if ours else 'refuses: ' + message}; megatron-core " \
                           f"{'accepts' if theirs else 'refuses: ' + why}"


def test_grid_covers_both_decisions():
    """The grid is a comparison, not a list of valid configs: both sides refuse a good share of it."""
    refused = sum(not megatron_core_accepts(shlex.split(BASE + extra))[0] for extra in GRID)
    assert 15 <= refused <= len(GRID) - 15, refused
