"""What the estimator does with each Megatron-LM flag it does not parse into TrainingConfig.

estimator.megatron_flags lists every flag Megatron-LM's parser has (generated) at the release the estimator models;
estimator.megatron_flags_newer those newer releases added (generated, each with its release). A flag estimator.args
parses is modelled. Of the others, a flag that changes memory or communication is refused here with a one-line reason
(REFUSED, or REFUSED_UNLESS for flags whose default or a few values change nothing); every other Megatron-LM flag
does not change memory or communication and is listed as ignored. A flag Megatron-LM does not have is an error
(did you mean ...), as Megatron's own parser fails on it.
"""
from __future__ import annotations

from estimator.megatron_flags import MEGATRON_LM, SOURCE, TORCHRUN
from estimator.megatron_flags_newer import NEWER

# The release the estimator models (its parser's flags: estimator.megatron_flags).
BASE_RELEASE = SOURCE.split(" (")[0].replace("Megatron-LM ", "")

# Flags of newer Megatron-LM releases (estimator.megatron_flags_newer, each with the first release that has it) that
# cannot change a training step's memory or communication: checkpointing, logging and profiling, inference and RL
# generation, tokenizers, fault injection, evaluation scheduling, muP's scalings, RoPE-scaling constants and the
# hyper-parameters of optimizers the estimator refuses anyway. They are listed as ignored; every other newer flag
# is refused, naming its release.
NEWER_IGNORED_PREFIXES = (
    "--async-ckpt-", "--ckpt-", "--disable-ckpt-", "--no-ckpt-", "--flight-recorder-", "--disable-flight-recorder-",
    "--no-flight-recorder-", "--pytorch-profiler-", "--otel-", "--inference-", "--no-inference-", "--mamba-inference-",
    "--rl-", "--no-rl-", "--tokenizer-", "--disable-tokenizer-", "--no-tokenizer-", "--null-tokenizer-",
    "--fault-injector-", "--mup-", "--lion-", "--muon-", "--yarn-", "--no-yarn-")
NEWER_IGNORED = {
    "--async-strategy", "--dist-ckpt-workers", "--override-ckpt-iteration", "--verify-integrity", "--enable-msc",
    "--disable-stream-ckpt-dequant", "--no-stream-ckpt-dequant", "--nvtx-ranges", "--record-shapes",
    "--gpu-sniff-test-interval", "--save-params-interval", "--save-tokens-per-expert-interval",
    "--num-speculative-tokens", "--chat-template", "--disable-save-tokenizer-assets", "--no-save-tokenizer-assets",
    "--start-eval-at-iter", "--validation-set-names", "--exit-signal-handler-for-training", "--use-mup",
    "--use-same-sampling-seed-across-dp-ranks",
    # a global-batch schedule, as --rampup-batch-size (ignored too): the estimate takes --global-batch-size
    "--step-batch-size-schedule",
}

_NO_FORMULAS = "no formula set measures it"

# flag -> why its effect on memory or communication is not modelled.
REFUSED = {
    "--hierarchical-context-parallel-sizes": "hierarchical context parallelism (a2a+p2p) is not modelled",
    "--max-seqlen-per-dp-cp-rank": "dynamic context parallelism is not modelled",
    "--hybrid-context-parallel": "hybrid context parallelism is not modelled",
    "--moe-extended-tp": "extended tensor parallelism of the experts is not modelled",
    "--overlap-moe-expert-parallel-comm": "overlapping EP communication keeps two microbatches' activations; "
                                          "not modelled",
    "--delay-wgrad-compute": "delayed weight-gradient compute keeps its inputs longer; not modelled",
    "--ep-overlap-early-attn-memory-release": "an EP-overlap memory release that is not modelled",
    "--defer-embedding-wgrad-compute": "deferred embedding weight gradients keep their inputs; not modelled",
    "--overlap-p2p-communication-warmup-flush": "changes the interleaved schedule's warm-up, which is simulated "
                                                "without it",
    "--mtp-standalone": "multi-token prediction on a pipeline stage of its own is not modelled (on the loss's stage it is)",
    "--experimental-attention-variant": "experimental attention variants are not modelled",
    "--linear-attention-freq": "linear attention layers are not modelled",
    "--use-fused-weighted-squared-relu": f"squared-ReLU MLP activations: {_NO_FORMULAS}",
    "--openai-gelu": f"the tanh-GELU's saved intermediates: {_NO_FORMULAS}",
    "--fp8-quantizer-factory": "custom fp8 quantizers are not modelled",
    "--use-kitchen-attention": "kitchen attention is not modelled",
    "--fp4-format": "fp4 training is not modelled",
    "--fp4-param-gather": "fp4 training is not modelled",
    "--fp4-quantizer-factory": "fp4 training is not modelled",
    "--te-precision-config-file": "per-module precision from a file is not modelled",
    "--reuse-grad-buf-for-mxfp8-param-ag": "reusing the grad buffer for the mxfp8 param all-gather is not modelled",
    "--moe-enable-deepep": "DeepEP dispatch buffers are not modelled",
    "--moe-layer-recompute": "MoE layer recompute is not modelled",
    "--moe-latent-size": "MoE latent projections are not modelled",
    "--enable-cuda-graph": "CUDA graphs keep static input/output buffers; not modelled",
    "--external-cuda-graph": "CUDA graphs keep static input/output buffers; not modelled",
    "--is-hybrid-model": "hybrid (Mamba) models are not modelled",
    "--hybrid-override-pattern": "hybrid (Mamba) models are not modelled",
    "--fine-grained-activation-offloading": "fine-grained activation offloading is not modelled "
                                            "(--cpu-offloading-num-layers is)",
    "--encoder-num-layers": "encoder-decoder models are not modelled (GPT: --num-layers)",
    "--decoder-num-layers": "encoder-decoder models are not modelled (GPT: --num-layers)",
    "--use-legacy-models": "legacy (non-megatron-core) models are not modelled",
    "--perform-rl-step": "RL steps (inference engine, KV cache) are not modelled",
    "--ddp-pad-buckets-for-high-nccl-busbw": "extra DDP bucket padding is not modelled",
    "--ddp-reduce-scatter-with-fp32-accumulation": "the fp32-accumulating reduce-scatter's buffers are not modelled",
    "--use-nccl-ub": "NCCL user-buffer registration memory is not modelled",
    "--fsdp-double-buffer": "Megatron FSDP's double buffers are not modelled",
    "--suggested-communication-unit-size": "Megatron FSDP's communication unit size is not modelled",
    "--enable-full-sharding-in-hsdp": "hybrid sharded data parallelism is not modelled",
    "--heterogeneous-layers-config-path": "heterogeneous layers are not modelled",
    "--heterogeneous-layers-config-encoded-json": "heterogeneous layers are not modelled",
    "--yaml-cfg": "a YAML config cannot be read: pass its settings as flags",
}

# Flags that only lower memory (fused kernels that skip a copy, smaller TP-overlap buffer sets): the estimate is
# made as if they were absent and says so; it errs high by what they save.
CONSERVATIVE = {
    "--moe-permute-fusion": "the fused permute keeps fewer temporaries",
    "--moe-router-fusion": "the fused router keeps fewer temporaries",
    "--no-clone-scatter-output-in-embedding": "the embedding output is not cloned",
    "--disable-clone-scatter-output-in-embedding": "the embedding output is not cloned",
    "--fp16-lm-cross-entropy": "the loss is computed on 16-bit logits",
    "--moe-router-padding-for-quantization": "routing maps padded for quantized GEMMs (a few tokens per expert)",
    "--moe-router-padding-for-fp8": "routing maps padded for fp8 GEMMs (a few tokens per expert)",
    "--no-tp-comm-bulk-wgrad": "one TP-overlap userbuffer fewer",
    "--disable-tp-comm-bulk-wgrad": "one TP-overlap userbuffer fewer",
    "--no-tp-comm-bulk-dgrad": "one TP-overlap userbuffer fewer",
    "--disable-tp-comm-bulk-dgrad": "one TP-overlap userbuffer fewer",
    "--no-tp-comm-overlap-ag": "TP-overlap all-gather userbuffers not used",
    "--disable-tp-comm-overlap-ag": "TP-overlap all-gather userbuffers not used",
    "--no-tp-comm-overlap-rs": "TP-overlap reduce-scatter userbuffers not used",
    "--disable-tp-comm-overlap-rs": "TP-overlap reduce-scatter userbuffers not used",
    "--tp-comm-overlap-rs-dgrad": "dgrad reduce-scatter overlap reuses the userbuffers",
    "--no-tp-comm-split-ag": "split all-gather overlap off",
    "--disable-tp-comm-split-ag": "split all-gather overlap off",
    "--no-tp-comm-split-rs": "split reduce-scatter overlap off",
    "--disable-tp-comm-split-rs": "split reduce-scatter overlap off",
    "--tp-comm-overlap-cfg": "a userbuffer configuration file (the estimate keeps the default set)",
}

# flag -> (values that change nothing, reason for any other value). Values as written on the command line.
REFUSED_UNLESS = {
    "--cuda-graph-impl": (("none",), "CUDA graphs keep static input/output buffers; not modelled"),
    "--cp-comm-type": (("p2p",), "context-parallel communication other than p2p is not modelled"),
    "--outer-dp-sharding-strategy": (("no_shard",), "hybrid sharded data parallelism is not modelled"),
    "--decoder-seq-length": ((), "encoder-decoder models are not modelled"),
    "--encoder-seq-length": ((), "pass --seq-length (the same value for a GPT model)"),
    "--main-grads-dtype": (("fp32",), "main gradients in a dtype other than fp32 are not modelled"),
}


# Spellings older Megatron-LM releases had, with the flag that replaced them (a closer hint than difflib's).
RENAMED = {
    "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank",
    "--cpu-offloading": "--cpu-offloading-num-layers",
    "--use-custom-fsdp": "--use-megatron-fsdp",
}


# get-training-info's own options (estimator.cli.OWN_OPTIONS; a test keeps the two equal): near misses of these
# are suggested too.
TOOL_OPTIONS = ("--json", "--exit-code", "--search", "--top", "--formulas", "--preset", "--png", "--gpu-memory",
                "--detail", "--cuda-context-gib", "--nccl-gib-per-communicator", "--fragmentation-percent",
                "--cuda-alloc-conf", "--torch-adam", "--memory-snapshot")


def known(flag: str) -> bool:
    return flag in MEGATRON_LM or flag in TORCHRUN or flag in NEWER


def values_taken(flag: str) -> object:
    """0, 1, '?', '*' or '+': how many tokens follow the flag in Megatron-LM's (or torchrun's) parser."""
    row = MEGATRON_LM.get(flag) or TORCHRUN.get(flag) or NEWER.get(flag)
    return row[1]


def newer_release(flag: str) -> str | None:
    """The first newer Megatron-LM release that has a flag the modelled release lacks; None for the others."""
    row = NEWER.get(flag)
    return row[2] if row is not None and flag not in MEGATRON_LM else None


def newer_ignored(flag: str) -> bool:
    return flag in NEWER_IGNORED or flag.startswith(NEWER_IGNORED_PREFIXES)


def refusal(flag: str, values: list) -> str | None:
    """The reason a given Megatron-LM flag cannot be estimated, or None when it changes nothing."""
    release = newer_release(flag)
    if release is not None:
        return None if newer_ignored(flag) else \
            f"it is a flag of Megatron-LM {release}, newer than {BASE_RELEASE} (the release this estimator models)"
    if flag in REFUSED:
        return REFUSED[flag]
    rule = REFUSED_UNLESS.get(flag)
    if rule is not None and any(v not in rule[0] for v in values):
        return rule[1]
    return None


def unknown_message(flag: str, extra: tuple = ()) -> str:
    """Megatron-LM's parser's complaint, with the nearest real flags."""
    import difflib  # on the error path only: its import costs the CLI's start-up
    candidates = [c for c in dict.fromkeys([*MEGATRON_LM, *NEWER, *TORCHRUN, *TOOL_OPTIONS, *extra])   # each once,
                  if c != flag]                                                                # never itself
    close = [RENAMED[flag]] if flag in RENAMED else difflib.get_close_matches(flag, candidates, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unrecognized argument {flag}: Megatron-LM has no such flag{hint}"
