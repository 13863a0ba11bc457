"""The profiling plan of one training job (`profile-training-info ... --campaign DIR`, fit.job_campaign): from the
job's own command line, the few small runs whose traces determine every allocation program the job's ops run.

What the plan keeps and what it varies, and why:
- The model's widths (hidden, heads, groups, head dim, ffn, vocabulary, experts) and every feature flag stay the
  job's: the fitted sizes are then exact for this model, and only the variables a layout or a schedule moves need to
  vary. Layers shrink to what each pipeline chunk kind needs (two per chunk: the model's first layer and a later one;
  one per chunk under interleaving), microbatches to a few per pipeline stage: neither changes a segment's program.
- Sequence length and micro-batch size vary over four shapes, (s, 1), (s/2, 1), (s, 2), (s/2, 3), with s the job's
  sequence: every size is then solved over two values of each, in both micro-batch cells (a one-sequence batch runs
  other kernels than a larger one, fit.programs).
- Layouts: the job's own (its TP, SP, CP, EP, expert TP, PP and interleaving); TP, CP and PP 1; a pipeline of two
  stages (the first and the last stage kinds) when the job has none; CP alone when the job has it; half its expert
  parallelism when it has that: each size then has two values, so the set predicts other layouts of the same model
  too (what `--search` weighs). Data parallelism stays small: two ranks
  where the job shards the optimizer or needs them for expert parallelism.
- Each layout is traced one rank per rank class (the first, a middle and the last pipeline stage) on torch's fake
  process group (tracer/fake_world.py): one node, or one GPU, serves a job of any world size.
- Flags of uneven pipelines (--decoder-first/last-pipeline-num-layers, --pipeline-model-parallel-layout) are left out
  of the plan: their stages are the same kinds with other layer counts, which the estimator composes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .campaign import _set_flag

# Flags the plan sets itself (the rest of the job's line is kept as it is).
_DROPPED_VALUE = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                  "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage",
                  "--num-virtual-stages-per-pipeline-rank", "--microbatch-group-size-per-virtual-pipeline-stage",
                  "--train-iters", "--train-samples", "--rampup-batch-size", "--exit-interval", "--exit-duration-in-mins",
                  "--data-parallel-size")
_DROPPED_SWITCH = ("--sequence-parallel",)
# Seconds one traced rank takes, for the printed estimate of the plan's time (a tiny model; the job's widths
# and the device change it, so it is said as an estimate).
SECONDS_PER_RANK = {"cpu": 15.0, "cuda": 45.0}


class PlanError(ValueError):
    """A job the plan cannot shrink (one line)."""


@dataclass
class PlannedRun:
    name: str
    argv: list            # Megatron flags
    world: int            # fake world size
    ranks: list           # ranks traced
    layout: str           # what the run stands for
    shape: tuple          # (seq, micro batch)


@dataclass
class Plan:
    job_argv: list
    job_world: int
    runs: list = field(default_factory=list)
    validation: PlannedRun | None = None
    notes: list = field(default_factory=list)

    def traced_ranks(self) -> int:
        return sum(len(r.ranks) for r in self.runs)

    def grid(self, name: str, device: str, iterations: int) -> dict:
        """The plan as a campaign grid (fit.campaign): each run a config with its whole command line."""
        return {"name": name, "description": f"profiling plan of a {self.job_world}-rank job (fit.job_plan)",
                "device": device, "iterations": iterations, "base": [],
                "configs": [{"name": r.name, "set": {}, "flags": list(r.argv), "nproc": r.world, "ranks": r.ranks,
                             "note": f"{r.layout}, s={r.shape[0]} b={r.shape[1]}"} for r in self.runs]}

    def describe(self, device: str, jobs: int) -> str:
        per = SECONDS_PER_RANK.get(device, 30.0)
        n = self.traced_ranks() + (len(self.validation.ranks) if self.validation else 0)
        lines = [f"plan: {len(self.runs)} runs, {self.traced_ranks()} traced ranks on the fake process group, "
                 f"then one validation run; expected about {math.ceil(n * per / max(jobs, 1) / 60)} min "
                 f"({jobs} at a time)"]
        for r in self.runs:
            lines.append(f"  {r.name:<28} {r.layout:<34} s={r.shape[0]:<6} b={r.shape[1]}  world {r.world}, "
                         f"ranks {','.join(map(str, r.ranks))}")
        if self.validation:
            v = self.validation
            lines.append(f"  validation: {v.layout}, s={v.shape[0]} b={v.shape[1]}, world {v.world}, "
                         f"ranks {','.join(map(str, v.ranks))}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _parse(argv: list, world: int):
    from estimator.args import ConfigError, parse_args
    try:
        return parse_args(["--nproc_per_node", str(world)] + list(argv))
    except ConfigError as exc:
        raise PlanError(str(exc)) from None


def _strip(argv: list) -> list:
    out = list(argv)
    for flag in _DROPPED_VALUE:
        out = _set_flag(out, flag, None)
    return [a for a in out if a not in _DROPPED_SWITCH]


def _seq_unit(cfg) -> int:
    """Sequence lengths the plan picks are multiples of this: TP (sequence parallelism splits s), twice CP
    (load-balanced context chunks) and 8."""
    return math.lcm(8, cfg.tensor_model_parallel_size, 2 * cfg.context_parallel_size)


def _half(s: int, unit: int) -> int:
    return max(unit, (s // 2) // unit * unit)


def _data_parallel(cfg, tp: int, cp: int, ep: int, etp: int) -> int:
    """The plan's data-parallel size: 2 where the job has data parallelism and shards the optimizer (the shard is a
    function of it), else 1; raised until expert parallelism fits (EP x expert TP divides TP x CP x DP)."""
    dp = 2 if cfg.data_parallel_size > 1 and (cfg.use_distributed_optimizer or
                                              cfg.data_parallel_sharding_strategy != "no_shard") else 1
    while (tp * cp * dp) % (ep * etp):
        dp *= 2
    return dp


def _moe_pattern(cfg, layers: int):
    """--moe-layer-freq for a shrunk model: the job's integer frequency as it is; a list pattern becomes its first
    layer's kind then the other kind (both kinds traced), or all one kind."""
    freq = cfg.moe_layer_freq
    if not cfg.num_experts or isinstance(freq, int):
        return None
    kinds = list(freq)
    first = kinds[0]
    other = 1 - first if (1 - first) in kinds else first
    return "([" + ",".join(str(k) for k in [first] + [other] * (layers - 1)) + "])"


def _run_argv(base: list, cfg, *, tp: int, pp: int, vpp: int, sp: bool, seq: int, mb: int, dp: int,
              layers_per_chunk: int, microbatches: int) -> list:
    layers = pp * vpp * layers_per_chunk
    argv = list(base)
    argv = _set_flag(argv, "--num-layers", layers)
    argv = _set_flag(argv, "--tensor-model-parallel-size", tp)
    argv = _set_flag(argv, "--pipeline-model-parallel-size", pp)
    argv = _set_flag(argv, "--seq-length", seq)
    if "--max-position-embeddings" in argv:
        argv = _set_flag(argv, "--max-position-embeddings", max(seq, _flag(argv, "--max-position-embeddings")))
    argv = _set_flag(argv, "--micro-batch-size", mb)
    argv = _set_flag(argv, "--global-batch-size", mb * dp * microbatches)
    if vpp > 1:
        argv = _set_flag(argv, "--num-layers-per-virtual-pipeline-stage", layers_per_chunk)
    if sp and tp > 1:
        argv.append("--sequence-parallel")
    if cfg.recompute_num_layers:
        argv = _set_flag(argv, "--recompute-num-layers", min(cfg.recompute_num_layers, layers // pp))
    pattern = _moe_pattern(cfg, layers)
    if pattern:
        argv = _set_flag(argv, "--moe-layer-freq", pattern)
    return argv


def _flag(argv: list, flag: str) -> int:
    return int(argv[argv.index(flag) + 1])


def _peak(argv: list, world: int, device: str) -> float:
    """The estimator's highest rank peak for a planned run (the default set), with a reserved-memory margin and,
    on a GPU, the CUDA context: what the run needs on the device that traces it."""
    from estimator.memory import estimate
    from estimator.verdict import DEFAULTS
    est = estimate(_parse(argv, world), None, device=device)
    extra = DEFAULTS["cuda_context_gib"] * 2 ** 30 if device != "cpu" else 0.0
    return max(r.peak_bytes for r in est.ranks) * 1.15 + extra


def make_plan(job_argv: list, job_world: int, limit_bytes: float | None = None, device: str = "cuda") -> Plan:
    """The plan for a job: `job_argv` its Megatron flags (the training script's arguments), `job_world` its
    number of processes. limit_bytes: the memory one traced rank may take (the device's, or the host's share on
    CPU): a layout whose largest run would not fit takes the smallest power-of-two TP up to the job's that fits, and
    sequences are halved while the job's own layout does not fit (the estimator's default set decides)."""
    from tracer.fake_world import pipeline_ranks
    cfg = _parse(job_argv, job_world)
    base = _strip(job_argv)
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size or tp
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    sp = bool(cfg.sequence_parallel)
    unit = _seq_unit(cfg)
    s = max(unit, cfg.seq_length // unit * unit)
    plan = Plan(list(job_argv), job_world)

    def runs_of(key, t, p, v, spl, c, e, et, seq_max):
        dp = _data_parallel(cfg, t, c, e, et)
        world = t * p * c * dp
        out = []
        for seq, mb in [(seq_max, 1), (_half(seq_max, unit), 1), (seq_max, 2), (_half(seq_max, unit), 3)]:
            argv = _run_argv(base, cfg, tp=t, pp=p, vpp=v, sp=spl, seq=seq, mb=mb, dp=dp,
                             layers_per_chunk=1 if v > 1 else 2, microbatches=max(2, p))
            if c != cp or "--context-parallel-size" in argv:
                argv = _set_flag(argv, "--context-parallel-size", c)
            if e != ep:
                argv = _set_flag(argv, "--expert-model-parallel-size", e)
            if cfg.num_experts and "--expert-tensor-parallel-size" in argv:
                argv = _set_flag(argv, "--expert-tensor-parallel-size", et)
            out.append((f"{key}_s{seq}_b{mb}", argv, world, (seq, mb)))
        return out

    def fits(runs) -> bool:
        # the largest shapes: (s, 2) and (s/2, 3)
        return limit_bytes is None or all(_peak(a, w, device) <= limit_bytes for _, a, w, _ in runs[2:])

    job = runs_of("job", tp, pp, vpp, sp, cp, ep, etp, s)
    while not fits(job) and _half(s, unit) < s:
        s = _half(s, unit)
        job = runs_of("job", tp, pp, vpp, sp, cp, ep, etp, s)
    if not fits(job):
        raise PlanError(f"even the job's own layout with {pp * vpp * (1 if vpp > 1 else 2)} layers and sequence "
                        f"{s} does not fit in {limit_bytes / 2**30:.1f} GiB per traced rank")
    if s != cfg.seq_length:
        plan.notes.append(f"sequences up to {s} are traced (the job's: {cfg.seq_length}); sizes are exact in s, so "
                          f"the job's own is predicted")
    layouts = [("job", "the job's layout" + (f" (TP {tp}{' + SP' if sp else ''}, PP {pp}"
                                             f"{f' x {vpp} virtual' if vpp > 1 else ''}, CP {cp}, EP {ep})"),
                tp, pp, vpp, sp, cp, ep, etp)]
    if tp > 1 or cp > 1 or pp > 1:
        layouts.append(("tp1", "one rank per tensor (TP {t}, CP 1, PP 1)", 1, 1, 1, False, 1, ep, 1))
    if pp == 1:
        layouts.append(("pp2", "two pipeline stages (TP {t}, PP 2)", 1, 2, 1, False, 1, ep, 1))
    if cp > 1:
        layouts.append(("cp", f"context parallelism alone (TP {{t}}, CP {cp})", 1, 1, 1, False, cp, ep, 1))
    if ep > 1:
        layouts.append(("ep", f"half the expert parallelism (TP {{t}}, EP {ep // 2})", 1, 1, 1, False, 1, ep // 2,
                        1))
    for key, desc, t, p, v, spl, c, e, et in layouts:
        runs = job if key == "job" else runs_of(key, t, p, v, spl, c, e, et, s)
        while key != "job" and t < tp and not fits(runs):
            t *= 2
            runs = runs_of(key, t, p, v, sp, c, e, min(et * 2, etp) if cfg.num_experts else et, s)
        if key != "job" and not fits(runs):
            plan.notes.append(f"left out: {desc.format(t=t)} does not fit in {limit_bytes / 2**30:.1f} GiB")
            continue
        if key != "job" and t == tp > 1:
            plan.notes.append(f"{desc.format(t=t)}: only the job's TP fits, so TP is traced at one value")
        for name, argv, world, shape in runs:
            name = name.replace("tp1_", f"tp{t}_", 1)     # its TP where the device needed more than one
            plan.runs.append(PlannedRun(name, argv, world, pipeline_ranks(_parse(argv, world)), desc.format(t=t),
                                        shape))

    # Validation: the job's own layout and shape with more layers and microbatches than any traced run, so the
    # comparison is a config the fit never saw.
    dp = _data_parallel(cfg, tp, cp, ep, etp)
    per_chunk = 1 if vpp > 1 else 2
    layers_per_chunk = min(max(per_chunk + 1, cfg.num_layers // (pp * vpp)), 2 * per_chunk + 2)
    world = tp * pp * cp * dp
    vseq = cfg.seq_length
    while True:
        vargv = _run_argv(base, cfg, tp=tp, pp=pp, vpp=vpp, sp=sp, seq=vseq, mb=cfg.micro_batch_size, dp=dp,
                          layers_per_chunk=layers_per_chunk, microbatches=max(4, 2 * pp))
        if limit_bytes is None or _peak(vargv, world, device) <= limit_bytes or layers_per_chunk == per_chunk + 1:
            break
        layers_per_chunk -= 1     # fewer layers first (still more than any traced run), then the plan's sequence
    if limit_bytes is not None and _peak(vargv, world, device) > limit_bytes:
        vseq = s
        vargv = _run_argv(base, cfg, tp=tp, pp=pp, vpp=vpp, sp=sp, seq=vseq, mb=min(cfg.micro_batch_size, 2), dp=dp,
                          layers_per_chunk=layers_per_chunk, microbatches=max(4, 2 * pp))
    plan.validation = PlannedRun("validation", vargv, world, pipeline_ranks(_parse(vargv, world)),
                                 f"the job's layout with {pp * vpp * layers_per_chunk} layers",
                                 (vseq, _flag(vargv, "--micro-batch-size")))
    return plan
