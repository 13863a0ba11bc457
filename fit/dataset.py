"""Parsed traces -> fit samples: one value per (run, op, metric), with the run's variables and switches.

Per op, rows of every rank, layer, microbatch and iteration >= 1 (iteration 0 is warm-up: lazily created
buffers, first-step optimizer state) are reduced to their mode when it is a strict majority, else the low median
(saved bytes) or, for transient peaks, the value more rows show than any other, else the maximum, so the sample is
always a byte count that really occurred. The optimizer step's transient (peak above the level
at `optim` entry) becomes the model-level op `optimizer`.
The layer's transients are also measured per allocation point (layer_points), the loss head's backward too, and
what a layer's backward holds from before it becomes the model-level op `backward_held` (docs/FORMATS.md 4).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from estimator.formulas import CPU_KERNELS, collectives, switches as config_switches
from estimator.formulas import variables as config_variables

METRICS = ("saved", "fwd_peak", "bwd_peak")
OPTIMIZER_OP = "optimizer"
LAYER_OP = "layers.*"
HELD_OP = "backward_held"
HEAD_OP = "loss"   # carries the loss head's backward transient (final norm, output layer and loss backward)


def estimator_ops() -> tuple:
    """The op names the estimator composes a layer and a model from (its vocabulary, in its own module)."""
    from estimator import activations as A
    return tuple(dict.fromkeys(A.ATTN_OPS + A.DENSE_MLP_OPS + A.MOE_MLP_OPS + (A.LAYER_OP,) + A.FIRST_OPS
                               + A.LAST_OPS + A.DATA_FIRST_OPS + A.DATA_LAST_OPS + A.DATA_OPS))


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
    points: dict = field(default_factory=dict)   # metric -> (per-point values, local-maximum mask): layer op


def point_of(config: dict) -> dict:
    """FORMATS 4 variables of a config as exact rationals (the estimator's own definition), the per-stage P, Pmax
    and L included (the fit grids have one pipeline stage, so every rank of a run shares them)."""
    return {k: Fraction(v) for k, v in config_variables(config).complete().items()}


def reduce_values(values: list[int], peak: bool = False) -> int | None:
    """The strict-majority value; without one, saved bytes take the low median, and peaks the value more rows
    show than any other (a level a gloo thread shifts on one rank's layer by freeing a buffer late is not the
    layer's own), else their maximum (a transient that differs between layers must be covered on every layer)."""
    if not values:
        return None
    common = Counter(values).most_common(2)
    value, count = common[0]
    if count * 2 > len(values):
        return value
    if not peak:
        return statistics.median_low(values)
    return value if count > 1 and count > common[1][1] else max(values)


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


def parsed_run(path: str, accept_damaged: bool = False) -> tuple[list, dict, dict]:
    """(parsed ranks, rank 0's header, its config as the fit reads it) of one run directory; a run no fit can use
    is a DatasetError naming it. A damaged or truncated trace, or one of a run that did not end cleanly
    (Trace.problems), is refused unless `accept_damaged`: a formula fitted from part of a run is silently wrong."""
    import warnings
    from tracer.parse import parse_run  # the fitter reads parsed traces; imported late so basis/solve stay light
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the reader's truncation warnings: problems() below
            ranks = parse_run(path)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot parse: {exc}") from None
    if not ranks:
        raise DatasetError(f"{path}: no ranks")
    for r in ranks:
        for problem in r.trace.problems():
            if not accept_damaged:
                raise DatasetError(f"{path}: rank {r.rank}: {problem}; refusing to fit it (--accept-damaged "
                                   f"fits it anyway)")
            print(f"warning: {path}: rank {r.rank}: {problem}", file=sys.stderr)
    hdr = ranks[0].header or {}
    cfg = hdr.get("config")
    if not isinstance(cfg, dict):
        raise DatasetError(f"{path}: rank header has no 'config' (not written by the profiler?)")
    skipped = max(int((r.header or {}).get("skipped_iterations") or 0) for r in ranks)
    if skipped:
        # fp16's loss scaler skips the step of an iteration whose gradients overflow: the optimizer state is then
        # made later or never, so the trace's step and static memory are not those of training
        raise DatasetError(f"{path}: the loss scaler skipped {skipped} of its optimizer steps (fp16 gradients "
                           f"overflowed at --initial-loss-scale); profile with a lower --initial-loss-scale")
    if "attention_softmax_in_fp32" not in cfg:
        # Traced before the harness read --attention-softmax-in-fp32: it ran megatron-core's default, the softmax
        # in fp32 (the switch softmax_fp32 then holds whatever the dtype).
        cfg = {**cfg, "attention_softmax_in_fp32": True}
    cfg = {**cfg, "kernels": header_kernels(hdr)}
    if cfg.get("num_experts") and hdr.get("routing") != "balanced":
        raise DatasetError(f"{path}: an MoE run traced without --balanced-routing: its expert buffers follow the "
                           f"router's data-dependent choices, which no formula of the shapes fits; profile it again "
                           f"with python -m tracer.profile --balanced-routing")
    return ranks, hdr, cfg


def traced_ranks(path: str) -> list:
    """The ranks a run traced: all of its world, or those a fake-world run picked (tracer/fake_world.py)."""
    return sorted(int(f[4:-5]) for f in os.listdir(path)
                  if f.startswith("rank") and f.endswith(".json") and f[4:-5].isdigit())


def run_argv(path: str) -> tuple[list, dict]:
    """(argv, header of its lowest traced rank: rank 0 but where a fake-world run traced others only) of a traced
    run directory: the flags of its campaign.json (the command line as the campaign launched it) where it has one,
    else those its header recorded."""
    import json
    ranks = traced_ranks(path)
    with open(os.path.join(path, f"rank{ranks[0] if ranks else 0}.json"), encoding="utf-8") as fh:
        hdr = json.load(fh)
    argv = hdr["argv"]
    if os.path.isfile(os.path.join(path, "campaign.json")):
        with open(os.path.join(path, "campaign.json"), encoding="utf-8") as fh:
            argv = json.load(fh)["argv"]
    return argv, hdr


def traced_config(path: str) -> tuple:
    """(estimator config, rank-0 header, argv) of a traced run directory: its flags (run_argv) on its world size,
    with the kernel families it ran."""
    from estimator.args import parse_args
    argv, hdr = run_argv(path)
    cfg = parse_args(["--nproc_per_node", str(hdr.get("world_size", 1))] + argv)
    cfg.kernels = header_kernels(hdr)
    return cfg, hdr, argv


def predicted_and_measured(path: str, fset) -> list:
    """[(rank, pipeline stage, predicted peak, the run's own allocator peak)] per traced rank of a run: the estimator
    on the run's own flags and kernels (traced_config; device "cpu": no GPU runtime buffers), a rank
    predicted by its pipeline stage's estimate."""
    from estimator.memory import estimate
    cfg, hdr, _ = traced_config(path)
    if hdr.get("routing") == "balanced":
        cfg.moe_imbalance = 1.0     # the run's routing was exactly balanced (tracer/moe_routing.py): no bound to add
    rows = []
    for r in traced_ranks(path):
        with open(os.path.join(path, f"rank{r}.json"), encoding="utf-8") as fh:
            h = json.load(fh)
        rows.append((r, int((h.get("coords") or {}).get("pp", 0)), h["allocator_peak_bytes"]))
    est = estimate(cfg, fset, device="cpu")
    return [(r, p, est.ranks[p].peak_bytes, m) for r, p, m in rows]


def header_kernels(hdr: dict) -> dict:
    """The kernel families a run had (tracer.standins), from its header; traced before they were recorded: the
    CPU kernels (estimator.formulas.CPU_KERNELS)."""
    kern = hdr.get("kernels")
    out = {**CPU_KERNELS, **kern} if isinstance(kern, dict) else dict(CPU_KERNELS)
    if "fuse_bda" not in (kern or {}):
        # traced before the fused bias-dropout-add was recorded: a CPU run never fuses it (tracer.harness
        # CPU_OVERRIDES), a GPU run follows its flags
        cfg = hdr.get("config") or {}
        out["fuse_bda"] = hdr.get("backend") == "cuda" and bool(cfg.get("bias_dropout_fusion", True))
    if "collectives" not in (kern or {}):
        # recorded since the fake process group: the header's process group says it
        pg = hdr.get("process_group") or ("nccl" if hdr.get("backend") == "cuda" else "gloo")
        out["collectives"] = collectives(pg)
    if "torch_norm" not in (kern or {}):
        # recorded since its CPU stand-in: a GPU run of the local spec ran CUDA's norms
        out["torch_norm"] = "cuda" if hdr.get("backend") == "cuda" and out["spec"] == "local" else "cpu"
    return out


def load_run(path: str, raw_ops: bool = False, accept_damaged: bool = False) -> tuple[RunInfo, list[Sample]]:
    ranks, hdr, cfg = parsed_run(path, accept_damaged)
    info = RunInfo(path=path, config=cfg, argv=list(hdr.get("argv", [])), device=str(hdr.get("device", "?")),
                   backend=str(hdr.get("backend", "?")), versions=dict(hdr.get("versions", {})),
                   world_size=int(hdr.get("world_size", len(ranks))), iterations=int(hdr.get("iterations", 0)),
                   ranks=len(ranks), peaks=[int(r.peak_bytes) for r in ranks])
    return info, samples_of(path, cfg, ranks, None if raw_ops else estimator_ops())


def samples_of(path: str, cfg: dict, ranks: list, vocab: tuple | None = None) -> list[Sample]:
    """Samples of one run; with `vocab`, sub-ops are first rolled up into the estimator's ops (per rank).

    The layer op's transients are measured per point (layer_points): its fwd_peak / bwd_peak sample is the
    maximum over its points, and `points` keeps every point so that each can be fitted on its own."""
    rolled = [rollup(r.op_stats, vocab) if vocab else r.op_stats for r in ranks]
    rows = [row for rr in rolled for row in rr]
    later = any((row.get("iteration") or 0) >= 1 for row in rows)
    if later:
        rows = [row for row in rows if (row.get("iteration") or 0) >= 1]
    pts = [layer_points(r, rr) for r, rr in zip(ranks, rolled)] if vocab else []
    by_op: dict[str, list[dict]] = {}
    for row in rows:
        by_op.setdefault(row["op"], []).append(row)
    point, sw = point_of(cfg), config_switches(cfg)
    out = []
    for op, oprows in sorted(by_op.items()):
        vals, spread, points = {}, {}, {}
        for m in METRICS:
            xs = [int(r[f"{m}_bytes"]) for r in oprows if r.get(f"{m}_bytes") is not None]
            vals[m] = reduce_values(xs, peak=m != "saved")
            if xs:
                spread[m] = (min(xs), max(xs))
        if op == HEAD_OP and pts:
            vecs = [v for p in pts for key, v in p.get(HEAD_OP, {}).items() if key[2] >= 1 or not later]
            red = reduce_points([v for v in vecs if len(v[0])])
            if red is not None:
                points["bwd_peak"] = red
                vals["bwd_peak"] = max(red[0])
                spread["bwd_peak"] = (min(int(v.max()) for v, _ in vecs), max(int(v.max()) for v, _ in vecs))
        if op == LAYER_OP and pts:
            for m in ("fwd_peak", "bwd_peak"):
                vecs = [v[m] for p in pts for key, v in p.items() if key != HEAD_OP and m in v
                        and (key[2] >= 1 or not later)]
                red = reduce_points([v for v in vecs if len(v[0])])
                if red is not None:
                    points[m] = red
                    vals[m] = max(red[0])
                    spread[m] = (min(int(v.max()) for v, _ in vecs), max(int(v.max()) for v, _ in vecs))
                else:
                    vals[m] = None   # points that do not align: no sample in the old sense either
        per = "layer" if any(r.get("layer") is not None for r in oprows) else "model"
        out.append(Sample(path, op, per, point, sw, vals, len(oprows), spread, points))
    held = [v["held"] for p in pts for key, v in p.items() if key != HEAD_OP and "held" in v
            and (key[2] >= 1 or not later)]
    if held:
        out.append(Sample(path, HELD_OP, "model", point, sw,
                          {"saved": 0, "fwd_peak": 0, "bwd_peak": reduce_values(held, peak=True)}, len(held),
                          {"bwd_peak": (min(held), max(held))}))
    optim = optimizer_transients(ranks)
    if optim:
        out.append(Sample(path, OPTIMIZER_OP, "model", point, sw,
                          {"saved": 0, "fwd_peak": reduce_values(optim, peak=True), "bwd_peak": None}, len(optim),
                          {"fwd_peak": (min(optim), max(optim))}))
    return out


def malloc_levels(kind: np.ndarray, live: np.ndarray, o: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The live level right after each allocation inside records o..c, above the level at o, and whether it is
    a local maximum (the next allocation or free inside the range is a free, or there is none). A level that
    is not one is followed directly by another allocation, so it never sets the peak. Allocations, not local
    maxima, index the points: their number and order do not depend on the shapes, ties between levels do."""
    from tracer.trace_reader import FREE, MALLOC
    k = kind[o:c + 1]
    mem = np.flatnonzero((k == MALLOC) | (k == FREE))
    is_m = k[mem] == MALLOC
    levels = live[o + mem[is_m]] - live[o]
    nxt = np.append(is_m[1:], False)          # the event after each memory event is an allocation
    return levels.astype(np.int64), ~nxt[is_m]


def reduce_points(vecs: list) -> tuple | None:
    """Per-point reduction (reduce_values, as a peak) of equally long point vectors, and the union of their
    local-maximum masks; None when they differ in length (the allocation pattern is not the same on every
    layer / rank, so points cannot be matched)."""
    if not vecs or len({len(v) for v, _ in vecs}) != 1:
        return None
    n = len(vecs[0][0])
    vals = tuple(reduce_values([int(v[i]) for v, _ in vecs], peak=True) for i in range(n))
    mask = tuple(bool(any(mk[i] for _, mk in vecs)) for i in range(n))
    return vals, mask


def layer_points(r, rolled: list[dict]) -> dict:
    """Per (layer, microbatch, iteration) of one rank: the layer's forward and backward transients at each of
    their points (FORMATS 4, point formulas; malloc_levels), and the bytes held through its backward; under the
    key HEAD_OP, per (None, microbatch, iteration), the loss head's backward points.

    fwd_peak points: the level after each allocation inside the layer's forward scope, above its entry, minus
    the saved bytes of its sub-ops (the estimator composes a layer as its sub-ops in order, then the layer op, so
    the layer op's forward transient is measured above the level with those saved bytes live).
    bwd_peak points: the level after each allocation inside the layer's `bwdlayer:` scope above its entry, plus
    what the microbatch's backward allocated before it, is still live at its entry and is freed inside it (e.g. the
    activations a full recompute re-created just before the scope), minus the layer's own saved bytes already freed
    before it (its output, whose consumer's backward ran first): the level above the one with every saved byte of
    the layer and of the ops before it live, which is the baseline the estimator adds it to.
    held: what the microbatch's backward allocated before the layer and still holds after it (the hidden-state
    gradient passed down, a tied embedding's weight gradient from the output layer, loss scalars), fitted as the
    model-level op `backward_held`."""
    from tracer.parse import K_BWD, K_BWDLAYER, K_FWD, K_ITER, K_MOD, K_RECOMPUTE, _classify_name, inherit, saved_mask
    sc, a = r.scopes, r.allocs
    out: dict = {}
    if len(sc.open) == 0:
        return out
    num = lambda row: _classify_name(r.scope_name(int(row)))[1] if row >= 0 else None   # noqa: E731
    it_row = inherit(sc, sc.kind == K_ITER)
    mb_row = inherit(sc, (sc.kind == K_FWD) | (sc.kind == K_BWD))
    fwd_row = inherit(sc, sc.kind == K_FWD)
    rec_row = inherit(sc, sc.kind == K_RECOMPUTE)
    sub_saved: dict = {}
    for row in rolled:
        if row.get("layer") is not None and row["op"] != LAYER_OP:
            key = (row["layer"], row["microbatch"], row["iteration"])
            sub_saved[key] = sub_saved.get(key, 0) + int(row.get("saved_bytes") or 0)
    names = {}
    for i in np.flatnonzero((sc.kind == K_MOD) | (sc.kind == K_BWDLAYER)):
        kind, _, op, layer = _classify_name(r.scope_name(int(i)))
        if op == LAYER_OP:
            names[int(i)] = (kind, layer)
    keep = saved_mask(r)
    rec_kind = np.ascontiguousarray(r.trace.records["kind"])
    a_layer = np.full(len(a["idx"]), -1, np.int64)
    op_rows = a["op_row"]
    for row in np.unique(op_rows[keep & (op_rows >= 0)]):
        lay = _classify_name(r.scope_name(int(row)))[3]
        if lay is not None:
            a_layer[op_rows == row] = lay
    a_mb = np.array([-1 if fr < 0 else num(fr) for fr in a["fwd_row"]], np.int64) if len(a["idx"]) else a_layer
    # The loss head's backward: from the microbatch's backward start to its first layer's backward, above the
    # level at that start (every saved byte live): the estimator's head unit transient, given to the `loss` op
    # (the last op of the head, so the estimator composes it above the level with the head's saved bytes live).
    # Only where every backward runs the head (one pipeline stage, no virtual chunks).
    cfg = r.header.get("config") or {}
    if (cfg.get("pipeline_model_parallel_size") or 1) == 1 and any(row["op"] == HEAD_OP for row in rolled):
        first_layer: dict = {}
        for i, (kind, _) in names.items():
            if kind == K_BWDLAYER and mb_row[i] >= 0:
                first_layer[int(mb_row[i])] = min(first_layer.get(int(mb_row[i]), 1 << 62), int(sc.open[i]))
        head = out.setdefault(HEAD_OP, {})
        for b, stop in first_layer.items():
            o = int(sc.open[b])
            if stop > o + 1:
                head[(None, num(b), num(it_row[b]) if it_row[b] >= 0 else -1)] = malloc_levels(rec_kind, r.live, o, stop - 1)
    for i, (kind, layer) in names.items():
        o, c = int(sc.open[i]), int(sc.close[i])
        key = (layer, num(mb_row[i]), num(it_row[i]) if it_row[i] >= 0 else -1)
        if kind == K_MOD:
            if fwd_row[i] < 0 or rec_row[i] >= 0:
                continue
            sub = sub_saved.get(key, 0)
            lv, mk = malloc_levels(rec_kind, r.live, o, c)
            out.setdefault(key, {})["fwd_peak"] = (lv - sub, mk)
            continue
        if mb_row[i] < 0:
            continue
        start = int(sc.open[mb_row[i]])
        lo, hi = np.searchsorted(a["idx"], [start, o])
        live = a["free"][lo:hi] > o
        consumed = int(a["size"][lo:hi][live & (a["free"][lo:hi] <= c)].sum())
        held = int(a["size"][lo:hi][live & (a["free"][lo:hi] > c)].sum())
        freed = (a["free"] >= start) & (a["free"] < o) & keep & (a_layer == layer) & (a_mb == key[1])
        own = int(a["size"][freed].sum())
        d = out.setdefault(key, {})
        lv, mk = malloc_levels(rec_kind, r.live, o, c)
        d["bwd_peak"] = (lv + consumed - own, mk)
        d["held"] = held
    return out


def optimizer_transients(ranks: list) -> list[int]:
    """Peak above entry of each `optim` scope after the first iteration, over all ranks."""
    from tracer.parse import K_ITER, K_OPTIM, inherit, iteration_of, range_max
    out = []
    for r in ranks:
        sc = r.scopes
        if len(sc.open) == 0:
            continue
        it_row = inherit(sc, sc.kind == K_ITER)
        rows = [i for i in range(len(sc.open)) if sc.kind[i] == K_OPTIM]
        iters = {i: iteration_of(r, int(it_row[i])) for i in rows}
        if any(v >= 1 for v in iters.values()):
            rows = [i for i in rows if iters[i] >= 1]
        if not rows:
            continue
        idx = np.array(rows)
        peak = range_max(r.live, sc.open[idx], sc.close[idx]) - r.live[sc.open[idx]]
        out.extend(int(x) for x in peak)
    return out



def load(paths: list[str], raw_ops: bool = False, accept_damaged: bool = False) -> tuple[list[RunInfo], list[Sample]]:
    runs, samples = [], []
    for p in expand_dirs(paths):
        info, s = load_run(p, raw_ops, accept_damaged)
        runs.append(info)
        samples.extend(s)
    return runs, samples
