"""Traced runs -> a program set file and its provenance, and the checks that the set reproduces every run.

    python -m fit.programs TRACE_DIR... -o SET.json [--name NAME] [--description TEXT]
    python -m fit.programs --check SET.json     # refit from the provenance's traces; fails if the file differs

The set (estimator/programs.py, docs/FORMATS.md section 7) holds the programs, the op structure and a checksum;
SET.provenance.json beside it the runs, each cell's runs, the named events (worker windows widened, runs whose
structure was not reproduced) and the check of every run: each label's delta and peak replayed from the set at the
run's sizes against the run's own trace, to the byte.
"""
from __future__ import annotations

import os
import sys
import time

from estimator import programs as P
from estimator.model import MTP_LAYER

from ..dataset import DatasetError, expand_dirs, parsed_run, point_of
from ..basis import candidates, variables_of
from .extract import Program, run_programs
from .fit import Run, fit_label
from .switches import fit_structure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_runs(paths: list, accept_damaged: bool = False) -> list:
    """The plain (no recompute) runs among the run directories: recompute is composed from them, never fitted."""
    from estimator.formulas import switches
    from tracer.segments import op_children
    out = []
    for path in expand_dirs(paths):
        ranks, hdr, cfg = parsed_run(path, accept_damaged)
        sw = switches(cfg)
        if sw["recompute"] != "none":
            continue
        point = {k: (int(v) if v.denominator == 1 else float(v)) for k, v in point_of(cfg).items()}
        children = {op: kids for op, kids in run_children([op_children(r) for r in ranks]).items()
                    if not mtp_layer_twin(op)}
        rp = run_programs(path, ranks)
        programs = with_empty_phases({k: p for k, p in rp.programs.items() if not mtp_layer_twin(k[1])}, children)
        out.append(Run(_rel(path), sw, point, programs, children, [int(r.peak_bytes) for r in ranks],
                       str(hdr.get("backend", "cpu")), hdr.get("device"), rp.firsts, rp.positions))
    if not out:
        raise DatasetError("no plain (non-recompute) runs among the given directories")
    return out


def run_children(per_rank: list) -> dict:
    """Each op's children over the run's traced ranks: a pipeline run's stages each hold part of the model (the
    first the embedding, the last the output layer, the loss and multi-token prediction), and the structure is the
    whole model's (switches._union)."""
    from .switches import _union
    ops = {op for kids in per_rank for op in kids}
    return {op: _union([kids[op] for kids in per_rank if op in kids]) for op in sorted(ops)}


def mtp_layer_twin(label: str) -> bool:
    """A label of multi-token prediction's transformer layer: it allocates as a decoder layer of its spec does
    (tests/test_mtp.py compares them event by event), so the estimator walks the decoder layer's programs there
    and the fit leaves these out."""
    return label.startswith(MTP_LAYER)


def with_empty_phases(programs: dict, children: dict) -> dict:
    """A label the run executes but whose phase allocated nothing (no segment: a backward without its own autograd
    node, dropout with p = 0) gets an empty program: a measured zero, so a config like the run's is never
    extrapolated from runs that allocate there."""
    from estimator.compose import ROOT, own_label
    labels = {ROOT} | set(children)
    for op, kids in children.items():
        labels.update(kids)
        labels.update(own_label(op, c) for c in kids)
    labels = {label for label in labels if not mtp_layer_twin(label)}
    out = dict(programs)
    for label in labels:
        for phase in ("fwd", "bwd"):
            out.setdefault((phase, label), Program(phase, label, (), (), 0, 0))
    return out


def _rel(path: str) -> str:
    ap = os.path.abspath(path)
    return os.path.relpath(ap, ROOT) if ap.startswith(ROOT + os.sep) else path


def fit_runs(runs: list) -> list:
    from . import fit as F
    F.KNOWN.clear()     # a fit depends on its runs only, not on what this process fitted before
    cells = []
    for phase, label in sorted({k for r in runs for k in r.programs}):
        items = [(r, r.programs[(phase, label)]) for r in runs if (phase, label) in r.programs]
        cells += fit_label(phase, label, items)
    # The model's first layer also frees what only it holds (the embedding's output, the attention mask): its own
    # programs, for the labels where some run's first layer differs from the others
    for phase, label in sorted(differs(runs, "firsts")):
        items = [(r, r.firsts[(phase, label)]) for r in runs if (phase, label) in r.firsts]
        for c in fit_label(phase, label, items):
            c.first = True
            cells.append(c)
    # likewise the first and last of a label's repeated instances (a SequentialMLP's experts share tensors that
    # one of them frees)
    for phase, label, pos in sorted(differs(runs, "positions")):
        items = [(r, r.positions[(phase, label, pos)]) for r in runs if (phase, label, pos) in r.positions]
        for c in fit_label(phase, label, items):
            c.instance = pos
            cells.append(c)
    return cells


def differs(runs: list, attr: str) -> set:
    """The keys of a run's `firsts` or `positions` whose program differs from the label's representative."""
    out = set()
    for r in runs:
        for key, p in getattr(r, attr).items():
            q = r.programs.get(key[:2])
            if q is None or p.compute != q.compute or p.workers != q.workers:
                out.add(key)
    return out


# The MoE variables mean nothing where no run of a label had experts (E = 0 there).
_MOE_VARIABLES = ("E", "k", "fe", "ep", "etp")


def fixed_variables(runs: list, cells: list) -> dict:
    """Per label, the variables of its candidate family (fit.basis; an MLP's also the MoE ones) that had one value
    in every run of the label: no size of it can say how it depends on them (a grouped-GEMM campaign that kept
    top-k at 2 fits `2*k`-sized tensors as constants times the rest), so the estimator reports a config with
    another value as extrapolated."""
    point = {r.path: r.point for r in runs}
    paths: dict = {}
    for c in cells:
        paths.setdefault(c.label, set()).update(c.runs)
    out = {}
    for label in sorted(paths):
        pts = [point[p] for p in sorted(paths[label]) if p in point]
        family = set().union(*[variables_of(m) for m in candidates(label.split("@")[0])])
        if ".mlp" in label:   # an MoE layer's ops size by routed tokens (TEGroupedMLP's linears too)
            family |= set(_MOE_VARIABLES)
        if not any(pt.get("E") for pt in pts):
            family -= set(_MOE_VARIABLES)
        one = {v: pts[0][v] for v in sorted(family) if v in pts[0] and len({pt.get(v) for pt in pts}) == 1}
        if one:
            out[label] = {v: int(x) if float(x).is_integer() else float(x) for v, x in one.items()}
    return out


def documents(runs: list, cells: list, name: str, description: str, profiled: dict | None = None) -> tuple:
    """(set document, provenance document). profiled: the stack a job's own set was profiled on
    (fit.job_campaign), kept in the set."""
    failed = [(c, i, why) for c in cells for i, why in c.failed]
    if failed:
        c, i, why = failed[0]
        raise DatasetError(f"{c.phase} {c.label} event {i}: {why} ({len(failed)} such events)")
    where = sorted({(r.device or "GPU") if r.backend == "cuda" else "CPU" for r in runs})
    doc = {
        "format": P.FORMAT, "version": P.VERSION, "name": name, "kind": "fitted",
        "description": description or (f"Allocation programs fitted from {len(runs)} traces ({', '.join(where)}); "
                                       f"recompute is composed from the plain layer, never fitted."),
        "programs": [{"label": c.label, "phase": c.phase, **_qualifier(c), "when": c.when,
                      "runs": len(c.runs), "seen": c.seen,
                      "events": [P.format_event(*ev) for ev in c.events]}
                     for c in cells],
        "structure": fit_structure(runs),
        # What the estimator needs to say where a config leaves the measured ground: the backends that ran the
        # traces (GPU kernels or CPU stand-ins), and each distinct combination of the switches that change a layer's
        # op structure among the runs (a pair of values never traced together is not composed from measured parts).
        "backends": sorted({r.backend for r in runs}),
        "traced": traced_structures(runs),
        "fixed": fixed_variables(runs, cells),
        **({"profiled": profiled} if profiled else {}),
    }
    doc["checksum"] = P.content_checksum(doc)
    notes = sorted({n for c in cells for n in c.notes})
    prov = {"set": name, "checksum": doc["checksum"],
            "traces": [{"path": r.path, "peaks": r.peaks, "backend": r.backend, "device": r.device} for r in runs],
            "cells": [{"label": c.label, "phase": c.phase, **_qualifier(c), "runs": c.runs}
                      for c in cells],
            "notes": notes,
            # allocations whose exact fit over few runs has a negative term (a kernel's block-rounded workspace
            # fits a sum by coincidence): it may go wrong far from those runs; the estimator clamps a size at 0
            "negative_terms": [f"{c.phase} {c.label} event {i}: {P.format_size(terms)} ({len(c.runs)} runs)"
                               for c in cells for i, (op, terms, _, _) in enumerate(c.events)
                               if op in ("+", "+~") and terms and any(coef < 0 for coef, _ in terms)]}
    return doc, prov


def _qualifier(c) -> dict:
    return {**({"layer": "first"} if c.first else {}), **({"instance": c.instance} if c.instance else {})}


def traced_structures(runs: list) -> list:
    from estimator.formulas import STRUCTURE_SWITCHES
    seen = {tuple((k, r.switches[k]) for k in STRUCTURE_SWITCHES if k in r.switches) for r in runs}
    return [dict(t) for t in sorted(seen, key=repr)]


def measured_set(path: str):
    """One run's own programs, sizes as constants (no fit), with its op structure, as a formula set the estimator
    reads: replaying it checks the composition (the walk, recompute, pipeline boundaries) with nothing fitted."""
    from estimator.formulas import from_dict
    (run,) = load_runs([path])
    cells = []
    for first, programs in ((False, run.programs), (True, run.firsts), (False, run.positions)):
        for key, prog in sorted(programs.items()):
            phase, label = key[:2]
            events = [P.format_event(e.op, None if e.ref.startswith(("#", "~")) and e.op in ("-", "-~")
                                     else ((e.size, ()),) if e.size else (), e.ref,
                                     ((e.count, ()),) if e.count != 1 else None) for e in prog.events()]
            cells.append({"label": label, "phase": phase, **({"layer": "first"} if first else {}),
                          **({"instance": key[2]} if len(key) == 3 else {}), "when": [{}],
                          "runs": 1, "events": events})
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "one-run", "kind": "fitted", "description": path,
           "programs": cells, "structure": fit_structure([run]),
           "backends": [run.backend], "traced": traced_structures([run])}
    doc["checksum"] = P.content_checksum(doc)
    return from_dict(doc, path)


def check_runs(fset: P.ProgramSet, runs: list) -> dict:
    """Every run's every (phase, label) replayed from the set at the run's sizes against the trace: `exact` where
    a program of the run's cell reproduces the run's own delta and peak to the byte (one of its alternatives,
    where the cell has several: the estimator takes the highest, so such a run is then over-estimated, named in
    the notes); `bounded` where the set is higher only because a worker window was widened (errs high, named);
    `missed` otherwise (a run whose structure the set does not reproduce, named in the provenance notes)."""
    exact, bounded, missed = 0, [], []
    for r in runs:
        for first, programs in ((False, r.programs), (True, r.firsts), (False, r.positions)):
            for key, prog in programs.items():
                phase, label = key[:2]
                cells, _ = fset.select(phase, label, r.switches, first, key[2] if len(key) == 3 else None)
                own = prog.delta_peak()
                if not cells:
                    missed.append((r.path, phase, label, own, None))
                    continue
                got = [tuple(round(x) for x in c.delta_peak(r.point)) for c in cells]
                if own in got:
                    exact += 1
                elif prog.workers and any(g[0] == own[0] and g[1] > own[1] for g in got):
                    bounded.append((r.path, phase, label, own, got[0]))
                else:
                    missed.append((r.path, phase, label, own, got[0]))
    return {"exact": exact, "bounded": bounded, "missed": missed}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fit.programs", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="run directories, or directories of them")
    ap.add_argument("-o", "--output", help="program set to write (SET.provenance.json beside it)")
    ap.add_argument("--name", default="programs")
    ap.add_argument("--description", default="")
    ap.add_argument("--check", metavar="SET", help="refit SET from its provenance's traces; exit 1 if it differs")
    ap.add_argument("--accept-damaged", action="store_true", help="fit damaged or truncated traces anyway")
    a = ap.parse_args(argv)
    try:
        if a.check:
            return _check(a.check)
        if not a.paths or not a.output:
            ap.error("give run directories and -o SET.json (or --check SET.json)")
        summary, lost = fit_set(a.paths, a.output, a.name, a.description, accept_damaged=a.accept_damaged)
        print(summary)
        return 1 if lost else 0
    except (DatasetError, P.ProgramError, OSError) as exc:
        print(f"fit.programs: error: {exc}", file=sys.stderr)
        return 2


def fit_set(paths: list, output: str, name: str, description: str, profiled: dict | None = None,
            accept_damaged: bool = False) -> tuple:
    """Fit the runs under `paths` into the set `output` (and its provenance), replay every run against it:
    (the summary, the label phases not reproduced in runs the provenance does not name)."""
    t0 = time.time()
    runs = load_runs(paths, accept_damaged)
    cells = fit_runs(runs)
    doc, prov = documents(runs, cells, name, description, profiled)
    _write(output, doc, prov)
    report = check_runs(P.from_dict(doc, output), runs)
    return _summary(output, runs, cells, prov, report, time.time() - t0), unnamed(report, prov)


def _write(path: str, doc: dict, prov: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(P.to_json(doc))
    with open(provenance_path(path), "w", encoding="utf-8") as fh:
        fh.write(P.to_json(prov))


def provenance_path(path: str) -> str:
    return path[:-5] + ".provenance.json" if path.endswith(".json") else path + ".provenance.json"


def _summary(path, runs, cells, prov, report, seconds) -> str:
    lines = [f"wrote {path}: {len(cells)} programs over {len({(c.phase, c.label) for c in cells})} labels from "
             f"{len(runs)} runs in {seconds:.0f} s",
             f"  replayed against the traces: {report['exact']} label phases exact to the byte, "
             f"{len(report['bounded'])} bounded by a widened worker window (errs high), {len(report['missed'])} "
             f"not reproduced"]
    for path_, phase, label, own, got in report["missed"][:10]:
        lines.append(f"    not reproduced: {path_} {phase} {label}: trace (delta, peak) {own}, set {got}")
    if prov["notes"]:
        lines.append(f"  {len(prov['notes'])} notes in the provenance file")
    return "\n".join(lines)


def _check(path: str) -> int:
    import json
    with open(path, encoding="utf-8") as fh:
        shipped = fh.read()
    P.from_dict(json.loads(shipped), path)        # the checksum and the format first
    with open(provenance_path(path), encoding="utf-8") as fh:
        prov = json.load(fh)
    doc = json.loads(shipped)
    runs = load_runs([os.path.join(ROOT, t["path"]) for t in prov["traces"]])
    cells = fit_runs(runs)
    new, new_prov = documents(runs, cells, doc["name"], doc["description"])
    report = check_runs(P.from_dict(new, path), runs)
    same = P.to_json(new) == shipped
    lost = unnamed(report, new_prov)
    print(f"{path}: refit from {len(runs)} traces {'identical' if same else 'DIFFERS'}; "
          f"{report['exact']} label phases exact, {len(report['bounded'])} bounded by a widened worker window, "
          f"{len(report['missed'])} not reproduced (runs named in the provenance notes), {len(lost)} not named")
    return 0 if same and not lost else 1


def unnamed(report: dict, prov: dict) -> list:
    """Label phases the set does not reproduce in runs the provenance notes do not name: a silent miss."""
    named = {n.split(":")[0] for n in prov["notes"]}
    return [m for m in report["missed"] if m[0] not in named]
