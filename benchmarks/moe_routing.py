"""MoE routing benchmark: a fresh router's natural routing against the estimate's routing bound (--moe-imbalance).

    python benchmarks/moe_routing.py [--out DIR] [--formulas SET] [--reprofile] [--json FILE]

Profiles every config of benchmarks/moe_routing.json on CPU twice (`python -m tracer.profile --cpu`): with the
router's own, natural routing (randomly initialised router, the harness's mock data) and with --balanced-routing.
Prints per rank: the measured peaks, the estimate (cpu_compose, the harness's CPU kernels) under balanced routing
(--moe-imbalance 1) and under the default bound, their errors against the natural run, and the smallest F for which
the estimate reaches the natural run's peak (`F needed`; '-' when F = 1 already does). The default
(estimator.moe_tokens.DEFAULT_IMBALANCE) must cover every rank: the estimate with it >= the natural peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import accuracy as A  # noqa: E402

GRID = os.path.join(ROOT, "benchmarks", "moe_routing.json")
OUT = os.path.join(ROOT, "runs", "moe_routing")


def configs(grid: dict) -> list[dict]:
    """Each entry as accuracy.py's config dicts: the natural run and its --balanced-routing twin."""
    from fit.campaign import config_argv
    out = []
    for c in grid["configs"]:
        argv, nproc = config_argv(grid["base"], c)
        out.append({"name": c["name"], "argv": argv, "nproc": nproc, "launcher": []})
        out.append({"name": c["name"] + "_bal", "argv": argv, "nproc": nproc, "launcher": ["--balanced-routing"]})
    return out


def peaks(cfg: dict, formulas: str, imbalance: float | None) -> list[float]:
    """Predicted peak per rank (CPU run, CPU kernels) with --moe-imbalance `imbalance` (None: the default)."""
    extra = [] if imbalance is None else ["--moe-imbalance", repr(float(imbalance))]
    return [r["peak_bytes"] for r in A.predict({**cfg, "argv": cfg["argv"] + extra}, formulas)]


def needed(cfg: dict, formulas: str, rank: int, measured: int, hi: float = 8.0) -> float | None:
    """The smallest F (to 0.01) whose estimate for `rank` reaches `measured`; 1.0 when balanced does; None when
    not even `hi` does."""
    if peaks(cfg, formulas, 1.0)[rank] >= measured:
        return 1.0
    if peaks(cfg, formulas, hi)[rank] < measured:
        return None
    lo = 1.0
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if peaks(cfg, formulas, mid)[rank] >= measured else (mid, hi)
    return hi


def main(argv: list[str] | None = None) -> int:
    from estimator.moe_tokens import DEFAULT_IMBALANCE
    ap = argparse.ArgumentParser(prog="benchmarks/moe_routing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--formulas", default="cpu_compose")
    ap.add_argument("--reprofile", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    with open(GRID, encoding="utf-8") as fh:
        grid = json.load(fh)
    iterations = int(grid.get("iterations", 3))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    cfgs = configs(grid)
    for c in cfgs:
        run_dir = os.path.join(args.out, c["name"])
        if args.reprofile or not A.cached(run_dir, c, iterations):
            print(f"profiling {c['name']} ...", file=sys.stderr, flush=True)
            A.profile(c, args.out, iterations, 600)
    print(f"MoE routing: natural vs balanced routing, formula set {args.formulas}, default --moe-imbalance "
          f"{DEFAULT_IMBALANCE:g}")
    hdr = (f"{'config':26s} {'rank':>4s} {'natural KiB':>12s} {'balanced KiB':>13s} {'est F=1':>8s} "
           f"{'est default':>11s} {'F needed':>8s}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for nat, bal in zip(cfgs[::2], cfgs[1::2]):
        m_nat = A.measured(os.path.join(args.out, nat["name"]), nat["nproc"])
        m_bal = A.measured(os.path.join(args.out, bal["name"]), bal["nproc"])
        p1, pd = peaks(nat, args.formulas, 1.0), peaks(nat, args.formulas, None)
        for r in range(nat["nproc"]):
            mn, mb = int(m_nat[r]["allocator_peak_bytes"]), int(m_bal[r]["allocator_peak_bytes"])
            f = needed(nat, args.formulas, r, mn)
            row = {"config": nat["name"], "rank": r, "natural": mn, "balanced": mb, "est_f1": p1[r],
                   "est_default": pd[r], "err_f1": A._err(p1[r], mn), "err_default": A._err(pd[r], mn),
                   "err_balanced_run": A._err(p1[r], mb), "f_needed": f}
            rows.append(row)
            ok &= pd[r] >= mn
            print(f"{nat['name']:26s} {r:4d} {A._kib(mn):>12s} {A._kib(mb):>13s} {row['err_f1']:+7.2f}% "
                  f"{row['err_default']:+10.2f}% {'-' if f == 1.0 else 'none' if f is None else f'{f:.2f}':>8s}")
    worst = max((r["f_needed"] or 99.0 for r in rows), default=1.0)
    print(f"\nlargest F needed: {worst:.2f}; default {DEFAULT_IMBALANCE:g} covers every rank: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "default": DEFAULT_IMBALANCE, "covered": ok}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
