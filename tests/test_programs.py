"""Allocation programs (fit/programs, estimator/programs.py): extracted from committed traces, sizes solved
exactly, replayed to the byte, read back with a checksum, and predicting runs the fit never saw.

The references are the traces themselves (tracer.segments' per-segment delta and peak, the allocator's records),
never numbers typed here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from estimator import programs as P
from fit.programs.build import check_runs, documents, fit_runs, load_runs
from fit.programs.extract import run_programs
from fit.programs.sizes import SizeSolver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_compose")
SHIPPED = os.path.join(ROOT, "fit", "sets", "programs", "cpu_compose.json")


def _runs(prefixes):
    names = sorted(d for d in os.listdir(TRACES) if d.startswith(prefixes))
    return [os.path.join(TRACES, d) for d in names]


@pytest.fixture(scope="module")
def base_runs():
    return load_runs(_runs(("gpt_base_", "gpt_bf16_s", "gpt_tp2sp_s")))


def test_program_replay_equals_segments():
    """A run's representative program replays to the delta and peak tracer.segments measures for the label."""
    from fit.segment_data import run_samples
    from tracer.parse import parse_run
    for path in _runs(("gpt_base_s48", "gpt_tp2sp_s32")):
        ranks = parse_run(path)
        progs = run_programs(path, ranks).programs
        samples = run_samples(path, ranks)
        assert progs
        for (phase, label), prog in progs.items():
            delta, peak = prog.delta_peak()
            want = samples[label].values
            assert (delta, peak) == (want[f"{phase}_delta"], want[f"{phase}_peak"]), (path, phase, label)


def test_frees_name_their_allocations():
    """Pointers pair frees with allocations: a layer's backward frees what its forward saved, by name."""
    from tracer.parse import parse_run
    path = _runs(("gpt_base_s48",))[0]
    progs = run_programs(path, parse_run(path)).programs
    refs = [e.ref for e in progs[("bwd", "layers.*.mlp.linear_fc2")].compute if e.op == "-"]
    assert any(r.startswith("fwd:layers.*.mlp@linear_fc1#") for r in refs)
    local = [e.ref for p in progs.values() for e in p.compute if e.ref.startswith("#")]
    assert local


def test_size_solver_exact_and_refuses():
    """Sizes that are one monomial are solved with their coefficient; sizes no sum fits are refused (None)."""
    pts = [{"s": s, "b": b, "h": h, "e": e, "st": 1, "t": 1}
           for s, b, h, e in ((16, 2, 64, 4), (32, 1, 96, 2), (48, 3, 128, 4), (40, 2, 80, 2))]
    solver = SizeSolver("layers.*.mlp.linear_fc2", pts)
    fit = solver.fit([p["e"] * p["s"] * p["b"] * p["h"] for p in pts])
    assert P.format_size(fit.terms) == "e*s*b*h/st" or P.format_size(fit.terms) == "e*s*b*h"
    assert solver.fit([7919, 104729, 1299709, 15485863]) is None


def test_fit_reproduces_its_runs(base_runs):
    cells = fit_runs(base_runs)
    doc, prov = documents(base_runs, cells, "t", "")
    fset = P.from_dict(json.loads(P.to_json(doc)))
    report = check_runs(fset, base_runs)
    assert report["exact"] > 100
    assert not report["bounded"] or all(got[1] > own[1] for *_, own, got in report["bounded"])
    # every run not reproduced is named in the provenance notes
    named = {n.split(":")[0] for n in prov["notes"]}
    assert {m[0] for m in report["missed"]} <= named


def test_held_out_run_predicted_exactly(base_runs):
    """Fit without one run, then predict that run's every label phase from the set: sizes are exact formulas of the
    shapes, so a run of a fitted structure is reproduced to the byte."""
    held = [r for r in base_runs if r.path.endswith("gpt_base_s80_b2_h96_a4")]
    assert held
    rest = [r for r in base_runs if r is not held[0]]
    doc, _ = documents(rest, fit_runs(rest), "t", "")
    report = check_runs(P.from_dict(doc), held)
    assert report["exact"] == len(held[0].programs), report["missed"]


def test_checksum_detects_a_changed_coefficient(tmp_path):
    with open(SHIPPED, encoding="utf-8") as fh:
        doc = json.load(fh)
    P.from_dict(doc, SHIPPED)      # the shipped file loads
    for cell in doc["programs"]:
        for i, ev in enumerate(cell["events"]):
            if ev.startswith("+ e*"):
                cell["events"][i] = ev.replace("+ e*", "+ 2*e*", 1)
                break
        else:
            continue
        break
    with pytest.raises(P.ProgramError, match="checksum"):
        P.from_dict(doc, "changed.json")


@pytest.mark.parametrize("event, message", [
    ("+ e*s*q", "unknown variable 'q'"),
    ("* e*s", "malformed event"),
    ("- #3", "frees no allocation"),
    ("+ e*s*b extra words", "malformed event"),
])
def test_malformed_events_refused(event, message):
    doc = {"format": P.FORMAT, "version": P.VERSION, "name": "x", "programs": [
        {"label": "l", "phase": "fwd", "when": [{}], "events": ["+ e*s", event]}]}
    doc["checksum"] = P.content_checksum(doc)
    with pytest.raises(P.ProgramError, match=message):
        P.from_dict(doc)


def test_size_text_round_trip():
    for text in ("e*s*b*h/st", "2*e*h*f/t+e*h", "3*s*b/2", "-4*s*b+8", "e*s*b*h*k*ep*etp/E*st", "0"):
        assert P.format_size(P.parse_size(text)) == text
    assert P.parse_size("3*s*b/2")[0][0] == Fraction(3, 2)


def test_shipped_set_reproduces_a_sample_of_its_runs():
    """The shipped program set against a sample of its provenance runs, re-traced from the committed files."""
    with open(SHIPPED[:-5] + ".provenance.json", encoding="utf-8") as fh:
        prov = json.load(fh)
    paths = [t["path"] for t in prov["traces"]][::40]
    runs = load_runs([os.path.join(ROOT, p) for p in paths])
    report = check_runs(P.load(SHIPPED), runs)
    named = {n.split(":")[0] for n in prov["notes"]}
    assert report["exact"] > 0
    assert {m[0] for m in report["missed"]} <= named


def test_cli_bad_input_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "fit.programs", "--check", str(bad)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("fit.programs: error:") and "Traceback" not in out.stderr
