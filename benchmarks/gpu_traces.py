"""Predicted vs GPU-traced memory: how well formula sets predict the committed GPU campaign's traces.

    python benchmarks/gpu_traces.py [DIR] [--formulas SET ...] [--json OUT]

DIR (default fit/traces/gpu_h100): packed GPU campaign traces (python -m fit.gpu_campaign), one directory per config
with campaign.json (the flags) and rank0.json (the header: kernels run, `allocator_peak_bytes`). For every config
and every formula set (default: cpu_compose, measured on CPU stand-ins and never fitted on a GPU trace, so every
row is held out; add gpu_h100 to see the GPU set's residuals on its own traces):

  * peak: the estimator's rank-0 peak on the same flags with the kernels the run recorded, minus the GPU runtime
    items a trace under the tracing allocator cannot contain: the caching allocator's 512-byte block rounding (the
    pluggable allocator is handed the requested sizes) and, when the campaign ran without Transformer Engine (its
    summary.json says so; the stand-ins then use torch's GEMMs), TE's GEMM workspace. Against the traced peak.
  * saved: activation bytes saved for backward in one microbatch of the last iteration, summed over the ops the
    parser attributes (tracer.parse op_stats) vs the set's per-op formulas: the stand-ins' fidelity, op by op.

The traced peak is the tracing allocator's exact counter; it is not torch.cuda.max_memory_allocated() (that needs
python -m fit.gpu_validate on a GPU).
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

from estimator.gpu_runtime import TE_ITEMS  # noqa: E402
from fit.dataset import header_kernels  # noqa: E402

DEFAULT_DIR = os.path.join(ROOT, "fit", "traces", "gpu_h100")
MiB = float(1 << 20)
NOT_TRACEABLE = ("512-byte block rounding",)        # the caching allocator's, not in a pluggable-allocator trace
TE_ONLY = TE_ITEMS        # allocated by Transformer Engine itself, not by its stand-ins (a campaign without TE)


def configs(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "rank0.json")))


def bad_selection(root: str, only: list[str] | None) -> str | None:
    """Why DIR / --only cannot be used (one line), or None."""
    if not os.path.isdir(root) or not configs(root):
        return f"{root}: no packed traces (rank0.json) in it"
    missing = sorted(set(only or ()) - set(configs(root)))
    return f"--only: not in {root}: {', '.join(missing)}" if missing else None


def campaign_had_te(root: str) -> bool:
    try:
        with open(os.path.join(root, "summary.json"), encoding="utf-8") as fh:
            install = json.load(fh).get("install") or {}
    except OSError:
        return True   # unknown: keep TE's workspace (errs high)
    return bool(install.get("transformer_engine"))


def predicted_peak(argv: list[str], kernels: dict, formulas: str, te: bool) -> tuple[int, int]:
    """(rank-0 peak as a trace would hold it, bytes of GPU runtime items taken out)."""
    from estimator import cli
    from estimator import report as R
    # Without TE the campaign's optimizer was torch's AdamW (--torch-adam), and its stand-ins allocate no TE workspace.
    doc = R.to_json(cli.build_report(["--nproc_per_node", "1"] + argv + ([] if te else ["--torch-adam"]),
                                     formulas=formulas, device="cuda", kernels=kernels))
    drop = NOT_TRACEABLE + (() if te else TE_ONLY)
    out = sum(i["bytes"] for s in doc["stages"][:1] for i in s.get("gpu_runtime", []) if i["name"] in drop)
    return doc["ranks"][0]["peak_bytes"] - out, out


def saved_bytes(pr, argv: list[str], kernels: dict, formulas: str) -> tuple[int, float]:
    """(measured, predicted) activation bytes saved in microbatch 0 of the last iteration, over the ops the
    parser attributes (`pr`: the run's tracer.parse.ParsedRank)."""
    from estimator import formulas as F
    from estimator.args import parse_args
    cfg = parse_args(["--nproc_per_node", "1"] + argv)
    cfg.kernels = dict(kernels)
    fset = F.load(formulas)
    last = max(r["iteration"] for r in pr.op_stats)
    meas = pred = 0.0
    for r in pr.op_stats:
        if r["iteration"] != last or r["microbatch"] != 0:
            continue
        op = r["op"] if r["layer"] is None else r["op"].replace(f"layers.{r['layer']}.", "layers.*.")
        meas += r["saved_bytes"]
        pred += F.evaluate(fset, op, cfg)[0]
    return int(meas), pred


def run(root: str, sets: list[str], only: list[str] | None = None) -> list[dict]:
    from tracer.parse import parse_run
    te = campaign_had_te(root)
    rows = []
    for name in (only or configs(root)):
        d = os.path.join(root, name)
        with open(os.path.join(d, "campaign.json"), encoding="utf-8") as fh:
            argv = json.load(fh)["argv"]
        with open(os.path.join(d, "rank0.json"), encoding="utf-8") as fh:
            head = json.load(fh)
        (pr,) = parse_run(d)    # once per config, for every set
        # what the run ran, as the fit reads it: its recorded families, and the fused bias-dropout-add and NCCL's
        # collectives of a GPU run that recorded neither
        kernels = header_kernels(head)
        row = {"config": name, "device": head.get("device"), "kernels": kernels,
               "traced_peak_bytes": head["allocator_peak_bytes"], "sets": {}}
        for fs in sets:
            peak, dropped = predicted_peak(argv, kernels, fs, te)
            ms, ps = saved_bytes(pr, argv, kernels, fs)
            row["sets"][fs] = {"predicted_peak_bytes": peak, "gpu_runtime_left_out_bytes": dropped,
                               "peak_error_percent": 100.0 * (peak / head["allocator_peak_bytes"] - 1.0),
                               "saved_measured_bytes": ms, "saved_predicted_bytes": int(round(ps)),
                               "saved_error_percent": 100.0 * (ps / ms - 1.0) if ms else 0.0}
        rows.append(row)
    return rows


def report(rows: list[dict], sets: list[str]) -> list[str]:
    head = f"{'config':40s} {'traced MiB':>10s}" + "".join(f" | {s[:14]:>14s} peak  saved" for s in sets)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['config']:40s} {r['traced_peak_bytes'] / MiB:10.1f}"
        for s in sets:
            x = r["sets"][s]
            line += f" | {x['predicted_peak_bytes'] / MiB:10.1f} {x['peak_error_percent']:+6.2f}% {x['saved_error_percent']:+6.2f}%"
        lines.append(line)
    for s in sets:
        pe = [r["sets"][s]["peak_error_percent"] for r in rows]
        se = [r["sets"][s]["saved_error_percent"] for r in rows]
        lines.append(f"{s}: peak error median {statistics.median(pe):+.2f}% (|error| median "
                     f"{statistics.median(abs(e) for e in pe):.2f}%), range {min(pe):+.2f}%..{max(pe):+.2f}%, "
                     f"{sum(abs(e) <= 1 for e in pe)}/{len(pe)} within 1%, {sum(abs(e) <= 2 for e in pe)}/{len(pe)} "
                     f"within 2%; saved bytes range {min(se):+.2f}%..{max(se):+.2f}%, "
                     f"{sum(abs(e) <= 1 for e in se)}/{len(se)} within 1%")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_traces.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=DEFAULT_DIR, help="packed GPU campaign traces")
    ap.add_argument("--formulas", nargs="+", default=["cpu_compose"], help="formula sets (names or files)")
    ap.add_argument("--only", nargs="+", metavar="CONFIG", help="only these configs (e.g. those a fit held out)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    problem = bad_selection(args.dir, args.only)
    if problem:
        print(f"benchmarks/gpu_traces.py: {problem}", file=sys.stderr)
        return 2
    rows = run(args.dir, args.formulas, args.only)
    print("\n".join(report(rows, args.formulas)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"dir": os.path.abspath(args.dir), "sets": args.formulas, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
