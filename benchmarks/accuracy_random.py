"""Accuracy on random realistic held-out configs, with an independent cross-check of every measured peak.

    python benchmarks/accuracy_random.py [--seed S] [--count N] [--quick] [--check] [--list] [--out DIR]
                                         [--fitted SET] [--modelled SET] [--reprofile] [--json FILE]

benchmarks/accuracy.py's held-out configs are tiny (h 64-128, s 32-64, vocab 128-200): weights and optimizer
states dominate their peaks and hide activation errors. This benchmark draws configs with realistic proportions
from a seeded generator instead: 2-4 layers, h 64-192, s 128-384, vocab 1000-3000, microbatch 1-4;
gelu/swiglu/squared-ReLU, LayerNorm/RMSNorm, learned/rope positions, MHA/GQA, biases on/off, tied/untied
embeddings, dropout on/off, fp32
(bf16 in at most about 1 in 7 draws, small ones: it is ~14x slower on CPU; with DP, gradients reduced in bf16 in
half of them), TP 2 with and without sequence
parallelism, PP 2 (1F1B and interleaved), DP 2 with and without the distributed optimizer, selective and full
(uniform / block) recompute, MoE (EP 1/2, alltoall and allgather dispatchers, balanced routing), at most 2
processes each; with --gpu-kernels, the draws on Transformer Engine's flash attention also get the query's and
key's norms (RMSNorm / LayerNorm or L2) and the attention output gate from their own stream. Candidate i takes its
process layout from a fixed cycle (`LAYOUTS`, so every layout is drawn) and
everything else from its own random stream (seed, i): the list is deterministic and a rejected draw is replaced by
the next one. A draw is rejected when
- Megatron-LM's argument validation (as the estimator reproduces it) or megatron-core's TransformerConfig refuses it;
- it is not held out: it equals a config of the fitted set's provenance, or differs from some config of
  fit/grids/*.json (or of that provenance) in fewer than 2 switches or shapes (`FEATURES`);
- its estimated run time is over the budget, or the estimator (fitted set) puts activations under 45% of a rank's
  peak (a cheap pre-filter, no profiling);
- once profiled: activations (categories `saved` + `temporary` at the measured peak, tracer.parse) are under 40%
  of some rank's peak. Such a run is kept in the cache and listed as rejected.

Each accepted config is profiled on CPU (`python -m tracer.profile --cpu --crosscheck`, 2 iterations; MoE with
`--balanced-routing`), cached under DIR/seed<S>/<config>/ (resumable, as accuracy.py). Per rank it prints the
measured peak (the tracing allocator's exact peak), the cross-check peak (torch.profiler memory events with c10's
process-wide CPU accounting, tracer/profile.py `Crosscheck`) and its difference, the peaks predicted with the
fitted and the modelled set and their errors, and the share of activation bytes that came from measured formulas
(`formula_set.coverage.measured_share` of the estimator's JSON; `n/a` where the estimator does not report it).
`--check` exits 1 when a rank is not within 1% with the fitted set, is under-predicted by more than 0.5%, or its
cross-check differs from the tracer by more than 0.1%. `--quick` runs 2 of the drawn configs (the cheapest with one
and with two processes). `--list` prints the draw and the rejected candidates without profiling.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import random
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import accuracy as A  # noqa: E402  (benchmarks/accuracy.py: profiling, caching, held-out keys, predictions)

ROOT = A.ROOT
DEFAULT_SEED = 20261124
DEFAULT_COUNT = 30
DEFAULT_OUT = os.path.join(ROOT, "runs", "accuracy_random")
ITERATIONS = 2
MIN_ACT_SHARE = 0.40        # measured: saved + temporary at the peak, every rank
MIN_EST_ACT_SHARE = 0.45    # pre-filter on the estimate (fitted set), every rank
MAX_COST_S = 16.0           # pre-filter: estimated profiling seconds of one config
XCHECK_TOL = 0.1            # % |cross-check - tracer| / tracer
QUICK = 2
MAX_DRAWS = 2000

# What "differs" means for the held-out rule: the switches and shapes of a config, as Megatron derives them.
FEATURES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "seq_length", "micro_batch_size", "num_microbatches", "padded_vocab_size", "position_embedding_type",
            "swiglu", "squared_relu", "normalization", "add_bias_linear", "untie_embeddings_and_output_weights", "hidden_dropout",
            "attention_dropout", "params_dtype", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "data_parallel_size", "sequence_parallel",
            "use_distributed_optimizer", "recompute_granularity", "recompute_method", "recompute_num_layers",
            "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "moe_token_dispatcher_type", "qk_layernorm", "qk_l2_norm",
            "attention_output_gate", "kernels")
MIN_DIFFERENCES = 2


# Candidate i's process layout is LAYOUTS[i % len]: a stratified draw, every layout in every run of the list.
# 1p: one process; tp2(sp): TP 2 (sequence parallel); pp2(v): PP 2, 1F1B (interleaved, 2 chunks of 1 layer);
# dp2(do): DP 2 (distributed optimizer); ep2: MoE with EP 2 over the DP 2 ranks; moe-: a MoE model.
LAYOUTS = ("1p", "tp2", "tp2sp", "pp2", "pp2v", "dp2", "dp2do", "moe-ep2", "tp2sp", "pp2", "moe-1p", "dp2do",
           "moe-tp2sp", "moe-ep2do", "tp2", "pp2v", "moe-pp2")


class Rejected(Exception):
    pass


# ------------------------------------------------------------------------------------------------ drawing
def _pick(rng: random.Random, weighted: dict):
    keys = list(weighted)
    return rng.choices(keys, weights=[weighted[k] for k in keys])[0]


def draw(seed: int, index: int, gpu_kernels: bool = False) -> dict:
    """Candidate `index` of `seed`: {name, argv, nproc, launcher, tags}. Pure function of (seed, index,
    gpu_kernels). With gpu_kernels the same draw runs Megatron-LM's GPU kernels on the CPU stand-ins
    (tracer/standins.py), each family drawn from its own stream: the Transformer Engine spec (flash or unfused
    attention) or the local one, each fusion on (Megatron-LM's default) or off."""
    rng = random.Random(f"{seed}:{index}")
    layout = LAYOUTS[index % len(LAYOUTS)]
    moe = layout.startswith("moe-")
    layout = layout.removeprefix("moe-")
    bf16 = rng.random() < 1 / 7
    if bf16:
        layout = "1p" if layout.startswith("pp2") else layout
    tp = 2 if layout.startswith("tp2") else 1
    pp = 2 if layout.startswith("pp2") else 1
    nproc = 1 if layout == "1p" else 2
    dp = nproc // (tp * pp)

    layers = 4 if layout == "pp2v" else (rng.choice([2, 4]) if pp > 1 else rng.choice([2, 3, 4]))
    head_dim = rng.choice([16, 32])
    hidden = rng.choice([64, 96, 128, 160, 192])
    seq = rng.randrange(128, 385, 32)
    mb = rng.randint(1, 4)
    if bf16:   # small: bf16 matmuls are ~14x slower than fp32 on CPU
        layers, hidden, seq, mb = 2, rng.choice([64, 96]), rng.randrange(160, 225, 32), rng.randint(1, 2)
    heads = hidden // head_dim
    if heads % tp:
        head_dim, heads = 16, hidden // 16
    nmb = rng.choice([2, 4]) if layout == "pp2v" else (rng.randint(2, 3) if pp > 1 else rng.randint(1, 2))
    if bf16:
        nmb = 1
    vocab = rng.randint(1000, 3000)

    tags, argv = [layout], ["--num-layers", str(layers), "--hidden-size", str(hidden),
                            "--num-attention-heads", str(heads), "--seq-length", str(seq),
                            "--max-position-embeddings", str(seq), "--micro-batch-size", str(mb),
                            "--global-batch-size", str(mb * nmb * dp), "--vocab-size", str(vocab),
                            "--transformer-impl", "local", "--seed", "1234"]
    if tp > 1:
        argv += ["--tensor-model-parallel-size", str(tp)]
        if layout == "tp2sp" or moe:
            argv.append("--sequence-parallel")
    if pp > 1:
        argv += ["--pipeline-model-parallel-size", str(pp)]
        if layout == "pp2v":
            argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if layout.endswith("do"):
        argv.append("--use-distributed-optimizer")
    if bf16:
        argv.append("--bf16")
        tags.append("bf16")
        # gradients reduced in bf16 or fp32 (the default): drawn from its own stream, so no other draw moves
        if dp > 1 and random.Random(f"{seed}:{index}:grad-reduce").random() < 0.5:
            argv.append("--grad-reduce-in-bf16")
            tags.append("gr16")
    if rng.random() < 0.5:
        argv.append("--swiglu")
        tags.append("sw")
    ffn_mult = _pick(rng, {None: 2, 2: 1, 3: 1})
    if ffn_mult:
        argv += ["--ffn-hidden-size", str(ffn_mult * hidden)]
        tags.append(f"f{ffn_mult}")
    if rng.random() < 0.5:
        argv += ["--normalization", "RMSNorm"]
        tags.append("rms")
    if rng.random() < 0.5:
        argv += ["--position-embedding-type", "rope"]
        tags.append("rope")
    if heads > 1 and rng.random() < 0.4:
        groups = [g for g in range(1, heads) if heads % g == 0 and g % tp == 0]
        if groups:
            g = rng.choice(groups)
            argv += ["--group-query-attention", "--num-query-groups", str(g)]
            tags.append(f"gqa{g}")
    if moe or rng.random() < 0.3:
        # megatron-core 0.16.1's SequentialMLP adds the expert bias in place on a TP reduce output: MoE runs unbiased
        argv.append("--disable-bias-linear")
        tags.append("nb")
    if rng.random() < 0.5:
        argv.append("--untie-embeddings-and-output-weights")
        tags.append("ut")
    drop = rng.random() < 0.4
    argv += ["--hidden-dropout", "0.1" if drop else "0", "--attention-dropout", "0.1" if drop else "0"]
    if drop:
        tags.append("dr")
    recompute = _pick(rng, {None: 5, "selective": 3, "uniform": 2, "block": 2})
    per_stage = layers // pp
    if recompute == "selective":
        argv.append("--recompute-activations")
        tags.append("sel")
    elif recompute:
        chunk = 1 if layout == "pp2v" else per_stage
        n = rng.choice([d for d in range(1, chunk + 1) if recompute == "block" or chunk % d == 0])
        argv += ["--recompute-granularity", "full", "--recompute-method", recompute, "--recompute-num-layers", str(n)]
        tags.append(f"f{recompute[0]}{n}")
    if moe:
        ep = 2 if layout.startswith("ep2") else 1
        experts = rng.choice([4, 8])
        topk = rng.choice([1, 2, 2, 3])
        dispatcher = rng.choice(["alltoall", "allgather"])
        argv += ["--num-experts", str(experts), "--moe-router-topk", str(topk),
                 "--moe-token-dispatcher-type", dispatcher]
        if topk == 1:
            argv.append("--moe-router-pre-softmax")   # megatron-core refuses top-1 softmax routing without it
        if ep > 1:
            argv += ["--expert-model-parallel-size", str(ep)]
        if rng.random() < 0.3:
            argv += ["--moe-ffn-hidden-size", str(rng.choice([1, 2]) * hidden)]
        tags.append(f"e{experts}k{topk}" + ("a2a" if dispatcher == "alltoall" else "ag"))
    # squared-ReLU MLPs (Nemotron-style) in a fifth of the non-gated draws, from their own stream (no other draw
    # moves); megatron-core refuses them with the bias-GeLU fusion, which linear biases turn on
    if "--swiglu" not in argv and random.Random(f"{seed}:{index}:activation").random() < 0.2:
        argv.append("--squared-relu")
        if "--disable-bias-linear" not in argv:
            argv.append("--no-bias-gelu-fusion")
        tags.append("sqr")
    launcher = ["--crosscheck"]
    if gpu_kernels:
        launcher.append("--gpu-kernels")
        argv, ktags = _kernel_flags(random.Random(f"{seed}:{index}:kernels"), argv)
        tags += ktags
        if "te" in ktags:   # the attention variants, traced with TE's flash attention: from their own stream
            argv, vtags = _attention_variant(random.Random(f"{seed}:{index}:attention-variant"), argv)
            tags += vtags
    name = f"{index:03d}_" + "_".join(tags) + f"_h{hidden}s{seq}b{mb}x{nmb}l{layers}v{vocab}"
    from fit.campaign import launcher_flags
    return {"name": name, "argv": argv, "nproc": nproc, "launcher": launcher_flags(argv) + launcher,
            "index": index, "tags": tags}


FUSION_OFF = ("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion")


def _attention_variant(rng: random.Random, argv: list) -> tuple[list, list]:
    """The query's and key's norms (none in half the draws, RMSNorm / LayerNorm or the L2 norm in a quarter each)
    and the attention output gate (in a third), as Qwen3, Llama-4 and Qwen3-Next have them."""
    argv, tags = list(argv), []
    norm = _pick(rng, {None: 2, "--qk-layernorm": 1, "--qk-l2-norm": 1})
    if norm:
        argv.append(norm)
        tags.append("qkln" if norm == "--qk-layernorm" else "qkl2")
    if rng.random() < 1 / 3:
        argv.append("--attention-output-gate")
        tags.append("gate")
    return argv, tags


def _kernel_flags(rng: random.Random, argv: list) -> tuple[list, list]:
    """GPU kernel flags for a draw: TE spec (60%; a third of those with the unfused attention backend) or the local
    spec, each fusion off with probability 1/4."""
    argv, tags = list(argv), []
    if rng.random() < 0.6:
        argv[argv.index("--transformer-impl") + 1] = "transformer_engine"
        unfused = rng.random() < 1 / 3
        if unfused:
            argv += ["--attention-backend", "unfused"]
        tags.append("teu" if unfused else "te")
    off = [f for f in FUSION_OFF if rng.random() < 0.25]
    argv += [f for f in off if f not in argv]
    if off:
        tags.append("nf" + "".join(f[5] for f in off))
    return argv, tags


def features(cfg_dict: dict, launcher: list | None = None) -> dict:
    """The held-out features of a parsed config; its kernel families as recorded (a trace's config) or as the
    profiler options give them (`launcher`)."""
    d = dict(cfg_dict)
    if not d.get("group_query_attention"):
        d["num_query_groups"] = d.get("num_attention_heads")
    kern = d.get("kernels") if isinstance(d.get("kernels"), dict) else A.kernels_of(d, launcher or [])
    d["kernels"] = tuple(sorted(kern.items()))
    return {k: d.get(k) for k in FEATURES}


def differences(a: dict, b: dict) -> list[str]:
    return [k for k in FEATURES if a.get(k) != b.get(k)]


def fit_configs(fitted_path: str | None) -> list[tuple[str, dict]]:
    """(label, features) of every config of fit/grids/*.json and of the fitted set's provenance."""
    from estimator.args import parse_args
    out = []
    if os.path.isdir(A.FIT_GRIDS):
        for f in sorted(os.listdir(A.FIT_GRIDS)):
            if not f.endswith(".json"):
                continue
            try:
                with open(os.path.join(A.FIT_GRIDS, f), encoding="utf-8") as fh:
                    grid = json.load(fh)
                for c in A.expand(grid):
                    d = parse_args(["--nproc_per_node", str(c["nproc"])] + c["argv"]).to_dict()
                    out.append((f"{f}:{c['name']}", features(d, c["launcher"])))
            except Exception:  # a grid being edited by its owner: accuracy.training_configs skips it too
                continue
    if fitted_path and os.path.isfile(fitted_path):
        with open(fitted_path, encoding="utf-8") as fh:
            doc = json.load(fh)
        for t in (doc.get("provenance") or {}).get("traces") or []:
            if isinstance(t.get("config"), dict):
                out.append((f"provenance:{t.get('dir', '?')}", features(t["config"])))
    return out


class Generator:
    """Validated, held-out, pre-filtered candidates of one seed, in order (no profiling)."""

    def __init__(self, seed: int, fitted_path: str | None, megatron_check: bool = True, gpu_kernels: bool = False):
        self.seed, self.fitted_path, self.gpu_kernels = seed, fitted_path, gpu_kernels
        self.prov, self.grids = A.training_configs(fitted_path)
        self.fit = fit_configs(fitted_path)
        self.megatron_check = megatron_check
        self.rejected: list[dict] = []

    def check(self, cand: dict) -> dict:
        """The candidate with its estimate attached, or Rejected(reason)."""
        from estimator.args import ConfigError, parse_args
        try:
            cfg = parse_args(["--nproc_per_node", str(cand["nproc"])] + cand["argv"])
        except (ConfigError, ValueError) as exc:
            raise Rejected(f"arguments: {exc}") from None
        if self.megatron_check:
            try:
                from tracer.harness import extra_flags, transformer_config
                with warnings.catch_warnings():   # megatron-core's import and fallback warnings
                    warnings.simplefilter("ignore")
                    transformer_config(cfg, extra_flags(cfg.ignored_args))
            except ImportError as exc:
                print(f"warning: megatron-core's TransformerConfig checks skipped ({exc})", file=sys.stderr)
                self.megatron_check = False
            except Exception as exc:  # megatron-core's own validation (TransformerConfig.__post_init__)
                raise Rejected(f"megatron-core: {str(exc).splitlines()[0][:160]}") from None
        key = A._config_key(cand["argv"], cand["nproc"])
        if key in self.prov or key in self.grids:
            raise Rejected("not held out: a fit used this config")
        mine = features(cfg.to_dict(), cand["launcher"])
        for label, other in self.fit:
            diff = differences(mine, other)
            if len(diff) < MIN_DIFFERENCES:
                raise Rejected(f"not held out: differs from {label} only in {diff or 'nothing'}")
        cost = estimated_seconds(cfg, cand["nproc"])
        if cost > MAX_COST_S:
            raise Rejected(f"estimated run time {cost:.0f} s over the {MAX_COST_S:g} s budget")
        try:
            doc = A.predict_json(cand, self.fitted_path or "modelled")
        except Exception as exc:
            raise Rejected(f"estimator: {exc}") from None
        for r in doc["ranks"]:
            static = sum(r["bytes"].get(k, 0) for k in ("parameters", "gradients", "optimizer_states"))
            share = 1.0 - static / r["peak_bytes"]
            if share < MIN_EST_ACT_SHARE:
                raise Rejected(f"estimated activations {100 * share:.0f}% of rank {r['rank']}'s peak "
                               f"(under {100 * MIN_EST_ACT_SHARE:.0f}%)")
        return dict(cand, cost_s=cost, config=cfg.to_dict())

    def __iter__(self):
        for i in range(MAX_DRAWS):
            cand = draw(self.seed, i, self.gpu_kernels)
            try:
                yield self.check(cand)
            except Rejected as why:
                self.rejected.append({"name": cand["name"], "stage": "draw", "reason": str(why)})

    def take(self, n: int, it=None) -> list[dict]:
        """The next n candidates of `it` (a running iter(self)), else the first n."""
        return list(itertools.islice(it if it is not None else iter(self), n))


def estimated_seconds(cfg, nproc: int) -> float:
    """Rough profiling time of a config on 2 cores: process start (about 5 s for one process, 9 s for two, with
    the cross-check) plus one rank's share of the training flops (fwd + bwd + recompute, unfused attention) at
    2.5 GFLOP/s (fp32; bf16 ~14x slower), calibrated on this benchmark's runs (2026-11-24; within about 2x of them
    on a machine shared with other work)."""
    tokens = cfg.seq_length * cfg.micro_batch_size * cfg.num_microbatches
    h, s = cfg.hidden_size, cfg.seq_length
    layer = 2 * (4 * h * h + 2 * 2 * h * cfg.ffn_hidden_size * (1.5 if cfg.swiglu else 1.0)) + 4 * s * h
    if cfg.num_experts:
        layer += 2 * 2 * h * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) * (cfg.moe_router_topk - 1)
    recompute = 4 / 3 if cfg.recompute_granularity == "full" else 1.0
    flops = 3 * tokens * (cfg.num_layers * layer * recompute + 2 * h * cfg.padded_vocab_size)
    per_rank = flops / (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size)
    rate = 2.5e9 / (14 if cfg.params_dtype == "bf16" else 1)
    return (9.0 if nproc > 1 else 5.0) + ITERATIONS * per_rank / rate


# ------------------------------------------------------------------------------------------------ measuring
def activation_shares(run_dir: str) -> dict:
    """{rank: (saved + temporary) / peak} at each rank's measured peak (tracer.parse)."""
    from tracer.parse import parse_run
    out = {}
    for pr in parse_run(run_dir):
        cat = pr.peak_by_category
        total = sum(cat.values())
        out[pr.rank] = (cat.get("saved", 0) + cat.get("temporary", 0)) / total if total else 0.0
    return out


def measured_share(doc: dict):
    cov = (doc.get("formula_set") or {}).get("coverage")
    return cov.get("measured_share") if isinstance(cov, dict) else None


def rank_rows(cand: dict, heads: list[dict], shares: dict, fitted: dict | None, modelled: dict) -> list[dict]:
    rows = []
    for h in heads:
        r, meas = h["rank"], int(h["allocator_peak_bytes"])
        xc = h.get("crosscheck_peak_bytes")
        pf = fitted["ranks"][r] if fitted else None
        pm = modelled["ranks"][r]
        rows.append({
            "config": cand["name"], "rank": r, "coords": h.get("coords") or {}, "measured": meas,
            "crosscheck": xc, "crosscheck_diff": A._err(xc, meas) if xc is not None else None,
            "crosscheck_replay": h.get("crosscheck_replay_peak_bytes"),
            "crosscheck_events": h.get("crosscheck_events"), "crosscheck_error": h.get("crosscheck_error"),
            "activation_share": shares.get(r),
            "fitted": pf["peak_bytes"] if pf else None, "fitted_err": A._err(pf["peak_bytes"], meas) if pf else None,
            "fitted_phase": pf["peak_phase"] if pf else None,
            "modelled": pm["peak_bytes"], "modelled_err": A._err(pm["peak_bytes"], meas),
            "measured_share": measured_share(fitted) if fitted else None,
            "versions": h.get("versions", {}), "device": h.get("device")})
    return rows


def _stage(co: dict) -> str:
    return "/".join(str(co.get(k, "?")) for k in ("tp", "pp", "dp", "ep"))


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'config':50s} {'rank':>4s} {'tp/pp/dp/ep':>11s} {'act %':>5s} {'measured KiB':>13s} {'xcheck KiB':>12s} "
           f"{'xc %':>7s} {'fitted KiB':>12s} {'err %':>7s} {'modelled KiB':>13s} {'err %':>7s} {'meas. share':>11s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        xc = (f"{A._kib(r['crosscheck']):>12s} {r['crosscheck_diff']:+7.3f}" if r["crosscheck"] is not None
              else f"{'n/a':>12s} {'':>7s}")
        fit = (f"{A._kib(r['fitted']):>12s} {r['fitted_err']:+7.2f}" if r["fitted"] is not None
               else f"{'-':>12s} {'-':>7s}")
        ms = r["measured_share"]
        ms_s = f"{100 * ms:10.1f}%" if isinstance(ms, (int, float)) else "n/a"
        act = f"{100 * r['activation_share']:5.0f}" if r["activation_share"] is not None else "-"
        print(f"{r['config'][:50]:50s} {r['rank']:4d} {_stage(r['coords']):>11s} {act:>5s} {A._kib(r['measured']):>13s} "
              f"{xc} {fit} {A._kib(r['modelled']):>13s} {r['modelled_err']:+7.2f} {ms_s:>11s}")


def crosscheck_summary(rows: list[dict]) -> tuple[str, bool]:
    vals = [r for r in rows if r["crosscheck"] is not None]
    missing = len(rows) - len(vals)
    if not vals:
        return "cross-check: no cross-check peaks", False
    worst = max(vals, key=lambda r: abs(r["crosscheck_diff"]))
    exact = sum(r["crosscheck"] == r["measured"] for r in vals)
    ok = missing == 0 and abs(worst["crosscheck_diff"]) <= XCHECK_TOL
    line = (f"cross-check: {exact}/{len(rows)} ranks equal to the byte, max |difference| "
            f"{abs(worst['crosscheck_diff']):.4f}% ({worst['config']} rank {worst['rank']}); tolerance {XCHECK_TOL:g}%"
            + (f"; {missing} rank(s) without a cross-check" if missing else ""))
    return line, ok


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/accuracy_random.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--count", type=int, default=DEFAULT_COUNT, help="configs to accept (default 30)")
    ap.add_argument("--quick", action="store_true",
                    help=f"only {QUICK} of the drawn configs (the cheapest with 1 and with 2 processes; for CI)")
    ap.add_argument("--list", action="store_true", help="print the drawn configs (no profiling) and exit")
    ap.add_argument("--gpu-kernels", action="store_true",
                    help="run the draws with Megatron-LM's GPU kernels on CPU stand-ins (TE spec or local, fusions "
                         "on or off; tracer/standins.py)")
    A.common_options(ap, DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.count < 1:
        ap.error("--count must be >= 1")
    t_start = time.perf_counter()
    fitted, modelled = A.load_sets(args)

    gen = Generator(args.seed, fitted.path if fitted else None, gpu_kernels=args.gpu_kernels)
    stream = iter(gen)
    drawn = gen.take(args.count, stream)
    if args.list:
        for c in drawn:
            print(f"{c['name']:70s} nproc {c['nproc']}  ~{c['cost_s']:.0f} s  {' '.join(c['argv'])}")
        for r in gen.rejected:
            print(f"  rejected {r['name']}: {r['reason']}")
        print(f"{len(drawn)} drawn, {len(gen.rejected)} rejected before profiling (seed {args.seed})")
        return 0
    todo = list(drawn)
    if args.quick:   # the cheapest one-process and two-process configs first, then the rest by cost
        by_cost = sorted(drawn, key=lambda c: c["cost_s"])
        first = [next(c for c in by_cost if c["nproc"] == n) for n in (1, 2) if any(c["nproc"] == n for c in by_cost)]
        todo = first + [c for c in by_cost if c not in first]
    want = QUICK if args.quick else args.count

    out = os.path.join(args.out, f"seed{args.seed}" + ("_gk" if args.gpu_kernels else ""))
    os.makedirs(out, exist_ok=True)
    rows, accepted, rejected, failures, t_prof = [], [], [], [], 0.0
    while todo and len(accepted) < want:
        c = todo.pop(0)
        run_dir = os.path.join(out, c["name"])
        if args.reprofile or not A.cached(run_dir, c, ITERATIONS):
            print(f"[{len(accepted) + 1}/{want}] profiling {c['name']} ({c['nproc']} process(es), ~{c['cost_s']:.0f} s)"
                  " ...", file=sys.stderr, flush=True)
            try:
                c["profile_s"] = A.profile(c, out, ITERATIONS, args.timeout)
                t_prof += c["profile_s"]
            except A.BenchError as exc:
                print(f"error: {exc}", file=sys.stderr)
                failures.append({"name": c["name"], "error": str(exc)})
                continue
        shares = activation_shares(run_dir)
        low = {r: s for r, s in shares.items() if s < MIN_ACT_SHARE}
        if low:
            r, s = min(low.items(), key=lambda kv: kv[1])
            rejected.append({"name": c["name"], "stage": "measured",
                             "reason": f"activations {100 * s:.0f}% of rank {r}'s measured peak"})
            if not args.quick and len(accepted) + len(todo) < want:
                todo += gen.take(1, stream)   # the next candidate, deterministically
            continue
        heads = A.measured(run_dir, c["nproc"])
        try:
            pf = A.predict_json(c, fitted.path) if fitted else None
            pm = A.predict_json(c, modelled.path)
        except Exception as exc:
            failures.append({"name": c["name"], "error": f"estimator: {exc}"})
            continue
        rows += rank_rows(c, heads, shares, pf, pm)
        accepted.append(c)

    versions = rows[0]["versions"] if rows else {}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Accuracy on random held-out CPU configs (seed {args.seed}, {len(accepted)} configs; {now}; megatron-core "
          f"{versions.get('megatron_core', '?')}, torch {versions.get('torch', '?')}, python "
          f"{platform.python_version()}, {ITERATIONS} iterations, "
          f"{'GPU kernels on CPU stand-ins' if args.gpu_kernels else 'local spec, CPU kernels'}, gloo)")
    print(f"fitted set: {fitted.name if fitted else 'none'}; modelled set: {modelled.name}; act % = saved + temporary "
          f"at the measured peak; xcheck = torch.profiler + c10 process-wide accounting (tracer/profile.py --crosscheck)")
    print_table(rows)
    print()
    ok = not failures and bool(rows) and len(accepted) == want
    summaries = {}
    for key in ("fitted", "modelled"):
        line, met = A.summary(rows, key)
        summaries[key] = line
        print(line)
        if key == "fitted" and not met:
            ok = False
    xline, xok = crosscheck_summary(rows)
    summaries["crosscheck"] = xline
    print(xline)
    ok = ok and xok
    print(f"targets: fitted set within {A.TARGET_ABS:g}% and no under-prediction beyond {A.TARGET_UNDER:g}% on every "
          f"rank, cross-check within {XCHECK_TOL:g}%: {'met' if ok else 'MISSED'}"
          + (f"; failed runs: {', '.join(f['name'] for f in failures)}" if failures else ""))
    n_meas = len(rejected)
    rejected = gen.rejected + rejected
    elapsed = time.perf_counter() - t_start
    print(f"drawn: {len(accepted)} accepted, {len(rejected) - n_meas} rejected before profiling, {n_meas} rejected "
          f"once measured (activations under {100 * MIN_ACT_SHARE:.0f}%); profiling {t_prof:.0f} s, total "
          f"{elapsed:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"date": now, "seed": args.seed, "count": want, "iterations": ITERATIONS,
                       "configs": [{k: c[k] for k in ("name", "argv", "nproc", "launcher", "tags", "cost_s", "profile_s")
                                    if k in c}
                                   for c in accepted],
                       "rows": rows, "rejected": rejected, "failures": failures, "summary": summaries,
                       "targets_met": ok, "profiling_seconds": t_prof, "total_seconds": elapsed}, fh, indent=1)
    return 1 if (args.check and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
