"""Stand-in fidelity: each committed GPU trace against its CPU twin (the same flags on CPU with the kernel stand-ins).

    python benchmarks/standin_fidelity.py [DIR] [--only CONFIG ...] [--out RUNS] [--json OUT] [--timeout S]

DIR (default fit/traces/gpu_h100): packed GPU campaign traces. For every config, the same command line is profiled
on this machine (`python -m tracer.profile --cpu --gpu-kernels`, traces cached under RUNS/<config>, default
runs/standin_fidelity; a cached run with the same command line is reused) and the two traces are compared:

  * GPU: the traced peak less the torch cuBLAS workspaces live at that peak (allocations of exactly the workspace
    size, estimator.gpu_runtime: GPU-only memory that no CPU run has);
  * CPU: the twin's traced peak.

Equal up to the stand-ins' remaining differences (docs/STANDINS.md) and the kernels' own transients. The kernel
families each run recorded must agree, else the row says so. This is what makes CPU-traced formulas usable for GPU
configs: it measures the CPU side of the claim against real GPU traces, config by config.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.accuracy import BenchError, cached, profile   # noqa: E402
from benchmarks.gpu_traces import DEFAULT_DIR, bad_selection, configs   # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "runs", "standin_fidelity")
MiB = float(1 << 20)
ITERATIONS = 3


def _iteration(path) -> int | None:
    return next((int(x.split(":")[1]) for x in path if x.startswith("iter:")), None)


def workspace_bytes_at_peak(pr, hopper: bool = True) -> int:
    """Bytes of cuBLAS workspaces live at the trace's peak: allocations of exactly the workspace size, made in an
    earlier iteration than the peak's (an activation of that size made then is freed by then; a workspace is
    kept for the rest of the run)."""
    from estimator.gpu_runtime import cublas_workspace_bytes
    size = cublas_workspace_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG"), hopper)
    a, at = pr.allocs, pr.peak_index
    peak_iter = _iteration(pr.peak_scope_path) if pr.peak_scope_path else None
    n = 0
    for i in range(len(a["idx"])):
        if a["size"][i] != size or a["idx"][i] > at or 0 <= a["free"][i] <= at:
            continue
        it = _iteration(pr.scope_path(a["scope"][i]))
        if peak_iter is None or it is None or it < peak_iter:
            n += 1
    return n * size


def compare(gpu_dir: str, cpu_dir: str) -> dict:
    from tracer.parse import parse_run
    (g,) = parse_run(gpu_dir)
    (c,) = parse_run(cpu_dir)
    ws = workspace_bytes_at_peak(g, "H100" in str(g.header.get("device")) or "H200" in str(g.header.get("device")))
    gpu_less = g.peak_bytes - ws
    return {"gpu_peak_bytes": g.peak_bytes, "gpu_workspace_bytes": ws, "gpu_less_workspace_bytes": gpu_less,
            "cpu_peak_bytes": c.peak_bytes, "error_percent": 100.0 * (c.peak_bytes / gpu_less - 1.0),
            "gpu_phase": g.peak_phase, "cpu_phase": c.peak_phase,
            # the families the GPU run recorded (a trace from before a family was recorded lacks it)
            "kernels_agree": all((c.header.get("kernels") or {}).get(k) == v
                                 for k, v in (g.header.get("kernels") or {}).items()),
            "gpu_kernels": g.header.get("kernels"), "cpu_kernels": c.header.get("kernels")}


def run(root: str, out: str, only: list[str] | None, timeout: float, iterations: int = ITERATIONS) -> list[dict]:
    rows = []
    os.makedirs(out, exist_ok=True)
    for name in (only or configs(root)):
        with open(os.path.join(root, name, "campaign.json"), encoding="utf-8") as fh:
            camp = json.load(fh)
        cfg = {"name": name, "argv": camp["argv"], "launcher": ["--gpu-kernels", *camp.get("launcher", [])],
               "nproc": 1}
        run_dir = os.path.join(out, name)
        try:
            if not cached(run_dir, cfg, iterations):
                profile(cfg, out, iterations, timeout)
        except BenchError as e:
            rows.append({"config": name, "error": str(e)})
            print(f"{name}: {e}", file=sys.stderr)
            continue
        rows.append({"config": name, **compare(os.path.join(root, name), run_dir)})
        r = rows[-1]
        print(f"{name:42s} GPU {r['gpu_less_workspace_bytes'] / MiB:9.1f} MiB (+{r['gpu_workspace_bytes'] / MiB:.0f} "
              f"workspaces)  CPU twin {r['cpu_peak_bytes'] / MiB:9.1f} MiB  {r['error_percent']:+7.3f}%"
              + ("" if r["kernels_agree"] else "  kernels differ")
              + ("" if r["gpu_phase"] == r["cpu_phase"] else f"  peak at {r['gpu_phase']!r} vs {r['cpu_phase']!r}"),
              flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return "no config compared"
    e = [r["error_percent"] for r in ok]
    return (f"{len(ok)} configs: CPU twin vs GPU peak (less cuBLAS workspaces) median {statistics.median(e):+.3f}%, "
            f"range {min(e):+.3f}%..{max(e):+.3f}%, {sum(abs(x) <= 0.1 for x in e)} within 0.1%, "
            f"{sum(abs(x) <= 1 for x in e)} within 1%; kernels differ in {sum(not r['kernels_agree'] for r in ok)}; "
            f"peak phase differs in {sum(r['gpu_phase'] != r['cpu_phase'] for r in ok)}; "
            f"{len(rows) - len(ok)} not run")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/standin_fidelity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=DEFAULT_DIR, help="packed GPU campaign traces")
    ap.add_argument("--only", nargs="+", metavar="CONFIG")
    ap.add_argument("--out", default=DEFAULT_OUT, help="CPU twin traces (cache)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per CPU run (default 900)")
    ap.add_argument("--iterations", type=int, default=ITERATIONS,
                    help=f"CPU twin iterations (default {ITERATIONS}, as the GPU runs; 2 reach a peak in the second)")
    args = ap.parse_args(argv)
    if args.iterations < 2:
        ap.error("--iterations must be >= 2 (the first iteration's peak includes one-time allocations)")
    problem = bad_selection(args.dir, args.only)
    if problem:
        print(f"benchmarks/standin_fidelity.py: {problem}", file=sys.stderr)
        return 2
    rows = run(args.dir, args.out, args.only, args.timeout, args.iterations)
    print(summary(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"dir": os.path.abspath(args.dir), "rows": rows}, fh, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
