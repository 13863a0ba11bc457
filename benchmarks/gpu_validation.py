"""Predicted vs PyTorch's caching allocator on a GPU, from the committed validation runs (no GPU needed).

    python benchmarks/gpu_validation.py [DIR] [--formulas SET ...] [--json OUT]

DIR (default fit/validation/h100): what `python -m fit.gpu_validate --events` measured, one directory per held-out
config of fit/grids/gpu_validate.json: measured.json (torch.cuda.max_memory_allocated / max_memory_reserved of the
whole untraced process, setup included, as Megatron-LM logs them) and allocator_events.txt.xz (the caching
allocator's own request stream of that run, from torch.cuda.memory._snapshot). Two checks per config:

  * the allocator model: the real request stream replayed through estimator.caching_allocator; its allocated and
    reserved peaks against the measured ones (the model's rules alone, independent of any formula);
  * the estimate: get-training-info on the config's flags (--nproc_per_node 1, each --formulas set; default the
    estimator's default choice and gpu_h100), its allocated peak and modelled reserved peak against the measured ones;
    without Transformer Engine in the install, with --torch-adam and less TE's workspace (the stand-ins have none).
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

from estimator import cli  # noqa: E402
from estimator.report_json import json_text  # noqa: E402
from estimator.caching_allocator import replay  # noqa: E402
from fit.campaign import load_grid  # noqa: E402
from fit.gpu_validate import install_adjustments, predicted, read_events  # noqa: E402

DEFAULT_DIR = os.path.join(ROOT, "fit", "validation", "h100")
GRID = os.path.join(ROOT, "fit", "grids", "gpu_validate.json")
MiB = float(1 << 20)


def runs(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "measured.json")))


def allocator_check(run_dir: str) -> dict:
    """The real request stream through the allocator model: its peaks and the measured ones."""
    with open(os.path.join(run_dir, "measured.json"), encoding="utf-8") as fh:
        meas = json.load(fh)
    st = replay(read_events(os.path.join(run_dir, "allocator_events.txt.xz")))
    return {"meas_allocated": meas["peak_allocated"], "meas_reserved": meas["peak_reserved"],
            "model_allocated": st["peak_allocated_bytes"], "model_reserved": st["peak_reserved_bytes"]}


def estimate(argv: list[str], formulas: str, adjust: tuple, kernels: dict | None = None) -> dict:
    """What fit.gpu_validate runs on the GPU machine: get-training-info --nproc_per_node 1 FLAGS OPTIONS
    --formulas SET --json, less the runtime items the install cannot have (fit.gpu_validate.install_adjustments);
    `kernels`: the kernel families the run recorded (a run of an earlier stand-in is predicted as what it ran)."""
    pick = [] if formulas == "default" else ["--formulas", formulas]    # default: the estimator's own choice
    doc = json.loads(json_text(cli.build_report(["--nproc_per_node", "1", *argv, *adjust[0], *pick],
                                                kernels=kernels)))
    return predicted(doc, drop=adjust[1])


def recorded_kernels(run_dir: str) -> dict | None:
    """The kernel families the run recorded (measured.json `kernels`, completed as fit.dataset completes a trace
    header's: a GPU run of the local spec ran CUDA's norms)."""
    from fit.dataset import header_kernels
    with open(os.path.join(run_dir, "measured.json"), encoding="utf-8") as fh:
        meas = json.load(fh)
    if not isinstance(meas.get("kernels"), dict):
        return None
    return header_kernels({"kernels": meas["kernels"], "backend": "cuda"})


def measured_on_standins(name: str) -> bool:
    from estimator import formulas as F
    return F.load(F.DEFAULT_SET if name == "default" else name).measured_on_standins


def _pct(pred, meas) -> str:
    return f"{100 * (pred - meas) / meas:+.2f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=DEFAULT_DIR)
    ap.add_argument("--formulas", nargs="+", default=["default", "gpu_h100"])
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir) or not runs(args.dir):
        print(f"gpu_validation: no validation runs (*/measured.json) under {args.dir}", file=sys.stderr)
        return 2
    _, configs = load_grid(GRID)
    flags = {c.name: c.argv for c in configs}
    with open(os.path.join(args.dir, "validation.json"), encoding="utf-8") as fh:
        adjust = install_adjustments(json.load(fh)["install"])
    rows = []
    print(f"{'config':34s} {'alloc MiB':>10s} {'resv MiB':>9s}  allocator model (alloc, resv)  "
          + "  ".join(f"{s} (alloc, resv)" for s in args.formulas))
    errs = {s: [] for s in args.formulas}
    exact = 0
    for name in runs(args.dir):
        row = {"config": name, **allocator_check(os.path.join(args.dir, name))}
        exact += (row["model_allocated"], row["model_reserved"]) == (row["meas_allocated"], row["meas_reserved"])
        cells = []
        kernels = recorded_kernels(os.path.join(args.dir, name))
        for s in args.formulas:
            # a set measured on the stand-ins predicts what the run ran; the modelled one describes TE itself
            p = estimate(flags[name], s, adjust, kernels if measured_on_standins(s) else None)
            row[s] = p
            errs[s].append(p["allocated"] / row["meas_allocated"] - 1)
            cells.append(f"{_pct(p['allocated'], row['meas_allocated']):>8s} "
                         f"{_pct(p['reserved'], row['meas_reserved']) if p['reserved'] else 'n/a':>8s}")
        rows.append(row)
        print(f"{name:34s} {row['meas_allocated'] / MiB:10.1f} {row['meas_reserved'] / MiB:9.1f}  "
              f"{row['model_allocated'] - row['meas_allocated']:+14d} B {row['model_reserved'] - row['meas_reserved']:+9d} B  "
              + "      ".join(cells))
    print(f"allocator model on the real request streams: {exact} of {len(rows)} equal to the byte (allocated and "
          "reserved)")
    for s, e in errs.items():
        print(f"{s}: allocated median |err| {100 * statistics.median(abs(x) for x in e):.2f}%, range "
              f"{100 * min(e):+.2f}% .. {100 * max(e):+.2f}%, {sum(abs(x) <= 0.01 for x in e)} of {len(e)} within 1%")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
