"""Layout search: every parallel layout Megatron accepts for the world size and model, estimated, the ones that fit
kept and ranked by communication bytes per rank per iteration, then pipeline bubble.

A layout is TP, PP, VPP, CP, EP, expert TP, micro batch size, recompute and distributed optimizer; everything else
(model, global batch, precision, kernels) stays as the command line says. Sequence parallelism is on whenever TP > 1
(Megatron needs it with EP x TP and with TP comm overlap; it only ever lowers memory). A candidate is kept only when
the estimator's own validation (Megatron's rules, estimator.args) accepts it, so every listed layout is one Megatron
would start.

A layout fits when every pipeline stage's total fits in the GPU: the predicted allocated peak plus the same modelled
allowances the verdict adds (estimator.verdict: CUDA context, NCCL per communicator the stage uses, fragmentation).
Fragmentation is a percent of the peak here (5 unless --fragmentation-percent): the caching-allocator replay a
single estimate models it with (estimator.reserved) costs too much per layout.
"""
from __future__ import annotations

from typing import Optional

import sys
import time

from estimator import comm as C
from estimator import invariants
from estimator import memory as MEM
from estimator import parallel as PAR
from estimator import verdict as V
from estimator.args import ConfigError, config_from, tokenize
from estimator._record import dataclass

# The dests a layout sets; the command line's values for them are replaced.
LAYOUT_DESTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "micro_batch_size",
                "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_activations",
                "distribute_saved_activations", "use_distributed_optimizer", "sequence_parallel",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout", "microbatch_group_size_per_vp_stage")
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass
class Layout:
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int
    mbs: int
    recompute: str
    dist_opt: bool

    def flags(self) -> dict:
        """The dests this layout sets (LAYOUT_DESTS)."""
        d = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
             "context_parallel_size": self.cp, "expert_model_parallel_size": self.ep,
             "micro_batch_size": self.mbs, "use_distributed_optimizer": self.dist_opt,
             "sequence_parallel": self.tp > 1}
        if self.ep > 1 or self.etp != self.tp:
            d["expert_tensor_parallel_size"] = self.etp
        if self.vpp > 1:
            d["num_virtual_stages_per_pipeline_rank"] = self.vpp
        if self.recompute == "selective":
            d["recompute_granularity"] = "selective"
        elif self.recompute == "full":
            d.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return d

    def argv(self) -> list[str]:
        """The Megatron-LM flags that select this layout."""
        out = []
        for dest, value in self.flags().items():
            flag = "--" + dest.replace("_", "-")
            if value == 1 and dest in ("context_parallel_size", "expert_model_parallel_size"):
                continue  # Megatron's default
            if value is True:
                out.append(flag)
            elif value is not False:
                out += [flag, str(value)]
        return out


@dataclass
class Candidate:
    layout: Layout
    peak_bytes: float         # predicted allocated peak (the estimate proper), its worst stage
    peak_stage: int
    total_bytes: float        # the largest stage total with the verdict's allowances (what must fit in the GPU)
    total_stage: int
    comm_bytes: int           # wire bytes per iteration of the busiest rank (all dimensions)
    bubble: float             # pipeline bubble fraction (p - 1) / (v * m) (Narayanan et al. 2021)
    num_microbatches: int

    def to_dict(self) -> dict:
        L = self.layout
        return {"layout": {"tp": L.tp, "pp": L.pp, "vpp": L.vpp, "cp": L.cp, "ep": L.ep, "etp": L.etp,
                           "micro_batch_size": L.mbs, "recompute": L.recompute, "distributed_optimizer": L.dist_opt},
                "flags": self.layout.argv(), "peak_bytes": self.peak_bytes, "peak_stage": self.peak_stage,
                "total_bytes": self.total_bytes, "total_stage": self.total_stage,
                "comm_bytes_per_rank_per_iteration": self.comm_bytes, "pipeline_bubble": self.bubble,
                "num_microbatches": self.num_microbatches}


@dataclass
class SearchResult:
    gpu_bytes: float
    allowances: dict          # estimator.verdict's allowances the totals include
    gpu_name: str
    enumerated: int           # candidate layouts tried
    accepted: int             # of those, accepted by Megatron's validation (each estimated)
    fits: list                # Candidates that fit, best first
    seconds: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(given: dict) -> list[Layout]:
    """Every combination worth asking the validator about: sizes that divide what they must divide."""
    world = given.get("nproc_per_node", 1) * given.get("nnodes", 1)
    layers = given.get("num_layers") or 1
    experts = given.get("num_experts") or 0
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            if pp > layers:
                continue
            vpps = [1] + ([v for v in _divisors(layers // pp) if v > 1] if pp > 1 and layers % pp == 0 else [])
            for cp in _divisors(world // (tp * pp)):
                for ep in (_divisors(experts) if experts else [1]):
                    for etp in ((1, tp) if experts and tp > 1 else (tp,)):
                        if world % (etp * ep * pp):
                            continue
                        dp = world // (tp * pp * cp)
                        for vpp in vpps:
                            for mbs in MICRO_BATCHES:
                                for rec in RECOMPUTE:
                                    for dist in ((False, True) if dp > 1 else (False,)):
                                        out.append(Layout(tp, pp, vpp, cp, ep, etp, mbs, rec, dist))
    return out


def bubble(pp: int, vpp: int, microbatches: int) -> float:
    return (pp - 1) / (vpp * microbatches) if pp > 1 else 0.0


class _Progress:
    """A one-line bar on stderr, drawn only once the search has run for more than a second."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.start < 1.0 or (now - self.last < 0.1 and done < self.total):
            return
        self.last, self.drawn = now, True
        width = 30
        filled = width * done // max(1, self.total)
        self.stream.write(f"\rsearch [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} layouts "
                          f"{now - self.start:.1f} s")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()


def search(argv: list[str], gpu_bytes: float, fset, progress: bool = True, workers: Optional[int] = None,
           allowances: Optional[dict] = None, gpu_name: Optional[str] = None,
           torch_adam: bool = False) -> SearchResult:
    """Estimate every layout Megatron accepts for the command line's model and world size; keep those whose every
    stage's total (predicted peak plus the verdict's allowances) is at most gpu_bytes, best (least communication
    per rank, then least bubble) first. allowances: overrides of estimator.verdict.DEFAULTS (None entries keep
    the default). torch_adam: the optimizer step is torch AdamW's (--torch-adam). workers: processes to spread the
    layouts over (default: the CPUs this process may use; 1 = in process)."""
    t0 = time.perf_counter()
    allow = V.allowances(**(allowances or {}))
    given, ignored, conservative = tokenize(argv)
    base = {k: v for k, v in given.items() if k not in LAYOUT_DESTS}
    base.setdefault("micro_batch_size", 1)
    if torch_adam:
        base["torch_adam"] = True   # get-training-info --torch-adam (static_memory.adam_step)
    layouts = enumerate_layouts(base)
    # Layouts that cut the model the same way go to one worker, so its memos are shared among them.
    groups: dict = {}
    for lay in layouts:
        groups.setdefault((lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp), []).append(lay)
    global _FSET
    _FSET = fset  # workers are forked: they inherit it (a used formula set holds caches pickle cannot copy)
    jobs = [(base, ignored, conservative, group, gpu_bytes, allow) for group in groups.values()]
    bar = _Progress(len(layouts)) if progress else None
    accepted, fits, done = 0, [], 0
    for n, acc, ok in _run(jobs, workers):
        done += n
        accepted += acc
        fits += ok
        if bar is not None:
            bar.update(done)
    if bar is not None:
        bar.close()
    fits.sort(key=rank_key)
    name = gpu_name or f"{gpu_bytes / _GIB:g} GiB"
    return SearchResult(gpu_bytes, allow, name, len(layouts), accepted, fits, time.perf_counter() - t0)


_FSET = None


def _run(jobs: list, workers: Optional[int]):
    """Yield _evaluate(job) for every job, in worker processes when there are several CPUs and enough work."""
    import os
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    total = sum(len(job[3]) for job in jobs)
    if workers > 1 and total > 1000:
        import multiprocessing
        if "fork" in multiprocessing.get_all_start_methods():  # the workers inherit the loaded formula set
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                yield from pool.imap_unordered(_evaluate, jobs)
            return
    for job in jobs:
        yield _evaluate(job)


def _evaluate(job: tuple) -> tuple:
    """(layouts tried, layouts accepted, Candidates that fit) for layouts that all cut the model the same way."""
    base, ignored, conservative, layouts, gpu_bytes, allow = job
    ctx = allow["cuda_context_gib"] * V.GiB
    frag = 1.0 + allow["fragmentation_percent"] / 100.0
    fset = _FSET
    accepted, fits = 0, []
    chunks = None           # the parameter chunks depend only on the cut: (TP, PP, VPP, EP, ETP)
    comm_memo: dict = {}    # per-iteration bytes do not depend on the micro batch size (per-microbatch bytes
    # scale with it, the microbatch count inversely) nor on recompute other than full (which replays TP collectives)
    static_memo: dict = {}  # static bytes (a lower bound of the peak) depend on neither micro batch nor recompute
    for lay in layouts:
        try:
            cfg = config_from({**base, **lay.flags()}, ignored, conservative)
        except (ConfigError, PAR.ParallelConfigError):
            continue
        accepted += 1
        if chunks is None:
            chunks = MEM.all_param_chunks(cfg)
        static = static_memo.get((lay.cp, lay.dist_opt))
        if static is None:
            static = static_memo[(lay.cp, lay.dist_opt)] = MEM.static_peak_bytes(cfg, chunks)
        if static * frag + ctx > gpu_bytes:   # a lower bound of every total (no NCCL yet)
            continue
        est = invariants.checked_estimate(cfg, fset, chunks_by_stage=chunks, per_op=False)
        if est.max_peak_bytes * frag + ctx > gpu_bytes:
            continue
        key = (lay.cp, lay.dist_opt, lay.recompute == "full")
        memo = comm_memo.get(key)
        if memo is None:
            layout = PAR.layout_from_config(cfg)
            report = C.communication(cfg, layout, chunks)
            memo = comm_memo[key] = (report.busiest_rank_bytes(), V.stage_communicators(cfg, layout, report))
        busiest, communicators = memo
        worst = max((V.stage_budget(r.pp_rank, r.peak_bytes, communicators.get(r.pp_rank, []), allow)
                     for r in est.ranks), key=lambda sb: sb.total)
        if worst.total > gpu_bytes:
            continue
        fits.append(Candidate(lay, est.max_peak_bytes, est.max_peak_pp_rank, worst.total, worst.pp_rank, busiest,
                              bubble(lay.pp, lay.vpp, cfg.num_microbatches), cfg.num_microbatches))
    return len(layouts), accepted, fits


def rank_key(c: Candidate) -> tuple:
    """Least communication per rank first, then least bubble; among equals, the least recompute (it costs
    compute: about a third more with full recompute), then the least memory."""
    return (c.comm_bytes, c.bubble, RECOMPUTE.index(c.layout.recompute), c.total_bytes, c.peak_bytes)


_GIB = float(1 << 30)


def to_text(result: SearchResult, top: int = 20) -> str:
    a = result.allowances
    lines = [f"Layout search: {result.enumerated} layouts tried, {result.accepted} accepted by Megatron's "
             "validation,",
             f"{len(result.fits)} fit on {result.gpu_name} ({result.gpu_bytes / _GIB:.2f} GiB) "
             f"({result.seconds:.1f} s).",
             "Ranked by communication per rank per iteration, then pipeline bubble, then least recompute.",
             "peak: predicted allocated bytes (PyTorch's allocator); total: the worst stage with the verdict's",
             f"allowances (CUDA context {a['cuda_context_gib']:.2f} GiB, NCCL {a['nccl_gib_per_communicator']:g} GiB "
             f"x communicators, fragmentation {a['fragmentation_percent']:g}%), what must fit.",
             ""]
    if not result.fits:
        lines.append("No layout fits.")
        return "\n".join(lines) + "\n"
    head = f"{'#':>3} {'TP':>3} {'PP':>3} {'VPP':>3} {'CP':>3} {'EP':>3} {'ETP':>3} {'MBS':>3} {'recompute':<9} " \
           f"{'distopt':<7} {'peak GiB':>8} {'total GiB':>9} {'comm GiB/it':>11} {'bubble':>6}"
    lines.append(head)
    for n, c in enumerate(result.fits[:top], 1):
        L = c.layout
        lines.append(f"{n:>3} {L.tp:>3} {L.pp:>3} {L.vpp:>3} {L.cp:>3} {L.ep:>3} {L.etp:>3} {L.mbs:>3} "
                     f"{L.recompute:<9} {'yes' if L.dist_opt else 'no':<7} {c.peak_bytes / _GIB:>8.2f} "
                     f"{c.total_bytes / _GIB:>9.2f} "
                     f"{c.comm_bytes / _GIB:>11.2f} {100 * c.bubble:>5.1f}%")
    if len(result.fits) > top:
        lines.append(f"... {len(result.fits) - top} more (--top N)")
    lines += ["", "Best layout's flags:"] + _wrap(result.fits[0].layout.argv(), 100)
    return "\n".join(lines) + "\n"


def _wrap(argv: list[str], width: int) -> list[str]:
    """Flags (each with its value) on lines of at most `width` columns, indented by two."""
    words, i = [], 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        words.append(" ".join(argv[i:i + 2]) if takes_value else argv[i])
        i += 2 if takes_value else 1
    lines, line = [], " "
    for w in words:
        if len(line) + 1 + len(w) > width and line.strip():
            lines.append(line)
            line = " "
        line += " " + w
    return lines + [line]


def to_json(result: SearchResult, top: int = 20) -> dict:
    return {"gpu_bytes": result.gpu_bytes, "gpu": result.gpu_name,
            "allowances": dict(result.allowances, modelled=True),
            "enumerated": result.enumerated, "accepted": result.accepted,
            "fits": len(result.fits), "seconds": result.seconds,
            "ranked_by": ["comm_bytes_per_rank_per_iteration", "pipeline_bubble", "recompute", "total_bytes",
                          "peak_bytes"],
            "layouts": [c.to_dict() for c in result.fits[:top]]}
