"""Traced runs -> a program set: per segment label and phase, the allocation program of each cell, sizes exact.

For one (phase, label) the runs' representative programs (extract.py) are grouped by their event structure
(kinds and local references). The switches that explain the grouping are searched among those that can change
the label (fit/programs/switches.py RELEVANT): the fewest whose values determine the structure on every run; each of their
value combinations seen is a cell. Each structure group's sizes are then solved event by event over all its runs
(sizes.py), pooled across cells, so a cell with few runs is fitted on its neighbours' data where its sizes follow
the same formulas. Where one event of a group has no exact formula over the pool, the group is split by the
relevant switch whose parts all fit (a switch that changes a size, not the structure: an fp32 copy under bf16).
Nothing aggregate is fitted: the delta and peak of a segment come from replaying its program (replay.py).

What cannot be fitted is said, never guessed: an event no formula reproduces, a grouping no switch explains
(a structure that varies between runs of one switch combination: a thread that frees at a varying moment).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from .extract import FREE, WORKER_FREE, widest
from .sizes import SizeSolver
from .switches import ORDER, relevant, split_first



@dataclass
class Run:
    path: str
    switches: dict
    point: dict          # variables as plain numbers (int or float)
    programs: dict       # (phase, label) -> extract.Program
    children: dict       # op -> [child ops] (the op structure)
    peaks: list
    backend: str
    device: str | None
    firsts: dict = field(default_factory=dict)   # (phase, label) -> extract.Program at the model's first layer
    positions: dict = field(default_factory=dict)   # (phase, label, "first" | "last") -> extract.Program


@dataclass
class Cell:
    """One fitted program: the cells (switch values) it answers and its events with size formulas."""
    phase: str
    label: str
    when: list                     # [{switch: value}], the cells; [{}] = any
    events: list                   # [(op, size terms, ref, count terms | None)]
    runs: list                     # Run paths
    seen: list                     # per `when` dict: switch -> sorted values its runs had (relevant switches only)
    notes: list = field(default_factory=list)
    failed: list = field(default_factory=list)   # [(event index, reason)]: sizes no formula fits
    first: bool = False            # the program of the model's first layer (extract.run_programs `firsts`)
    instance: str | None = None    # "first" | "last" of repeated sibling instances (extract `positions`)


def relevant_switches(label: str, runs: list) -> list:
    keys = [k for k in ORDER if relevant(label, k)]
    return [k for k in keys if len({r.switches.get(k) for r in runs}) > 1]


def _by_switch(items: list, k: str) -> dict:
    """[(Run, Program)] grouped by the runs' value of switch k."""
    parts: dict = {}
    for r, p in items:
        parts.setdefault(r.switches.get(k), []).append((r, p))
    return parts


def _first_split(items: list, first: list):
    """(0, k, parts) for the first of `first` whose values' runs hold different sets of structures, else None."""
    for k in first:
        parts = _by_switch(items, k)
        if len({frozenset(p.shape for _, p in part) for part in parts.values()}) > 1:
            return 0, k, parts
    return None


def cell_tree(items: list, keys: list, path: tuple = (), notes: list | None = None, first: tuple = ()) -> list:
    """Split runs by switches until each part has one event structure: [(path, items)], path the switch values
    that define the part. At each step the switch (in `keys` order on ties) that leaves the fewest runs outside
    their part's most common structure; a part no remaining switch splits, yet holding two structures, keeps its
    most common one and names the other runs in `notes` (a structure that varies within one switch combination).
    `first`: switches split on before that choice wherever their parts hold different structures (SPLIT_FIRST)."""
    shapes = Counter(p.shape for _, p in items)
    if len(shapes) == 1:
        return [(path, items)]
    used = {k for k, _ in path}
    best = _first_split(items, [k for k in keys if k in first and k not in used])
    for k in keys if best is None else ():
        if k in used:
            continue
        parts = _by_switch(items, k)
        if len(parts) < 2:
            continue
        impurity = sum(len(part) - Counter(p.shape for _, p in part).most_common(1)[0][1] for part in parts.values())
        if best is None or impurity < best[0]:
            best = (impurity, k, parts)
    if best is None:
        # several structures within one switch combination: each is kept as an alternative program of the cell
        # (fit_label), of which the estimator takes the highest at the config's sizes
        top = shapes.most_common(1)[0][0]
        if notes is not None:
            notes += [f"{r.path}: {p.phase} {p.label}: another event structure than the other runs of its "
                      f"switches (an alternative program of its cell)" for r, p in items if p.shape != top]
        return [(path, items)]
    out = []
    for v, part in sorted(best[2].items(), key=lambda kv: repr(kv[0])):
        out += cell_tree(part, keys, path + ((best[1], v),), notes, first)
    return out


def fit_label(phase: str, label: str, items: list) -> list:
    """items: [(Run, Program)] -> [Cell]."""
    runs = [r for r, _ in items]
    keys = relevant_switches(label, runs)
    notes: list = []
    leaves = cell_tree(items, keys, (), notes, split_first(label))
    groups: dict = {}
    for path, members in leaves:
        for r, p in members:
            groups.setdefault(p.shape, []).append((r, p, path))
    mixed = {path for path, members in leaves if len({p.shape for _, p in members}) > 1}
    out = []
    known = Counter()      # formulas fitted on this label's larger groups, by the runs that support them
    by_ref: dict = {}      # a free of another op's tensor (its ref) -> the formulas the larger groups gave it
    for members in sorted(groups.values(), key=len, reverse=True):
        prior = [t for t, _ in known.most_common()] + [t for t, _ in KNOWN.most_common() if t not in known]
        cells = _fit_group(phase, label, members, (), keys, notes, prior=prior, by_ref=by_ref)
        if any(c.failed for c in cells) and all(path in mixed for _, _, path in members):
            # an alternative structure whose sizes no formula fits (too few runs to tell): left out, named
            notes += [f"{r.path}: {phase} {label}: its alternative event structure fits no size formula "
                      f"(not reproduced)" for r, _, _ in members]
            for c in cells:
                c.notes = list(notes)
            continue
        for c in cells:
            for op, terms, ref, _ in c.events:
                if terms:
                    known[terms] += len(c.runs)
                    if op == FREE and not ref.startswith("#"):
                        by_ref.setdefault(ref, Counter())[terms] += len(c.runs)
        out += cells
    KNOWN.update(known)
    return out


# formulas fitted so far in this process, over all labels (fit order: build.fit_runs sorts the labels)
KNOWN: Counter = Counter()


def _fit_group(phase: str, label: str, members: list, split: tuple, keys: list, notes: list, depth: int = 0,
               prior: list | None = None, by_ref: dict | None = None) -> list:
    """One structure's runs ([(Run, Program, leaf path)]) -> [Cell], split further by `split` switches."""
    runs = [r for r, _, _ in members]
    solver = SizeSolver(label, [r.point for r in runs], prior)
    windows = list(widest([p.workers for _, p, _ in members])) if members[0][1].workers else []
    windows = [(a, u) for _, a, u in windows]
    progs = [p.events(windows) for _, p, _ in members]
    n_ev = len(progs[0])
    events, failed = [], []
    for i in range(n_ev):
        ev0 = progs[0][i]
        if ev0.op == FREE and ev0.ref.startswith("#") or ev0.op == WORKER_FREE:
            events.append((ev0.op, None, ev0.ref, None))     # releases an allocation of this segment: its size
            continue
        count = fit_count([p[i].count for p in progs], [r.point for r in runs])
        if count is False:
            failed.append((i, "no count formula reproduces how many times it repeats on the "
                           f"{len(runs)} runs: " + ", ".join(f"{progs[j][i].count}" for j in range(min(4, len(progs))))))
            events.append((ev0.op, None, _common_ref(progs, i), None))
            continue
        sizes = [p[i].size for p in progs]
        # a free of a tensor another op made takes the formula the label's larger groups gave that tensor where it
        # reproduces these runs: a group of a run or two cannot tell s*b*v from h*v where s*b = h
        same = by_ref.get(_common_ref(progs, i)) if by_ref and ev0.op == FREE else None
        fit = solver.fit(sizes, [t for t, _ in same.most_common()] if same else ())
        if fit is None:
            failed.append((i, "no sum of at most three candidate monomials reproduces its sizes on the "
                           f"{len(runs)} runs: " + ", ".join(f"{progs[j][i].size}" for j in range(min(4, len(progs))))))
            events.append((ev0.op, None, _common_ref(progs, i), None))
        else:
            events.append((ev0.op, fit.terms, _common_ref(progs, i), count))
    if failed and depth < 2:
        parted = _split(phase, label, members, split, keys, notes, depth)
        if parted is not None:
            return parted
    by_cell: dict = {}     # each `when` dict -> the runs that make it (its own seen values)
    for r, _, path in members:
        cell = dict(path)
        cell.update({k: r.switches.get(k) for k in split})
        by_cell.setdefault(repr(sorted(cell.items())), (cell, []))[1].append(r)
    order = sorted(by_cell)
    when = [by_cell[k][0] for k in order]
    seen = [_seen(label, by_cell[k][1]) for k in order]
    return [Cell(phase, label, when, events, [r.path for r in runs], seen, list(notes), failed)]


# what a repeated free's count can be: one per local expert (E/EP), per expert, per routed choice; or a constant
COUNT_MONOMIALS = ((("E", 1), ("ep", -1)), (("E", 1),), (("k", 1),), ())


def fit_count(counts: list, points: list):
    """How many times an event repeats, over a group's runs: None where it is 1 on every run, the count's terms
    (a rational multiple of one of COUNT_MONOMIALS) where one reproduces every run, False where none does."""
    if all(c == 1 for c in counts):
        return None
    for mono in COUNT_MONOMIALS:
        values = [Fraction(1) for _ in points]
        for var, exp in mono:
            values = [v * Fraction(p[var]) ** exp for v, p in zip(values, points)]
        if any(v == 0 for v in values):
            continue
        coef = Fraction(counts[0]) / values[0]
        if all(coef * v == c for v, c in zip(values, counts)):
            return ((coef, mono),)
    return False


def _split(phase, label, members, split, keys, notes, depth):
    """Split a structure group by the switch whose parts all fit (a switch that changes a size, not the
    structure); None if none does."""
    for k in keys:
        if k in split:      # a switch of the leaves' paths splits too: the group pools runs of several leaves
            continue
        parts: dict = {}
        for m in members:
            parts.setdefault(m[0].switches.get(k), []).append(m)
        if len(parts) < 2:
            continue
        cells = []
        for part in parts.values():
            cells += _fit_group(phase, label, part, split + (k,), keys, notes, depth + 1)  # fresh: a split fits apart
        if not any(c.failed for c in cells):
            return cells
    return None


def _common_ref(progs: list, i: int) -> str:
    return Counter(p[i].ref for p in progs).most_common(1)[0][0]


def _seen(label: str, runs: list) -> dict:
    out = {}
    for k in ORDER:
        if relevant(label, k):
            out[k] = sorted({r.switches.get(k) for r in runs}, key=repr)
    return out
