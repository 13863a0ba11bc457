"""python -m fit TRACE_DIR... -o SET.json [--name NAME]: fit per-op formulas from profiler traces.

Prints one line per op / switch part / metric: the fitted formula, configs used, max residual and leave-one-out
error, or why it was refused. Bad input is a one-line error and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .dataset import DatasetError, load
from .formula_set import build, write
from .group import PointsFit, fit_all
from .solve import format_terms


def _fmt_when(when: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in when.items()) or "*"


def print_table(formulas, out=None, verbose_when: bool = False) -> None:
    out = out or sys.stdout  # looked up per call (pytest's capsys swaps it)
    rows = []
    for f in formulas:
        for m in ("saved", "fwd_peak", "bwd_peak"):
            if m in f.fits:
                fit = f.fits[m]
                loo = "-" if fit.loo_max_rel_err is None else f"{fit.loo_max_rel_err:.1e}"
                loo += f" ({fit.loo_undetermined}u)" if fit.loo_undetermined else ""
                kind = "" if fit.exact else "  [bound]" if any("upper bound" in n for n in fit.notes) else "  [inexact]"
                text = str(fit) if isinstance(fit, PointsFit) else format_terms(fit.terms)
                rows.append((f.op, m, text + kind, str(fit.n_points),
                             f"{fit.max_rel_residual:.1e}", loo, _fmt_when(f.when) if verbose_when else ""))
            elif m in f.refused:
                rows.append((f.op, m, "REFUSED: " + f.refused[m], str(len(f.runs)), "", "",
                             _fmt_when(f.when) if verbose_when else ""))
    head = ("op", "metric", "formula (bytes)", "n", "max rel res", "LOO max (u: undetermined folds)", "when" if verbose_when else "")
    widths = [max(len(r[i]) for r in rows + [head]) if i != 2 else 0 for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[3].rjust(widths[3]),
                         r[4].rjust(widths[4]), r[5].rjust(widths[5]), r[2]] + ([r[6]] if verbose_when else [])),
              file=out)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    ap = _Parser(prog="python -m fit", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="profiler run directories (rank<R>.trace ...), or parents of them")
    ap.add_argument("-o", "--output", required=True, help="formula-set JSON to write")
    ap.add_argument("--name", help="formula-set name (default: the output file's stem)")
    ap.add_argument("--description", default="")
    ap.add_argument("--max-terms", type=int, default=6, help="most terms per formula (default 6)")
    ap.add_argument("--max-denominator", type=int, default=1000, help="largest coefficient denominator")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="accept inexact fits with this max relative residual (default 0: exact only)")
    ap.add_argument("--peak-bound", type=float, default=0.10,
                    help="transient peaks with no exact formula may use a never-under-predicting fit that "
                         "over-predicts traced configs by at most this fraction (default 0.10; 0 disables)")
    ap.add_argument("--no-loo", action="store_true", help="skip leave-one-out cross-validation")
    ap.add_argument("--raw-ops", action="store_true",
                    help="fit every traced module as its own op (default: fold sub-modules the estimator does not "
                         "model, e.g. core_attention.scale_mask_softmax, into their nearest modelled ancestor)")
    ap.add_argument("--show-when", action="store_true", help="print each formula's switch values")
    ap.add_argument("--accept-damaged", action="store_true",
                    help="fit traces that are damaged, truncated or of runs that did not end cleanly (refused by "
                         "default; each is named in a warning)")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        runs, samples = load(args.traces, raw_ops=args.raw_ops, accept_damaged=args.accept_damaged)
        formulas = fit_all(samples, loo=not args.no_loo, max_terms=args.max_terms,
                           max_den=args.max_denominator, tolerance=args.tolerance,
                           peak_bound=args.peak_bound)
        print_table(formulas, verbose_when=args.show_when)
        name = args.name or os.path.splitext(os.path.basename(args.output))[0]
        doc = build(name, runs, formulas, args.description, base_dir=os.path.dirname(os.path.abspath(args.output)))
        write(args.output, doc)
    except (DatasetError, ValueError, OSError) as exc:
        print(f"python -m fit: error: {exc}", file=sys.stderr)
        return 2
    kept = len(doc["formulas"])
    refused = sum(len(f.refused) for f in formulas)
    print(f"wrote {args.output}: {kept} formula(s), {refused} refused metric fit(s), from {len(runs)} run(s) "
          f"in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
