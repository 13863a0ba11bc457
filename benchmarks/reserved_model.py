"""Reserved-memory model: the estimator's synthesized allocation stream against the real one, on packed CPU traces.

    python benchmarks/reserved_model.py [--only NAME ...] [--limit N] [--runs DIR ...] [--scale K ...]
                                        [--conf CONF ...] [--json FILE]

For every run under fit/traces/cpu_compose (real megatron-core runs on CPU, their full allocation stream traced)
and every rank: the real stream (tracer.reserved.allocation_events) and the estimator's stream for the same
config and pipeline stage (estimator.alloc_stream, with the `cpu_compose` formula set; `--set modelled --packed
fit/traces/cpu_local` checks the per-op path on those runs) are both replayed through
the caching-allocator model (estimator.caching_allocator), under each allocator setting (--conf; default: the
default settings and expandable_segments:True). Printed per run: allocated peak and modelled reserved peak of
each stream and the error of the synthesized reserved against the real stream's. `--runs DIR ...` compares other
traced runs instead (any directory of rank<R>.trace files with their headers, e.g. the pipeline-parallel configs
`python benchmarks/accuracy.py --only l4_pp2_1f1b_m4 l4_tp2_pp2_sp_selective l4_pp2_vpp2_m4` profiles into
runs/accuracy/: the packed runs are all single-stage with one microbatch).

The traced models are tiny (kilobyte tensors: everything lands in 2 MiB small-pool segments), so each stream is
also replayed with every tensor of 4 KiB or more multiplied by K (--scale, default 1 and 4096; smaller ones are
scalars and counters that do not grow with a model): the same tensors and order at GPU scale, which is where the
large pool's rules (20 MiB segments, the split threshold, best fit across segments) decide fragmentation. This
validates the stream synthesis against real streams; benchmarks/gpu_validation.py checks the allocator model and
the synthesized stream against H100 runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from estimator.alloc_stream import stage_stream_events  # noqa: E402
from estimator.args import parse_args  # noqa: E402
from estimator.caching_allocator import parse_alloc_conf, replay  # noqa: E402
from estimator.memory import estimate  # noqa: E402
from fit.dataset import header_kernels  # noqa: E402
from tracer.parse import parse_run  # noqa: E402
from tracer.reserved import allocation_events  # noqa: E402

PACKED = os.path.join(ROOT, "fit", "traces", "cpu_compose")
SET = "cpu_compose"
MiB = float(1 << 20)


SCALE_FROM = 4096   # bytes: smaller tensors (scalars, loss and step counters, index lists) do not grow with a model


def scaled(events: list, k: int) -> list:
    """Every tensor of at least SCALE_FROM bytes k times larger."""
    if k == 1:
        return events
    return [(e[0], e[1], e[2] * k if e[2] >= SCALE_FROM else e[2]) if e[0] == "a" else e for e in events]


def run_config(path: str) -> tuple:
    with open(os.path.join(path, "rank0.json"), encoding="utf-8") as fh:
        hdr = json.load(fh)
    argv = hdr["argv"]
    if isinstance(argv, str):   # older headers keep the list's repr
        import ast
        argv = ast.literal_eval(argv)
    cfg = parse_args(["--nproc_per_node", str(hdr["world_size"])] + list(argv))
    cfg.kernels = header_kernels(hdr)   # the kernels the CPU run had
    if hdr.get("routing") == "balanced":
        cfg.moe_imbalance = 1.0         # exactly balanced MoE routing (tracer/moe_routing.py): no bound to add
    return cfg, hdr


def compare(name: str, scales, confs, fset: str = SET, packed: str = PACKED) -> list:
    """One row per (rank, scale, setting): real and synthesized allocated / reserved peaks. name: a packed run, or
    the path of a run directory."""
    path = name if os.path.isdir(name) else os.path.join(packed, name)
    name = os.path.basename(os.path.normpath(path))
    cfg, hdr = run_config(path)
    est = estimate(cfg, fset, device="cpu")   # a CPU trace: no GPU runtime buffers
    synth = {}
    rows = []
    for pr in parse_run(path):
        stage = int((pr.header.get("coords") or {}).get("pp", 0))
        if stage not in synth:
            synth[stage] = stage_stream_events(cfg, fset, est, stage, hdr.get("iterations", 2))   # as the run
        real = allocation_events(pr)
        for k in scales:
            for label, conf in confs:
                a = replay(scaled(real, k), conf)
                b = replay(scaled(synth[stage], k), conf)
                rows.append({"run": name, "rank": pr.rank, "pp_rank": stage, "scale": k, "conf": label,
                             "real_allocated_bytes": a["peak_allocated_bytes"],
                             "real_reserved_bytes": a["peak_reserved_bytes"],
                             "synth_allocated_bytes": b["peak_allocated_bytes"],
                             "synth_reserved_bytes": b["peak_reserved_bytes"],
                             "real_events": len(real), "synth_events": len(synth[stage])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these runs (directory names)")
    ap.add_argument("--limit", type=int, help="only the first N runs (sorted by name)")
    ap.add_argument("--runs", nargs="+", metavar="DIR", help="traced run directories instead of the packed runs")
    ap.add_argument("--set", default=SET, help=f"formula set of the estimate (default {SET})")
    ap.add_argument("--packed", default=PACKED, help="directory of packed runs (default fit/traces/cpu_compose; "
                    "fit/traces/cpu_local with --set modelled checks the per-op path)")
    ap.add_argument("--scale", type=int, nargs="+", default=[1, 4096], help="size multipliers (default 1 4096)")
    ap.add_argument("--conf", nargs="+", default=["", "expandable_segments:True"],
                    help="PYTORCH_CUDA_ALLOC_CONF settings to replay under ('' = defaults)")
    ap.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    a = ap.parse_args(argv)
    names = a.runs or a.only or sorted(d for d in os.listdir(a.packed) if os.path.isdir(os.path.join(a.packed, d)))
    if a.limit:
        names = names[:a.limit]
    confs = [(c or "default", parse_alloc_conf(c)) for c in a.conf]
    t0 = time.time()
    rows = []
    print(f"{'run':<34} {'rank':>4} {'scale':>5} {'setting':<26} {'alloc real':>11} {'alloc synth':>11} "
          f"{'rsv real':>10} {'rsv synth':>10} {'rsv err':>8}   (MiB at scale)")
    for name in names:
        for r in compare(name, a.scale, confs, a.set, a.packed):
            rows.append(r)
            err = 100.0 * (r["synth_reserved_bytes"] - r["real_reserved_bytes"]) / r["real_reserved_bytes"]
            r["reserved_error_percent"] = err
            print(f"{r['run']:<34} {r['rank']:>4} {r['scale']:>5} {r['conf']:<26} "
                  f"{r['real_allocated_bytes'] / MiB:>11.2f} {r['synth_allocated_bytes'] / MiB:>11.2f} "
                  f"{r['real_reserved_bytes'] / MiB:>10.2f} {r['synth_reserved_bytes'] / MiB:>10.2f} {err:>+7.2f}%")
    print()
    print("summary: synthesized vs real stream's modelled reserved peak, per scale and setting (error %: median, "
          "mean |error|, worst over, worst under; overhead = reserved / allocated - 1, real vs synth)")
    for k in a.scale:
        for label, _ in confs:
            sel = [r for r in rows if r["scale"] == k and r["conf"] == label]
            if not sel:
                continue
            errs = [r["reserved_error_percent"] for r in sel]
            ov_r = statistics.mean(r["real_reserved_bytes"] / r["real_allocated_bytes"] - 1 for r in sel)
            ov_s = statistics.mean(r["synth_reserved_bytes"] / r["synth_allocated_bytes"] - 1 for r in sel)
            exact = sum(1 for e in errs if e == 0)
            print(f"  scale {k:>5} {label:<26} ranks {len(sel):>4}: median {statistics.median(errs):+.2f}%  "
                  f"mean|err| {statistics.mean(map(abs, errs)):.2f}%  max {max(errs):+.2f}%  min {min(errs):+.2f}%  "
                  f"equal {exact}/{len(sel)}  overhead real {100 * ov_r:.1f}% synth {100 * ov_s:.1f}%")
    print(f"\n{len(names)} runs in {time.time() - t0:.1f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
