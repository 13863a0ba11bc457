#!/usr/bin/env python3
"""Stand-in programs against H100 programs, op by op: what each GPU kernel family's CPU stand-in allocates and frees
(tracer/standins.py), compared event by event with the program the H100 traces measured for the same op.

    python benchmarks/standin_programs.py [RUN_DIR ...] [--gpu-set SET] [--json OUT]

RUN_DIR (default: the one-process runs of fit/traces/cpu_gpu_kernels, Megatron-LM's default kernels on the
stand-ins): packed CPU runs. For every (phase, label) of each run, the GPU set's program (default gpu_h100: one H100
rank, no TP, SP or MoE) for the run's switches is evaluated at the run's own shapes and compared with the run's
representative program:

  * equal: the same allocations and frees in the same order, sizes to the byte (a free of another segment's tensor
    compared by the segment it names: the CPU's other segments may hold extra scalars that renumber them);
  * equal up to CPU casts: equal once megatron DDP's fp32 copies of 16-bit gradients are taken out (CPU's
    mixed-dtype add makes one, a GPU kernel none; docs/STANDINS.md);
  * equal up to row vectors: equal once a stand-in's vectors of one value per row (e bytes per token, freed in the
    op: the norms' per-row statistics and sums, which a GPU kernel keeps in registers) are taken out;
  * equal in 512-byte blocks: equal (up to CPU casts) once every size under 512 B is taken as the 512-byte block
    the caching allocator makes of it (a CUDA reduction's semaphores, which the stand-in requests as that block);
  * differs: anything else (the first differing event is shown);
  * not traced on GPU: the GPU set's runs lacked one of the run's switch values for that op (the H100 campaign had
    one rank: no TP, SP, MoE or pipeline stages), or the GPU set has no such op.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from itertools import zip_longest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_DIR = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels")
VERDICTS = ("equal", "equal up to CPU casts", "equal up to row vectors", "equal in 512-byte blocks", "differs",
            "not traced on GPU")


def default_runs() -> list[str]:
    return [os.path.join(DEFAULT_DIR, d) for d in sorted(os.listdir(DEFAULT_DIR)) if "_w1_" in d]


def _norm(events) -> list:
    """(op, bytes, ref) with a reference to another segment's tensor reduced to that segment."""
    return [(op, int(round(size)), ref if ref.startswith("#") or not ref else ref.split("#")[0])
            for op, size, ref in events]


def without_grad_casts(events: list) -> list:
    """A CPU program less DDP's fp32 copies of 16-bit gradients: `main_grad.add_(grad)` into an fp32 main_grad copies
    the gradient to fp32 on a CPU (an allocation twice the size of a gradient this segment made, freed at once),
    which a GPU kernel does not. Local references renumbered."""
    out, dropped, sizes, n, i = [], [], [], 0, 0
    while i < len(events):
        op, size, ref = events[i]
        if (op == "+" and size % 2 == 0 and size // 2 in sizes and i + 1 < len(events)
                and events[i + 1][:3] == ("-", size, f"#{n}")):
            dropped.append(n)
            sizes.append(None)
            n, i = n + 1, i + 2
            continue
        if op == "+":
            n += 1
            sizes.append(size)
        if ref.startswith("#"):
            k = int(ref[1:])
            ref = f"#{k - sum(d < k for d in dropped)}"
        out.append((op, size, ref))
        i += 1
    return out


def without_row_vectors(events: list, row_bytes: int, keep: int = 0) -> list:
    """A program less its allocations of `row_bytes` that it frees itself (and those frees), but for the first
    `keep` of them (the GPU program's own of that size: a weight's gradient may have it too). Local references
    renumbered."""
    dropped, n, seen = set(), 0, 0
    for op, size, ref in events:
        if op == "+":
            if size == row_bytes and ("-", size, f"#{n}") in events:
                seen += 1
                if seen > keep:
                    dropped.add(n)
            n += 1
    out, n = [], 0
    for op, size, ref in events:
        if op == "+":
            n += 1
            if n - 1 in dropped:
                continue
        if ref.startswith("#"):
            k = int(ref[1:])
            if k in dropped:
                continue
            ref = f"#{k - sum(d < k for d in dropped)}"
        out.append((op, size, ref))
    return out


def compare_run(run, gpu) -> dict:
    """(phase, label) -> (verdict, first differing (cpu, gpu) event or None) for one loaded run."""
    out = {}
    rows = _row_bytes(run.point)
    for (phase, label), prog in sorted(run.programs.items()):
        cells, measured = gpu.select(phase, label, run.switches)
        if not cells or not measured:
            out[(phase, label)] = ("not traced on GPU", None)
            continue
        mine = _norm((e.op, e.size, e.ref) for e in prog.events())
        theirs = [_norm(c.evaluated(run.point)) for c in cells]
        if mine in theirs:
            out[(phase, label)] = ("equal", None)
        elif without_grad_casts(mine) in theirs:
            out[(phase, label)] = ("equal up to CPU casts", None)
        elif any(without_grad_casts(without_row_vectors(mine, rows, _allocs(t, rows))) == t for t in theirs):
            out[(phase, label)] = ("equal up to row vectors", None)
        elif in_allocator_blocks(without_grad_casts(mine)) in [in_allocator_blocks(t) for t in theirs]:
            out[(phase, label)] = ("equal in 512-byte blocks", None)
        else:
            first = next((a, b) for a, b in zip_longest(mine, theirs[0]) if a != b)
            out[(phase, label)] = ("differs", first)
    return out


def in_allocator_blocks(events: list) -> list:
    """Sizes under 512 bytes as the one 512-byte block the caching allocator makes of any of them (a stand-in
    requests a CUDA reduction's semaphores, 4 bytes per 128 outputs rounded up, as that block)."""
    return [(op, max(n, 512), ref) for op, n, ref in events]


def _allocs(events: list, size: int) -> int:
    return sum(op == "+" and n == size for op, n, _ in events)


def _row_bytes(point) -> int:
    return int(round(point["e"] * point["s"] * point["b"] / point["st"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--gpu-set", default="gpu_h100")
    ap.add_argument("--json", help="write every verdict here")
    a = ap.parse_args(argv)
    from estimator import formulas as F
    from fit.dataset import DatasetError
    from fit.programs.build import load_runs
    try:
        runs = load_runs(a.runs or default_runs())
        gpu = F.load(a.gpu_set).programs
    except (DatasetError, F.FormulaError, OSError) as exc:
        print(f"standin_programs: {exc}", file=sys.stderr)
        return 2
    per_label: dict = defaultdict(Counter)
    example: dict = {}
    rows = []
    for run in runs:
        for (phase, label), (verdict, first) in compare_run(run, gpu).items():
            per_label[label][verdict] += 1
            if first is not None and label not in example:
                example[label] = (run.path, phase, first)
            rows.append({"run": run.path, "phase": phase, "label": label, "verdict": verdict,
                         "first_difference": first})
    print(f"{len(runs)} stand-in runs against {a.gpu_set}, per op (phases x runs)")
    print(f"{'op':58s} " + " ".join(f"{v:>22s}" for v in VERDICTS))
    for label in sorted(per_label):
        print(f"{label:58s} " + " ".join(f"{per_label[label][v]:22d}" for v in VERDICTS))
    total = sum(per_label.values(), Counter())
    print(f"{'all':58s} " + " ".join(f"{total[v]:22d}" for v in VERDICTS))
    for label, (path, phase, (cpu, gpu_ev)) in sorted(example.items()):
        print(f"differs: {label} {phase} ({os.path.basename(path)}): stand-in {cpu}, H100 {gpu_ev}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
