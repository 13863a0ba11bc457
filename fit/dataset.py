"""Parsed traces -> fit samples: one value per (run, op, metric), with the run's variables and switches.

Per op, rows of every rank, layer, microbatch and iteration >= 1 (iteration 0 is warm-up: lazily created
buffers, first-step optimizer state) are reduced to their mode when it is a strict majority, else the low median
(saved bytes) or the maximum (transient peaks), so the sample is always a byte count that really occurred. The optimizer step's transient (peak above the level
at `optim` entry) becomes the model-level op `optimizer`.
"""
from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from estimator.formulas import switches as config_switches
from estimator.formulas import variables as config_variables

METRICS = ("saved", "fwd_peak", "bwd_peak")
OPTIMIZER_OP = "optimizer"


def estimator_ops() -> tuple:
    """The op names the estimator composes a layer and a model from (its vocabulary, in its own module)."""
    from estimator import activations as A
    return tuple(dict.fromkeys(A.ATTN_OPS + A.DENSE_MLP_OPS + A.MOE_MLP_OPS + (A.LAYER_OP,) + A.FIRST_OPS
                               + A.LAST_OPS))


def rollup_target(op: str, vocab: tuple) -> str:
    """Nearest ancestor of `op` (itself included) in `vocab`, by dotted path; the op itself when none is."""
    parts = op.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in vocab:
            return cand
    return op


def rollup(rows: list[dict], vocab: tuple) -> list[dict]:
    """Fold sub-ops the estimator does not model into their nearest modelled ancestor: saved bytes (innermost
    attribution) add up; the ancestor's own peaks already include its children's, so they are kept as they are."""
    out: dict = {}
    for row in rows:
        target = rollup_target(row["op"], vocab)
        key = (target, row.get("layer"), row.get("microbatch"), row.get("iteration"))
        acc = out.setdefault(key, {"op": target, "layer": key[1], "microbatch": key[2], "iteration": key[3],
                                   "saved_bytes": 0, "fwd_peak_bytes": None, "bwd_peak_bytes": None})
        acc["saved_bytes"] += int(row.get("saved_bytes") or 0)
        if target == row["op"]:
            acc["fwd_peak_bytes"], acc["bwd_peak_bytes"] = row.get("fwd_peak_bytes"), row.get("bwd_peak_bytes")
    return list(out.values())


class DatasetError(ValueError):
    """A trace directory that cannot be used for fitting; the message names it."""


@dataclass
class RunInfo:
    path: str
    config: dict
    argv: list
    device: str
    backend: str
    versions: dict
    world_size: int
    iterations: int
    ranks: int
    peaks: list                      # measured peak bytes per rank (replay)


@dataclass
class Sample:
    run: str                         # trace directory
    op: str
    per: str                         # "layer" | "model"
    point: dict                      # variable -> Fraction
    switches: dict
    values: dict                     # metric -> int | None (None: the op has no such measurement)
    n_rows: int = 0
    spread: dict = field(default_factory=dict)   # metric -> (min, max) over the reduced rows


def point_of(config: dict) -> dict:
    """FORMATS 4 variables of a config as exact rationals (the estimator's own definition), the per-stage P, Pmax
    and L included (the fit grids have one pipeline stage, so every rank of a run shares them)."""
    return {k: Fraction(v) for k, v in config_variables(config).complete().items()}


def reduce_values(values: list[int], peak: bool = False) -> int | None:
    """The strict-majority value; without one, saved bytes take the low median and peaks the maximum (a
    transient that differs between layers must be covered on every layer)."""
    if not values:
        return None
    value, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return value
    return max(values) if peak else statistics.median_low(values)


def expand_dirs(paths: list[str]) -> list[str]:
    """Run directories (holding rank*.json/rank*.trace[.xz|.gz]), also found one level below a given directory."""
    out = []
    for p in paths:
        if not os.path.isdir(p):
            raise DatasetError(f"{p}: not a directory")
        if _is_run(p):
            out.append(p)
            continue
        # `.partial` directories are campaign runs still in progress (or interrupted): never fit those.
        subs = sorted(os.path.join(p, d) for d in os.listdir(p)
                      if not d.endswith(".partial") and _is_run(os.path.join(p, d)))
        if not subs:
            raise DatasetError(f"{p}: no rank<R>.trace files here or in its subdirectories")
        out.extend(subs)
    return out


def _is_run(path: str) -> bool:
    """Holds rank<R>.trace files, or their packed form rank<R>.trace.xz / .trace.gz (fit/traces/)."""
    from tracer.trace_reader import TRACE_SUFFIXES
    return os.path.isdir(path) and any(f.startswith("rank") and f.endswith(TRACE_SUFFIXES) for f in os.listdir(path))


def load_run(path: str, raw_ops: bool = False) -> tuple[RunInfo, list[Sample]]:
    from tracer.parse import parse_run  # the fitter reads parsed traces; imported late so basis/solve stay light
    try:
        ranks = parse_run(path)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot parse: {exc}") from None
    if not ranks:
        raise DatasetError(f"{path}: no ranks")
    hdr = ranks[0].header or {}
    cfg = hdr.get("config")
    if not isinstance(cfg, dict):
        raise DatasetError(f"{path}: rank header has no 'config' (not written by the profiler?)")
    info = RunInfo(path=path, config=cfg, argv=list(hdr.get("argv", [])), device=str(hdr.get("device", "?")),
                   backend=str(hdr.get("backend", "?")), versions=dict(hdr.get("versions", {})),
                   world_size=int(hdr.get("world_size", len(ranks))), iterations=int(hdr.get("iterations", 0)),
                   ranks=len(ranks), peaks=[int(r.peak_bytes) for r in ranks])
    return info, samples_of(path, cfg, ranks, None if raw_ops else estimator_ops())


def samples_of(path: str, cfg: dict, ranks: list, vocab: tuple | None = None) -> list[Sample]:
    """Samples of one run; with `vocab`, sub-ops are first rolled up into the estimator's ops (per rank)."""
    rows = [row for r in ranks for row in (rollup(r.op_stats, vocab) if vocab else r.op_stats)]
    if any((row.get("iteration") or 0) >= 1 for row in rows):
        rows = [row for row in rows if (row.get("iteration") or 0) >= 1]
    by_op: dict[str, list[dict]] = {}
    for row in rows:
        by_op.setdefault(row["op"], []).append(row)
    point, sw = point_of(cfg), config_switches(cfg)
    out = []
    for op, oprows in sorted(by_op.items()):
        vals, spread = {}, {}
        for m in METRICS:
            xs = [int(r[f"{m}_bytes"]) for r in oprows if r.get(f"{m}_bytes") is not None]
            vals[m] = reduce_values(xs, peak=m != "saved")
            if xs:
                spread[m] = (min(xs), max(xs))
        per = "layer" if any(r.get("layer") is not None for r in oprows) else "model"
        out.append(Sample(path, op, per, point, sw, vals, len(oprows), spread))
    optim = optimizer_transients(ranks)
    if optim:
        out.append(Sample(path, OPTIMIZER_OP, "model", point, sw,
                          {"saved": 0, "fwd_peak": reduce_values(optim, peak=True), "bwd_peak": None}, len(optim),
                          {"fwd_peak": (min(optim), max(optim))}))
    return out


def optimizer_transients(ranks: list) -> list[int]:
    """Peak above entry of each `optim` scope after the first iteration, over all ranks."""
    from tracer.parse import K_ITER, K_OPTIM, inherit, range_max
    out = []
    for r in ranks:
        sc = r.scopes
        if len(sc.open) == 0:
            continue
        it_row = inherit(sc, sc.kind == K_ITER)
        rows = [i for i in range(len(sc.open)) if sc.kind[i] == K_OPTIM]
        iters = {i: _iter_no(r, int(it_row[i])) for i in rows}
        if any(v >= 1 for v in iters.values()):
            rows = [i for i in rows if iters[i] >= 1]
        if not rows:
            continue
        idx = np.array(rows)
        peak = range_max(r.live, sc.open[idx], sc.close[idx]) - r.live[sc.open[idx]]
        out.extend(int(x) for x in peak)
    return out


def _iter_no(r, row: int) -> int:
    if row < 0:
        return -1
    name = r.scope_name(row)
    return int(name.split(":", 1)[1]) if name.startswith("iter:") and name[5:].isdigit() else -1


def load(paths: list[str], raw_ops: bool = False) -> tuple[list[RunInfo], list[Sample]]:
    runs, samples = [], []
    for p in expand_dirs(paths):
        info, s = load_run(p, raw_ops)
        runs.append(info)
        samples.extend(s)
    return runs, samples
