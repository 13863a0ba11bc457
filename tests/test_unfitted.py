"""fit.unfitted: a composed set's formulas checked against the runs they were fitted from, and the cells they miss
never counted as measured (real packed traces of the cpu_compose campaign, the shipped set)."""
from __future__ import annotations

import copy
import json
import os

import pytest

from estimator import formulas as F
from estimator.compose import ComposedCache
from fit import unfitted
from fit.segment_data import QUANTITIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "fit", "sets", "cpu_compose.json")
LABEL = "layers.*.self_attention.core_attention"


@pytest.fixture(scope="module")
def shipped():
    with open(SHIPPED, encoding="utf-8") as fh:
        doc = json.load(fh)
    try:
        runs = unfitted.provenance_runs(doc, ROOT)
    except FileNotFoundError:
        pytest.skip("packed cpu_compose traces absent")
    return doc, runs


def _measured(doc: dict, run) -> bool:
    sw = dict(F.switches(run.config), recompute="none")
    return ComposedCache(F.from_dict(doc), run.config).values(LABEL, sw)[4]


def test_the_shipped_set_records_every_cell_its_formulas_miss(shipped):
    doc, runs = shipped
    assert unfitted.mark(doc, runs)["segments"] == doc["segments"]
    fset = F.from_dict(doc)
    found = unfitted.misses(fset, runs, unfitted.MISS_HIDDEN)
    for label, i, run, measured, off, entry in found:
        sw = dict(F.switches(run.config), recompute="none")
        assert entry is None or not entry.measured_for(i, sw), (label, QUANTITIES[i], run.path, measured, off)


def test_a_formula_that_misses_its_runs_stops_counting_as_measured(shipped):
    doc, runs = shipped
    base = [r for r in runs if os.path.basename(r.path).startswith("gpt_base_s")]
    llama = [r for r in runs if os.path.basename(r.path).startswith("llama_base_s")]
    assert base and llama
    at = next(n for n, e in enumerate(doc["segments"]) if e["label"] == LABEL and not e["when"])
    assert all(_measured(doc, r) for r in base + llama)
    # One hidden state too many on the GPT base runs only (the GPT base's cell: no GQA, learned positions, ...).
    wrong = copy.deepcopy(doc)
    entry = wrong["segments"][at]
    assert all(F.indicators(F.switches(r.config))[k] == 0 for r in base for k in ("x_gqa", "x_rope"))
    assert all(F.indicators(F.switches(r.config))["x_rope"] == 1 for r in llama)
    entry["fwd_delta"] = entry["fwd_delta"] + [
        {"coef": 1, "vars": {"s": 1, "b": 1, "h": 1, "e": 1}},
        {"coef": -1, "vars": {"s": 1, "b": 1, "h": 1, "e": 1, "x_rope": 1}},
        {"coef": -1, "vars": {"s": 1, "b": 1, "h": 1, "e": 1, "x_gqa": 1}},
        {"coef": 1, "vars": {"s": 1, "b": 1, "h": 1, "e": 1, "x_gqa": 1, "x_rope": 1}}]
    marked = unfitted.mark(wrong, base + llama)
    cells = marked["segments"][at].get("unfitted", {}).get("fwd_delta")
    assert cells and all(not c.get("gqa") and c.get("position") != "rope" for c in cells)
    assert not any(_measured(marked, r) for r in base)
    assert all(_measured(marked, r) for r in llama)


def test_a_set_with_malformed_unfitted_cells_is_refused():
    with open(SHIPPED, encoding="utf-8") as fh:
        doc = json.load(fh)
    doc["segments"][0]["unfitted"] = {"fwd_delta": "everywhere"}
    with pytest.raises(F.FormulaError, match="'unfitted' maps quantities"):
        F.from_dict(doc)
