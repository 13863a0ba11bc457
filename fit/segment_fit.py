"""Traces -> a composed formula set: per segment label and quantity one formula over shapes and switch
indicators, plus the measured op structure the estimator replays them in (FORMATS 4.1).

Per label (tracer.segments, FORMATS 3.1) each of the four quantities is fitted on its own: pooled over all runs
(a few runs that deviate where the rest of their switch combination does not are left out and named); where
some part has no exact formula, the runs are split by the switch whose split leaves the fewest runs undetermined,
and so on; a transient no formula fits gets an upper bound, a part still without one an approximate formula or
null with the reason. The parts are then merged over switch indicators (fit/switch_terms.py), so a config whose
combination was never traced is composed from parts measured in other combinations. `seen` records, per switch,
the values the entry's runs had, and `measured` the parts each quantity was measured on.

    python -m fit.segment_fit TRACE_DIR... -o SET.json [--name NAME] [--jobs N] [--accept-damaged]
    python -m fit.segment_fit TRACE_DIR... -o SET.json --update SET.json --labels PREFIX...   # refit some labels
"""
from __future__ import annotations

import argparse
import copy
import itertools
import sys
from collections import Counter
from fractions import Fraction

from estimator.compose import STRUCTURE_SWITCHES   # the estimator checks combinations of the same switches
from estimator import moe_tokens
from estimator.formulas import indicators, switches as config_switches

from . import basis, unfitted
from .dataset import DatasetError, expand_dirs, parsed_run, point_of
from .group import SWITCH_ORDER, domain
from .segment_data import QUANTITIES, run_samples
from .solve import Ambiguous, FitRefused, bound_fit, fit_group, near_fit
from .switch_terms import merge
from .programs.switches import ORDER, RELEVANT, fit_structure, relevant  # noqa: F401 (the fitter's tables)

# The op fitter's switch order, and the switches only composed sets split on (FORMATS 4.1).
# The layer spec first: it changes the most labels (norms fused into linear_qkv and linear_fc1), and the split search
# pairs the first switches with every other.
# Labels that exist only for a config's switches (the op structure says which a config has) and labels of the
# step's own code: their basis (the widest, plus the loss head's atoms for the step).
_STEP_ATOMS = ["s*b*v/t", "s*b", "s*s*b", "s*b*h/st", "s*b*h", "s", "b", "1"]
_WEIGHT_ATOMS = ["h*f/t", "h*h/t", "h*a*d/t", "h*g*d/t", "v*h/t", "h", "f/t", "a*d/t", "g*d/t", "s*h", "h*fe/etp",
                 "h*E"]
# The embedding's weights are the word table (v x h, vocabulary-parallel) and the position table (its rows: at
# least s); the output layer's is v x h: an attention- or MLP-sized term in their backward could only be a
# coincidence of few runs, and it extrapolates wrongly.
_OWN_WEIGHTS = {"embedding": ["v*h/t", "s*h", "h"], "output_layer": ["v*h/t"]}


class Run:
    def __init__(self, path: str, accept_damaged: bool = False):
        from tracer.segments import op_children
        ranks, _, self.config = parsed_run(path, accept_damaged)
        self.path = path
        self.switches = config_switches(self.config)
        self.point = point_of(self.config)
        self.samples = run_samples(path, ranks)
        self.children = op_children(ranks[0])
        self.peaks = [int(r.peak_bytes) for r in ranks]
        self.backend = ranks[0].header.get("backend", "cpu")   # 'cuda' for a GPU trace
        self.device = ranks[0].header.get("device")


# RELEVANT, relevant: fit/programs/switches.py (shared with the program fitter)


def candidates(label: str) -> list:
    """The op family's atoms (basis.candidates), then weight-sized ones: a backward allocates weight gradients
    (where the family's own weights are known, of those only)."""
    op = label.split("@", 1)[0]
    if op in ("step", "decoder"):
        atoms = [basis.parse_monomial(a) for a in _STEP_ATOMS]
        out = [basis.times(a, "e") for a in atoms] + atoms
    else:
        out = basis.candidates(op)
    for a in _OWN_WEIGHTS.get(basis.family(op), _WEIGHT_ATOMS):
        m = basis.parse_monomial(a)
        for x in (basis.times(m, "e"), m):
            if x not in out:
                out.append(x)
    return out


def constant_switches(runs: list) -> dict:
    first = runs[0].switches
    return {k: v for k, v in first.items() if all(r.switches.get(k) == v for r in runs)}


def _parts(runs: list, keys: tuple) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(tuple(r.switches.get(k) for k in keys), []).append(r)
    return out


def _problem(label: str, q: str, runs: list) -> tuple:
    """(points, values, fixed, ties) of one quantity over a part's runs (a run whose phase has no such segment
    allocates 0 bytes there), pinned as every run of the part has them: formulas that agree on that domain are
    equivalent (`seen` keeps the estimator from using one outside it)."""
    fixed, ties = domain(constant_switches(runs))
    return [r.point for r in runs], [r.samples[label].values.get(q, 0) for r in runs], fixed, ties


def _fit_part(label: str, q: str, runs: list, cache: dict, robust: bool = False):
    """Fit or the refusal reason of one quantity over one part of a label's runs: exact on every run, else
    (`robust`) exact on all but a few runs that deviate where the rest of their switch combination does not."""
    key = (label, q, robust, tuple(sorted(id(r) for r in runs)))
    if key not in cache:
        pts, ys, fixed, ties = _problem(label, q, runs)
        fit = _fit(list(zip(pts, ys)), candidates(label), fixed, ties)
        if isinstance(fit, str) and robust:
            fit = _robust(label, list(zip(pts, ys, runs)), candidates(label), fixed, ties, fit)
        cache[key] = fit
    return cache[key]


PAIR_LIMIT = 24
SPLIT_LIMIT = {1: None, 2: PAIR_LIMIT, 3: 40}   # combinations tried per size (in ORDER: the likeliest first)
SLACK_BYTES = 64   # a few scalars (a 4-byte tensor freed by the garbage collector in one run, not in another)


def _fit(data: list, cands: list, fixed, ties):
    """The sparsest exact fit; failing that, one whose every residual is within SLACK_BYTES (a run whose level
    a stray scalar moved: solve.near_fit, refused where another such fit predicts otherwise); else the refusal's
    reason. Exact fits that differ only at a parallel size no run had
    (`s*b*h*e/st` or `2*s*b*h*e` at TP 2) give the largest there: a part left without a formula would be
    predicted from the other parts', which is wrong even at the traced size."""
    pts, ys = [p for p, _ in data], [y for _, y in data]
    try:
        return fit_group(pts, ys, cands, fixed=fixed, ties=ties, max_terms=5, largest_untraced=True)
    except FitRefused as exc:
        reason = str(exc)
    try:
        return near_fit(pts, ys, cands, slack=SLACK_BYTES, fixed=fixed, ties=ties, max_terms=5)
    except Ambiguous as exc:
        return str(exc)
    except FitRefused:
        return reason


def _covered(fits: dict, runs: list, keys: tuple) -> int:
    """Minus the runs left without a determined formula under a split by `keys`."""
    n = {part: len(rs) for part, rs in _parts(runs, keys).items()}
    return -sum(n[part] for part, v in fits.items() if isinstance(v, str))


OUTLIER_SHARE = 0.15   # at most this share of a part's runs may deviate from its formula (and are named)


def _combination(label: str, r) -> tuple:
    return tuple(r.switches.get(k) for k in ORDER if relevant(label, k))


def _robust(label: str, data: list, cands: list, fixed, ties, reason: str):
    """The sparsest exact formula of all but a few runs (at most OUTLIER_SHARE, at least 5 kept), found by
    consensus: exact fits of small random samples of the runs (seeded), the first that all but such a few runs
    agree with is refitted on them. On CPU a free that gloo's thread makes a little earlier or later lands in a
    neighbouring segment of some runs. A run may be left out only while most runs of its own switch combination
    are kept (so a switch that changes the bytes splits the runs instead of being dropped as noise); the runs
    left out are named in the formula's note. Else the refusal's reason."""
    budget = int(len(data) * OUTLIER_SHARE)
    if len(data) - budget < 5:
        return reason
    tried = set()   # guesses that keep the same runs end alike: each such set is fitted once
    for guess in _consensus([p for p, _, _ in data], [y for _, y, _ in data], cands, fixed, ties, len(data)):
        agrees = tuple(abs(g - y) <= SLACK_BYTES for g, (_, y, _) in zip(guess, data))
        if agrees in tried:
            continue
        tried.add(agrees)
        kept = [d for d, ok in zip(data, agrees) if ok]
        dropped = [d[2] for d, ok in zip(data, agrees) if not ok]
        if len(dropped) > budget:
            continue
        alike = Counter(_combination(label, r) for _, _, r in kept)
        gone = Counter(_combination(label, r) for r in dropped)
        if any(gone[c] >= alike[c] for c in gone):
            continue
        fit = _fit([(p, y) for p, y, _ in kept], cands, fixed, ties)
        if not isinstance(fit, str):
            fit.notes.append(f"exact on {len(kept)} runs; {len(dropped)} deviate: "
                             + ", ".join(r.path.rstrip('/').rsplit('/', 1)[-1] for r in dropped))
            return fit
    return reason


ROBUST_TRIES = 12
ROBUST_SAMPLE = 8


def _consensus(pts: list, ys: list, cands: list, fixed, ties, seed: int, tries: int = ROBUST_TRIES,
               size: int = ROBUST_SAMPLE, guess: bool = False):
    """The consensus search's trials (_robust, _max_fit): for each of `tries` seeded random samples of `size`
    runs that an exact formula fits, that formula's prediction for every run. `guess`: a sample that two formulas
    fit (every run of it has b = 2, say) gives the first (solve.fit_group's `guess`), for the other runs to check."""
    import random
    rng = random.Random(seed)
    n = len(pts)
    for _ in range(tries):
        sample = rng.sample(range(n), min(size, n))
        try:
            trial = fit_group([pts[i] for i in sample], [ys[i] for i in sample], cands, fixed=fixed, ties=ties,
                              max_terms=4, guess=guess)
        except FitRefused:
            continue
        yield [float(trial.predict(p)) for p in pts]


PEAK_BOUND = 0.005


def _bound(label: str, q: str, runs: list, reason: str):
    """A transient no exact formula fits (a maximum over allocation patterns, e.g. one for b = 1 and another for
    b > 1): an upper bound that never under-predicts a run and over-predicts by at most PEAK_BOUND of the run's
    peak (solve.bound_fit), flagged in the note; else the reason."""
    pts, ys, fixed, ties = _problem(label, q, runs)
    try:
        return bound_fit(pts, ys, candidates(label), PEAK_BOUND, [max(r.peaks) for r in runs], max_terms=5,
                         fixed=fixed, ties=ties)
    except FitRefused:
        return reason


class MaxFit:
    """A transient that is the larger of two allocation patterns, each fitted on the runs where it is the larger
    (FORMATS 4.1 `{"max": ...}`)."""

    def __init__(self, alternatives: list, notes: list):
        self.alternatives, self.notes = alternatives, notes

    def predict(self, point) -> float:
        return max(float(alt.predict(point)) for alt in self.alternatives)


MAX_MINORITY = 0.45   # the second pattern may be bounded only where it is the larger on at most this share of the runs
# A sample must come from the first pattern's runs alone: with 5 of 17 runs on the second pattern, 8 runs (the
# robust search's sample) are all on the first in 2% of the samples, 5 runs in 13%. With the first pattern on 60%
# of the runs, 60 samples of 5 all miss it with a chance under 1%.
MAX_TRIES, MAX_SAMPLE = 60, 5


def _max_fit(label: str, q: str, runs: list, reason: str):
    """A transient no single formula fits, as the larger of two formulas: the first exact on most runs (found by
    consensus, as _robust, but every run it misses must lie above it), the second exact on those runs, else their
    upper bound within PEAK_BOUND of their peaks; the larger of the two exact where the first is the larger and
    never under a run. Core attention's backward on CPU: three score tensors on every run but the short sequences,
    where another point of the backward holds more. A single bound would trade the score tensors' coefficient for
    terms that do not grow with s and under-predict every longer sequence; the larger of two patterns extrapolates
    as each does. Else the reason."""
    pts, ys, fixed, ties = _problem(label, q, runs)
    peaks = [max(r.peaks) for r in runs]
    n = len(pts)
    if n < 8:
        return reason
    cands = candidates(label)
    # Most guesses split the runs alike: what follows from a split is worked out once (the upper bound's linear
    # programs were nearly all of a refit's time).
    tried, seconds = set(), {}
    for guess in _consensus(pts, ys, cands, fixed, ties, n + 1, MAX_TRIES, MAX_SAMPLE, guess=True):
        if not (off := _missed_below(guess, ys)):
            continue
        on = tuple(i for i in range(n) if i not in set(off))
        if on in tried:
            continue
        tried.add(on)
        first = _fit([(pts[i], ys[i]) for i in on], cands, fixed, ties)
        if isinstance(first, str):
            continue
        # The guess fits five runs; refitted on every run it agreed with, the first pattern may hold on more runs
        # than the guess did (a guess that agreed with 26 of the 28 runs of the first pattern left 2 of them in
        # the second's part, which then had no formula).
        if not (off := tuple(_missed_below([float(first.predict(p)) for p in pts], ys))):
            continue
        on = [i for i in range(n) if i not in set(off)]
        if off not in seconds:
            seconds[off] = _second(off, pts, ys, peaks, cands, fixed, ties, len(off) <= MAX_MINORITY * n)
        if (second := seconds[off]) is None:
            continue
        alt = MaxFit([first, second], [])
        over = [alt.predict(pts[i]) - ys[i] for i in range(n)]
        if all(d >= -SLACK_BYTES for d in over) and all(over[i] <= SLACK_BYTES for i in on) and \
                all(over[i] <= PEAK_BOUND * peaks[i] for i in off):
            alt.notes.append(f"the larger of two patterns: {first} on {len(on)} runs, {second} on {len(off)}")
            return alt
    return reason


def _second(off: tuple, pts, ys, peaks, cands, fixed, ties, minority: bool):
    """The second pattern of _max_fit, on the runs the first misses: exact, else (over a minority of the runs only:
    over most, the bound would be the formula) their upper bound; else None."""
    second = _fit([(pts[i], ys[i]) for i in off], cands, fixed, ties)
    if not isinstance(second, str):
        return second
    if not minority:
        return None
    try:
        return bound_fit([pts[i] for i in off], [ys[i] for i in off], cands, PEAK_BOUND, [peaks[i] for i in off],
                         max_terms=4, fixed=fixed, ties=ties)
    except FitRefused:
        return None


def _missed_below(pred: list, ys: list) -> list:
    """The runs a first pattern's predictions miss, if it misses some and lies below every one it misses (the
    larger of two patterns cannot be above a run); else none."""
    off = [i for i, (p, y) in enumerate(zip(pred, ys)) if abs(p - y) > SLACK_BYTES]
    return off if all(pred[i] < ys[i] for i in off) else []


DEEP_TERMS = 4


def _deep(label: str, q: str, runs: list, reason: str):
    """A part the split left without a formula, searched through every formula of DEEP_TERMS terms: beyond three
    terms the search is greedy, and greedy misses a formula none of whose terms fits well alone (the MoE dispatch's
    backward, s*b*h*e - k*s*b*h*e - s*b*E - s*b*k*e: k - 1 copies of the tokens, the routing map, the
    probabilities). Its cost grows as the candidates to the fourth power, so only for the parts still undetermined;
    else the reason."""
    if len(runs) < DEEP_TERMS + 2 or not reason.startswith("no exact fit"):
        return reason
    pts, ys, fixed, ties = _problem(label, q, runs)
    try:
        return fit_group(pts, ys, candidates(label), fixed=fixed, ties=ties, max_terms=DEEP_TERMS,
                         exhaustive=DEEP_TERMS, largest_untraced=True)
    except FitRefused:
        return reason


APPROXIMATE = 0.10


def _approximate(label: str, q: str, runs: list, reason: str):
    """A part no exact formula, consensus or bound fits (on CPU, a checkpointed attention's frees land in
    neighbouring segments differently from layer to layer): the least-squares formula of at most 5 terms if it is
    within APPROXIMATE of every run, flagged approximate in the note; else the reason. Left undetermined, the
    part would be predicted from the other parts' formulas, which know nothing of it."""
    if len(runs) < 5:
        return reason
    pts, ys, fixed, ties = _problem(label, q, runs)
    try:
        fit = fit_group(pts, ys, candidates(label), fixed=fixed, ties=ties, max_terms=5, tolerance=APPROXIMATE)
    except FitRefused:
        return reason
    fit.notes.append(f"approximate: within {100 * fit.max_rel_residual:.1f}% of every run")
    return fit


def _routed(label: str, runs: list) -> bool:
    """Whether the estimator scales this label's token terms by routing on some of these runs (an expert-side op of
    a MoE layer: a maximum would hide its token terms). A dense MLP's ops share the MoE layer's label prefix but are
    never scaled: their runs have no experts."""
    return moe_tokens.routed(label) and any(r.switches.get("moe") for r in runs)


def _split_fit(label: str, q: str, runs: list, cache: dict):
    """A part's fit while splitting: exact (robust), else for a transient its upper bound, so that a split which
    leaves a part with only a bound (a maximum over allocation patterns, e.g. one for b = 1 and another for b > 1)
    still counts as covering it."""
    fit = _fit_part(label, q, runs, cache, robust=True)
    if not q.endswith("_peak"):
        return fit
    # A robust fit that leaves out runs above it: where those runs are another allocation pattern (the activation
    # gradient at long sequences, the weight gradient's fp32 copy at short ones), the larger of the two holds on
    # every run; left out, they would be under-predicted.
    under = not isinstance(fit, str) and \
        any(float(fit.predict(r.point)) < r.samples[label].values.get(q, 0) - SLACK_BYTES for r in runs)
    if isinstance(fit, str) or under:
        key = (label, q, "peak", tuple(sorted(id(r) for r in runs)))
        if key not in cache:
            # The larger of two exact patterns first (the untied output layer's bf16 backward under SP: its
            # gradients, or the weight gradient's fp32 copy once the logits' gradient is freed); else the robust
            # fit as it is, or for a part without one, a bound.
            larger = fit if _routed(label, runs) else _max_fit(label, q, runs, "" if under else fit)
            cache[key] = larger if isinstance(larger, MaxFit) else fit if under else _bound(label, q, runs, fit)
        fit = cache[key]
    return fit


def split_quantity(label: str, q: str, runs: list, cache: dict) -> tuple:
    """(keys, {part: Fit or reason}, leaves) for one quantity of one label: pooled over all runs; where some part
    has no formula, split by the switch (or, where no switch alone helps, the pair, then the triple of switches,
    among the first SPLIT_LIMIT) that leaves the fewest runs undetermined, and so on; a part still undetermined is
    split further on its own (_refine). Leaves: [(condition, runs, fit or reason)], the parts as split. Each
    quantity is split on its own: a label's transient may depend on a switch that its saved bytes do not."""
    keys: tuple = ()
    fits = {k: _fit_part(label, q, rs, cache, robust=True) for k, rs in _parts(runs, keys).items()}
    varying = [k for k in ORDER if len({r.switches.get(k) for r in runs}) > 1 and relevant(label, k)]
    if not isinstance(fits[()], str) and len(fits[()].terms) >= 3:
        # A pooled formula of many terms may be a coincidence of the traced shapes; where one switch splits the
        # runs into parts of fewer terms in all, the split is the simpler explanation (a held-out combination of
        # the norm type, say, is then predicted right).
        best = None
        for k in varying:
            trial = {part: _fit_part(label, q, rs, cache) for part, rs in _parts(runs, (k,)).items()}
            if any(isinstance(v, str) for v in trial.values()):
                continue
            size = sum(len(v.terms) for v in trial.values())
            if size < len(fits[()].terms) and (best is None or size < best[0]):
                best = (size, k, trial)
        if best is not None:
            return (best[1],), best[2], [(dict(zip((best[1],), part)), None, v) for part, v in best[2].items()]
    if q.endswith("_peak") and isinstance(fits[()], str) and not _routed(label, runs):
        # A transient that is the larger of two allocation patterns, each exact: no split by switches needed.
        # (Not for routed MoE labels: the estimator scales their token terms, which a maximum does not expose.)
        larger = _max_fit(label, q, runs, fits[()])
        if not isinstance(larger, str):
            return keys, {(): larger}, [({}, runs, larger)]
    if q.endswith("_peak") and isinstance(fits[()], str):
        # A transient that is a maximum over allocation patterns has no exact formula, split or not: bounded
        # on all runs within PEAK_BOUND of each run's peak, it needs no common split by switches (_refine below
        # still splits it where a switch gives some of its runs an exact formula).
        bound = _split_fit(label, q, runs, cache)
        if not isinstance(bound, str):
            fits = {(): bound}
    switches = list(varying)
    while any(isinstance(v, str) for v in fits.values()) and switches:
        best = None
        now = _covered(fits, runs, keys)
        # Singles, then pairs, then triples (an op whose bytes change with three switches together, e.g. the
        # layer spec, the norm type and recompute), each tried only where the smaller splits gain nothing.
        for n in (1, 2, 3):
            if best is not None and _covered(best[1], runs, keys + best[0]) > now:
                break
            for ks in list(itertools.combinations(switches, n))[:SPLIT_LIMIT[n]]:
                parts = _parts(runs, keys + ks)
                if n > 1 and len(parts) <= len(_parts(runs, keys)):
                    continue    # the extra switches do not divide these runs
                trial = {part: _split_fit(label, q, rs, cache) for part, rs in parts.items()}
                if best is None or _covered(trial, runs, keys + ks) > _covered(best[1], runs, keys + best[0]):
                    best = (ks, trial)
        if best is None or _covered(best[1], runs, keys + best[0]) <= now:
            break
        keys += best[0]
        for k in best[0]:
            switches.remove(k)
        fits = best[1]
    parts = _parts(runs, keys)   # a transient's parts were bounded where they could be (_split_fit)
    leaves = []
    for part, v in fits.items():
        leaves += _refine(label, q, parts[part], dict(zip(keys, part)), v, cache, REFINE_DEPTH)
    leaves = [(cond, rs, _deep(label, q, rs, v) if isinstance(v, str) else v) for cond, rs, v in leaves]
    leaves = _guard_small(label, q, leaves)
    leaves = _pooled(label, q, leaves, cache)
    leaves = [(cond, rs, _approximate(label, q, rs, v) if isinstance(v, str) else v) for cond, rs, v in leaves]
    # Every leaf's runs in cells of all the switches any leaf was split by (in ORDER, so quantities split by the
    # same switches share entries): what the merge (switch_terms) takes.
    used = {k for cond, _, _ in leaves for k in cond}
    order = tuple(k for k in ORDER if k in used)
    cells = {}
    for _, rs, v in leaves:
        for r in rs:
            cells[tuple(r.switches.get(k) for k in order)] = v
    return order, cells, leaves


REFINE_DEPTH = 2   # switches (or pairs) a part left undetermined by the common split may be split by further
SMALL_PART = 6     # a part of fewer runs may use only terms that parts of at least this many runs use


def _known_terms(leaves: list) -> set:
    """The monomials of the formulas of leaves of at least SMALL_PART runs."""
    return {m for _, rs, v in leaves if not isinstance(v, str) and rs and len(rs) >= SMALL_PART
            for alt in (v.alternatives if isinstance(v, MaxFit) else (v,)) for _, m in alt.terms}


def _fit_on_terms(label: str, q: str, runs: list, terms: set):
    """The exact fit (or the reason) of one quantity over runs on only those of the label's candidates in `terms`."""
    pts, ys, fixed, ties = _problem(label, q, runs)
    return _fit(list(zip(pts, ys)), [m for m in candidates(label) if m in terms], fixed, ties)


def _pooled(label: str, q: str, leaves: list, cache: dict) -> list:
    """Leaves left without a formula, each given the exact formula of its runs pooled with those of the leaves that
    differ from it in one switch of its condition (else in two), where one formula reproduces every pooled run: the
    switch does not change these bytes there. A switch that matters in one corner only (the position type under
    SP, for the word embedding's backward) splits every part alike, and leaves another part's runs (TP without SP:
    four runs, all at TP 2) too few to determine its formula alone. A pool of fewer than SMALL_PART runs may use
    only the terms larger leaves use (_guard_small's rule), and a pooled formula's coefficients must be dyadic
    (_dyadic). A transient where no pool has one exact formula takes a pool's bound (_pool_bound): it errs high,
    by at most PEAK_BOUND of each run's peak."""
    if not any(isinstance(v, str) and rs for _, rs, v in leaves):
        return leaves
    known = _known_terms(leaves)
    every = [r for _, rs, _ in leaves for r in rs or ()]
    bounds = q.endswith("_peak") and not _routed(label, every)
    out = []
    for cond, rs, v in leaves:
        if not isinstance(v, str) or not rs:
            out.append((cond, rs, v))
            continue
        got = None
        keys = [k for k in reversed(ORDER) if k in cond]
        for bounded, n in ((False, 1), (False, 2), (True, 1), (True, 2)):
            if bounded and not bounds:
                break
            for drop in itertools.combinations(keys, n):
                rest = {k: x for k, x in cond.items() if k not in drop}
                pool = [r for r in every if all(r.switches.get(k) == x for k, x in rest.items())]
                if len(pool) <= len(rs) or (bounded and len(pool) < SMALL_PART):
                    continue
                fit = _pool_bound(label, q, pool, cache) if bounded else _fit_part(label, q, pool, cache)
                if not bounded and not isinstance(fit, str) and len(pool) < SMALL_PART and \
                        any(m not in known for _, m in fit.terms):
                    fit = _fit_on_terms(label, q, pool, known)
                if not isinstance(fit, str) and _dyadic(fit):
                    got = copy.copy(fit)    # (a cached fit is shared)
                    got.notes = fit.notes + [f"pooled over {', '.join(drop)} with {len(pool) - len(rs)} more runs"]
                    break
            if got is not None:
                break
        out.append((cond, rs, v if got is None else got))
    return out


def _dyadic(fit) -> bool:
    """Whether every coefficient's denominator is a power of two. Bytes are whole elements of 1, 2, 4 or 8 bytes
    split over parallel sizes that are powers of two, so a formula with 63/41 in it is a coincidence of the runs
    (a pool whose runs at b = 1 have two distinct shapes between them, fitted within a few bytes by five terms)."""
    alts = fit.alternatives if isinstance(fit, MaxFit) else (fit,)
    return all(Fraction(c).denominator & (Fraction(c).denominator - 1) == 0 for alt in alts for c, _ in alt.terms)


def _pool_bound(label: str, q: str, pool: list, cache: dict):
    """A transient's fit over a pool where no one formula is exact: the larger of two patterns or an upper bound
    (_split_fit), taken only where it never under-predicts a pooled run and over-predicts each by at most
    PEAK_BOUND of its peak (the position type's hidden state less under SP at b = 1 is then over-predicted)."""
    fit = _split_fit(label, q, pool, cache)
    if isinstance(fit, str):
        return fit
    for r in pool:
        over = float(fit.predict(r.point)) - r.samples[label].values.get(q, 0)
        if over < -SLACK_BYTES or over > PEAK_BOUND * max(r.peaks):
            return "a pooled bound off its runs"
    return fit


def _guard_small(label: str, q: str, leaves: list) -> list:
    """Leaves of fewer than SMALL_PART runs refitted on the terms the larger parts use, a formula with other terms
    dropped (the leaf is then predicted by the merged formula): with 36 candidate terms, four runs are often fitted
    exactly by a coincidence (`18*s*d*e - 288*a*d*e/t` for a copy of s*b*(a + 2g)*d elements, on two runs of b = 1
    and two of b = 3). A leaf no formula of the whole basis determines (`ambiguous`: g is 1 on all its runs) may be
    determined on those terms."""
    known = _known_terms(leaves)
    out = []
    for cond, rs, v in leaves:
        if not rs or not known or not (isinstance(v, str) or len(rs) < SMALL_PART) or \
                (not isinstance(v, str) and all(m in known for _, m in v.terms)):
            out.append((cond, rs, v))
            continue
        refit = _fit_on_terms(label, q, rs, known)
        if isinstance(refit, str) and not isinstance(v, str):
            refit = f"{v} fits its {len(rs)} runs with terms no larger part has (a coincidence, likely)"
        out.append((cond, rs, v if isinstance(refit, str) and isinstance(v, str) else refit))
    return out


def _is_bound(fit) -> bool:
    return not isinstance(fit, (str, MaxFit)) and any(n.startswith("upper bound") for n in fit.notes)


def _refine(label: str, q: str, runs: list, cond: dict, fit, cache: dict, depth: int) -> list:
    """[(condition, runs, fit or reason)]: a part the common split left undetermined, split on its own by the
    switch (or pair) that determines most of its runs, and so on. The common split divides every part alike, so a
    switch that matters in one corner only (the micro-batch of one, where MQA's query view needs no copy) would
    leave the other parts too few runs each; split here, only that part's runs are divided. A part of the split
    with only an upper bound, pooled over all runs or not, is split by the switch that gives some of its runs an
    exact formula and the rest a bound (a transient that is exact on one dtype's runs and bounded on the other's):
    a bound extrapolates only as far as its terms do, and one bound over both under-predicted larger configs (when
    bf16 traces still held oneDNN's scratchpad, tracer/megatron_compat.py)."""
    bound = _is_bound(fit)
    if not (isinstance(fit, str) or bound) or depth == 0:
        return [(cond, runs, fit)]
    varying = [k for k in ORDER if k not in cond and relevant(label, k) and len({r.switches.get(k) for r in runs}) > 1]
    best = None
    for n in ((1,) if bound else (1, 2)):
        for ks in list(itertools.combinations(varying, n))[:SPLIT_LIMIT[n]]:
            parts = _parts(runs, ks)
            trial = {part: _split_fit(label, q, rs, cache) for part, rs in parts.items()}
            covered = sum(len(parts[p]) for p, v in trial.items() if not isinstance(v, str))
            exact = sum(len(parts[p]) for p, v in trial.items() if not isinstance(v, str) and not _is_bound(v))
            if bound and (covered < len(runs) or not exact):
                continue
            if covered and (best is None or (covered, exact) > best[0]):
                best = ((covered, exact), ks, parts, trial)
        if best is not None and best[0][0] == len(runs):
            break
    if best is None:
        return [(cond, runs, fit)]
    _, ks, parts, trial = best
    out = []
    for part, rs in parts.items():
        out += _refine(label, q, rs, {**cond, **dict(zip(ks, part))}, trial[part], cache, depth - 1)
    return out


def fit_label(label: str, runs: list, cache: dict) -> list[dict]:
    """Formula entries (FORMATS 4.1) for one label from the runs that have it. Each quantity's parts are merged
    into one formula over shapes and switch indicators (switch_terms), which the label's pooled entry (`when`
    {}) holds with the parts it was measured on; a quantity whose parts do not merge keeps one entry per part,
    and entries of quantities split alike are shared."""
    pooled: dict = {}
    measured: dict = {}
    by_keys: dict = {}
    notes: list = []
    for q in QUANTITIES:
        if not any(q in r.samples[label].values for r in runs):
            continue
        keys, fits, leaves = split_quantity(label, q, runs, cache)
        leaf_fits = {_leaf_key(cond): fit for cond, _, fit in leaves}
        done = {part: v for part, v in fits.items() if not isinstance(v, str)}
        parts = _parts(runs, keys)
        merged = _merged(keys, done, parts)
        if merged is None and not keys:     # undetermined on the pooled runs
            pooled[q] = None
            notes += _notes(q, leaf_fits)
            continue
        if merged is None:
            by_keys.setdefault(keys, {})[q] = fits
            continue
        pooled[q] = _written_max(merged["max"]) if isinstance(merged, dict) else merged
        if keys:
            # A part no formula of its own fits is measured too where the merged formula reproduces its runs.
            agree = [cond for cond, rs, fit in leaves if isinstance(fit, str) and rs and
                     all(_reproduces(merged, label, q, r) for r in rs)]
            measured[q] = [cond for cond, _, fit in leaves if not isinstance(fit, str) or cond in agree]
            leaf_fits = {k: v for k, v in leaf_fits.items() if not (isinstance(v, str) and
                                                                   any(k == _leaf_key(c) for c in agree))}
        notes += _notes(q, leaf_fits)
    out = []
    if pooled or not by_keys:
        entry = _entry(label, runs, (), ())
        for q in QUANTITIES:
            if q in pooled or not by_keys:
                got = pooled.get(q)
                entry[q] = None if q in pooled and got is None else got if isinstance(got, dict) else \
                    _written(got or [])
        if measured:
            entry["measured"] = measured
        if notes:
            entry["note"] = "; ".join(notes)
        out.append(entry)
    for keys, qfits in by_keys.items():
        for part, rs in _parts(runs, keys).items():
            entry = _entry(label, rs, keys, part)
            part_notes = []
            for q, fits in qfits.items():
                v = fits[part]
                entry[q] = None if isinstance(v, str) else _written_max([alt.terms for alt in v.alternatives]) \
                    if isinstance(v, MaxFit) else _written(v.terms)
                part_notes += _notes(q, {part: v})
            if part_notes:
                entry["note"] = "; ".join(part_notes)
            out.append(entry)
    return out


def _merged(keys: tuple, done: dict, parts: dict):
    """The parts' formulas merged into one over switch indicators (switch_terms.merge), or None. Where some parts
    are the larger of two patterns (MaxFit; pooled, the only part), each pattern is merged on its own, a part of one
    formula giving it to both: `{"max": [terms, terms]}`, whose larger is every part's formula again."""
    n = max((len(v.alternatives) for v in done.values() if isinstance(v, MaxFit)), default=0)
    if not n:
        return merge(keys, {part: _in_e(v.terms, parts[part]) for part, v in done.items()})
    alts = [merge(keys, {part: _in_e((v.alternatives[min(j, len(v.alternatives) - 1)] if isinstance(v, MaxFit)
                                      else v).terms, parts[part]) for part, v in done.items()}) for j in range(n)]
    return None if any(a is None for a in alts) else {"max": alts}


def _written_max(alternatives: list) -> dict:
    """A quantity that is the larger of its alternatives (term lists), as the set writes it (FORMATS 4.1)."""
    return {"max": [_written(terms) for terms in alternatives]}


def _leaf_key(cond: dict) -> tuple:
    return tuple(f"{k}={v}" for k, v in cond.items())


def _reproduces(terms, label: str, q: str, run) -> bool:
    env = {**run.point, **{k: Fraction(v) for k, v in indicators(run.switches).items()}}
    alts = terms["max"] if isinstance(terms, dict) else [terms]
    return max(sum((c * basis.evaluate(m, env) for c, m in alt), Fraction(0)) for alt in alts) == \
        run.samples[label].values.get(q, 0)


def _in_e(terms: list, runs: list) -> list:
    """A part's terms with every monomial in the element size e where the part's runs share one dtype: there
    `4*s*b` and `s*b*e` are the same formula, and the parts merged by switch_terms must write it alike."""
    if len({r.switches.get("dtype") for r in runs}) > 1:
        return terms
    e = runs[0].point["e"]
    out: dict = {}
    for c, m in terms:
        if "e" not in dict(m):
            c, m = c / e, basis.times(m, "e")
        out[m] = out.get(m, 0) + c
    return [(c, m) for m, c in out.items() if c]


def _entry(label: str, runs: list, keys: tuple, part: tuple) -> dict:
    return {"label": label, "per": "layer" if runs[0].samples[label].in_layer else "model",
            "when": dict(zip(keys, part)),
            "seen": seen_values(label, runs), "runs": len(runs)}


def seen_values(label: str, runs: list) -> dict:
    """Per switch that can change the label (RELEVANT), the values its runs had: where the config's are among
    them the label's formula was measured for it (the other switches' values do not change its allocations)."""
    return {k: sorted({r.switches.get(k) for r in runs}, key=str) for k in ORDER if relevant(label, k)}


def _notes(q: str, fits: dict) -> list:
    out = []
    for part, v in fits.items():
        where = f" [{', '.join(map(str, part))}]" if part else ""
        if isinstance(v, str):
            out.append(f"{q}{where}: {v}")
        else:
            out += [f"{q}{where}: {n}" for n in v.notes
                    if any(w in n for w in ("deviate", "within", "bound", "patterns", "pooled"))]
    return out


def _written(terms) -> list:
    return [{"coef": _coef(c), "vars": dict(m)} for c, m in terms]


def _coef(c):
    return int(c) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


# fit_structure: fit/programs/switches.py


def measured_set(run: Run):
    """A composed set of constants: one run's own measured segment values and op structure. Replaying it through
    the estimator checks the composition (the walk, the replay, recompute) with no fit involved."""
    from estimator import formulas as F
    segs = [{"label": label, "when": {}, "seen": {},
             **{q: ([{"coef": int(s.values[q]), "vars": {}}] if s.values.get(q) else []) for q in QUANTITIES}}
            for label, s in run.samples.items()]
    return F.from_dict({"format": F.FORMAT, "version": F.COMPOSED_VERSION, "name": "one-run", "kind": "fitted",
                        "composed": True, "formulas": [], "segments": segs, "structure": fit_structure([run])})


_RUNS: list = []   # the runs being fitted, shared with forked workers


def _fit_one(label: str) -> tuple:
    return label, fit_label(label, [r for r in _RUNS if label in r.samples], {})


def selected(label: str, only: tuple) -> bool:
    """Whether --labels selects a label: each a prefix, or with a trailing `$` the label itself."""
    return any(label == p[:-1] if p.endswith("$") else label.startswith(p) for p in only)


def fit_runs(paths: list[str], name: str, description: str = "", jobs: int = 1,
             accept_damaged: bool = False, update: dict | None = None, only: tuple = ()) -> dict:
    """A composed set from the runs; with `update` (a set's document) and `only` (label prefixes), that set with
    only the labels starting with one of the prefixes refitted and the rest, its structure and provenance kept."""
    from estimator.formulas import FORMAT
    runs = [Run(p, accept_damaged) for p in expand_dirs(paths)]
    # Full and selective recompute are composed from the plain layer's segments (estimator/compose.py): a run with
    # either is a check of that composition, not data for the fit.
    runs = [r for r in runs if r.switches.get("recompute") in (None, "none")]
    if not runs:
        raise DatasetError("no runs to fit")
    labels = sorted({lb for r in runs for lb in r.samples})
    if update is not None:
        labels = [lb for lb in labels if selected(lb, only)]
        if not labels:
            raise DatasetError(f"no label of these runs matches {' or '.join(only)}")
    segments = []
    _RUNS[:] = runs
    if jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for i, (label, entries) in enumerate(pool.imap(_fit_one, labels)):
                segments += entries
                print(f"  [{i + 1}/{len(labels)}] {label}", file=sys.stderr, flush=True)
    else:
        for i, label in enumerate(labels):
            segments += _fit_one(label)[1]
            print(f"  [{i + 1}/{len(labels)}] {label}", file=sys.stderr, flush=True)
    if update is not None:
        doc = dict(update)
        old = update["segments"]
        # in place of the first refitted entry, so that a diff shows only them
        at = next((i for i, e in enumerate(old) if selected(e["label"], only)), len(old))
        doc["segments"] = old[:at] + segments + [e for e in old[at:] if not selected(e["label"], only)]
        prov = doc["provenance"] = dict(doc.get("provenance") or {})
        prov["refits"] = list(prov.get("refits") or []) + [{"labels": list(only), "traces": [r.path for r in runs]}]
        # Runs the set had not seen join its provenance (what the estimator counts as traced); its op structure is
        # refitted when the runs include every run it was fitted on, else kept.
        before = [t for t in prov.get("traces") or [] if isinstance(t, dict)]
        current = {r.path: r for r in runs}
        for t in before:    # a run traced again in place: its entry says what the trace now holds
            if t.get("path") in current:
                t.update(config=current[t["path"]].config, peaks=current[t["path"]].peaks)
        known = {t.get("path") for t in before}
        added = [r for r in runs if r.path not in known]
        prov["traces"] = list(prov.get("traces") or []) + [{"path": r.path, "config": r.config, "peaks": r.peaks}
                                                          for r in added]
        fitted_on = {r.path for r in runs}
        if all(t.get("path") in fitted_on or not _plain(t) for t in before):
            doc["structure"] = fit_structure(runs)
        elif added:
            print("  op structure kept: the runs do not include every run the set was fitted on", file=sys.stderr)
        return unfitted.mark(doc, unfitted.provenance_runs(doc, ".", runs))
    doc = {"format": FORMAT, "version": 2, "name": name, "kind": "fitted", "composed": True,
           "description": description or default_description(runs),
           "provenance": {"traces": [{"path": r.path, "config": r.config, "peaks": r.peaks} for r in runs],
                          "backends": sorted({r.backend for r in runs})},
           "formulas": [],
           "segments": segments, "structure": fit_structure(runs)}
    return unfitted.mark(doc, runs)


def _plain(trace: dict) -> bool:
    """Whether a provenance entry is a run the fit uses (no recompute)."""
    cfg = trace.get("config")
    return not isinstance(cfg, dict) or config_switches(cfg)["recompute"] == "none"


def default_description(runs: list) -> str:
    """What the set was fitted from, read from the runs' trace headers."""
    where = sorted({(r.device or "GPU") if r.backend == "cuda" else "CPU" for r in runs})
    return (f"Composed per-op segment formulas fitted from {len(runs)} traces ({', '.join(where)}); recompute is "
            "composed from the plain layer, never fitted.")


def main(argv=None) -> int:
    import json
    ap = argparse.ArgumentParser(prog="python -m fit.segment_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories, or directories of them")
    ap.add_argument("-o", "--output", required=True, help="formula set to write")
    ap.add_argument("--name", default="cpu_compose")
    ap.add_argument("--jobs", type=int, default=1, help="labels fitted in parallel (processes)")
    ap.add_argument("--description", default="", help="the set's description (default: what it was fitted from)")
    ap.add_argument("--update", metavar="SET", help="refit only the --labels of this composed set, keeping the rest")
    ap.add_argument("--labels", nargs="+", default=(), metavar="PREFIX",
                    help="with --update: the label prefixes to refit (e.g. embedding; a trailing $ selects one "
                         "label exactly)")
    ap.add_argument("--accept-damaged", action="store_true",
                    help="fit traces that are damaged, truncated or of runs that did not end cleanly (refused by "
                         "default)")
    a = ap.parse_args(argv)
    if bool(a.update) != bool(a.labels):
        print("fit.segment_fit: error: --update and --labels go together", file=sys.stderr)
        return 2
    try:
        update = None
        if a.update:
            update = json.load(open(a.update, encoding="utf-8"))
            if not (isinstance(update, dict) and update.get("composed") and isinstance(update.get("segments"), list)):
                raise DatasetError(f"{a.update}: not a composed formula set")
        doc = fit_runs(a.paths, a.name, a.description, jobs=max(1, a.jobs), accept_damaged=a.accept_damaged,
                       update=update, only=tuple(a.labels))
    except json.JSONDecodeError as exc:
        print(f"fit.segment_fit: error: {a.update}: not JSON ({exc.msg}, line {exc.lineno})", file=sys.stderr)
        return 2
    except (DatasetError, OSError, ValueError) as exc:
        print(f"fit.segment_fit: error: {exc}", file=sys.stderr)
        return 2
    from estimator.formulas import from_dict
    from_dict(doc, a.output)   # the estimator's own loader must accept it
    with open(a.output, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    undetermined = [(s["label"], s["when"]) for s in doc["segments"] if any(q in s and s[q] is None for q in QUANTITIES)]
    print(f"wrote {a.output}: {len(doc['segments'])} segment formulas ({len(undetermined)} with undetermined "
          f"quantities), {len(doc['structure'])} structure entries, from {len(doc['provenance']['traces'])} runs")
    for label, when in undetermined:
        print(f"  undetermined: {label} {when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
