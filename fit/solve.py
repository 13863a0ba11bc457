"""Exact sparse fitting: bytes = sum_k c_k * monomial_k(config), with the fewest terms and small rational c_k.

Allocations are deterministic, so the right answer is an exact identity on every traced config. The search tries
every subset of up to `exhaustive` candidates (float least squares to screen, then exact rational verification),
then greedy forward selection up to `max_terms`. A fit is only accepted when it is *determined*: at least two
configs more than terms (one spare config could confirm a coincidence), and no other equally sparse exact fit that predicts differently somewhere in the
formula's domain. Otherwise it refuses and names the variable(s) whose variation would tell the fits apart.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from .basis import FLAG_HINTS, Monomial, evaluate, format_monomial, variables_of

Point = Mapping[str, Fraction]          # variable values of one config (exact)
Terms = list                            # list[tuple[Fraction, Monomial]]


class FitRefused(Exception):
    """The data cannot determine a formula; the message says why and which configs would."""


class Ambiguous(FitRefused):
    """Two fits match every config equally well but predict otherwise in the domain."""


@dataclass
class Fit:
    terms: Terms                         # [(coef, monomial)], basis order
    exact: bool                          # reproduces every point exactly
    n_points: int                        # distinct configs used
    max_abs_residual: float              # bytes
    max_rel_residual: float
    loo_max_rel_err: float | None = None  # leave-one-out, None when no held-out fit was determined
    loo_undetermined: int = 0            # held-out folds that were themselves underdetermined
    notes: list = field(default_factory=list)
    runs_used: list = field(default_factory=list)   # provenance: the traces this fit was made from (set by caller)
    pins: tuple = ((), ())                           # (fixed, ties) domain pins it was fitted under

    def predict(self, point: Point) -> Fraction:
        return sum((c * evaluate(m, point) for c, m in self.terms), Fraction(0))

    def __str__(self) -> str:
        return format_terms(self.terms)


def format_terms(terms: Terms) -> str:
    if not terms:
        return "0"
    parts = []
    for c, m in terms:
        mono = format_monomial(m)
        parts.append(str(c) if mono == "1" else mono if c == 1 else f"{c}*{mono}" if c.denominator == 1
                     else f"({c})*{mono}")
    return " + ".join(parts).replace("+ -", "- ")


# ------------------------------------------------------------------------------------------------- helpers
def _dedupe(points: Sequence[Point], ys: Sequence[int]) -> tuple[list[Point], list[Fraction]]:
    """One row per distinct config; a config seen twice with different bytes keeps both (the fit then fails)."""
    seen: dict = {}
    for p, y in zip(points, ys):
        key = (tuple(sorted(p.items())), Fraction(y))
        seen.setdefault(key, (p, Fraction(y)))
    return [p for p, _ in seen.values()], [y for _, y in seen.values()]


def _exact_solve(rows: list[list[Fraction]], ys: list[Fraction]) -> list[Fraction] | None:
    """Least-squares-free exact solve: Gaussian elimination over the rationals on a full-rank row subset."""
    m = len(rows[0]) if rows else 0
    aug = [list(r) + [y] for r, y in zip(rows, ys)]
    r = 0
    for c in range(m):
        pr = next((i for i in range(r, len(aug)) if aug[i][c] != 0), None)
        if pr is None:
            return None
        aug[r], aug[pr] = aug[pr], aug[r]
        inv = 1 / aug[r][c]
        aug[r] = [x * inv for x in aug[r]]
        for i in range(len(aug)):
            if i != r and aug[i][c] != 0:
                f = aug[i][c]
                aug[i] = [x - f * z for x, z in zip(aug[i], aug[r])]
        r += 1
    return [aug[i][m] for i in range(m)]


_VALUES: dict = {}   # id(point) -> (point, {monomial: value}): the fitters evaluate the same runs' monomials often


def _evaluated(m: Monomial, p: Point) -> Fraction:
    hit = _VALUES.get(id(p))
    if hit is None or hit[0] is not p:
        hit = _VALUES[id(p)] = (p, {})
    v = hit[1].get(m)
    if v is None:
        v = hit[1][m] = evaluate(m, p)
    return v


class _Problem:
    """Feature matrix of one (op, metric) group, float for screening and exact for verification."""

    def __init__(self, points: list[Point], ys: list[Fraction], cands: list, exact: list | None = None):
        """`exact`: the feature matrix where the candidates are not monomials (fit.switch_terms' literal products)."""
        self.points, self.ys, self.cands = points, ys, cands
        self.exact = exact if exact is not None else [[_evaluated(m, p) for m in cands] for p in points]
        self.X = np.array([[float(x) for x in row] for row in self.exact], dtype=float).reshape(len(points),
                                                                                                len(cands))
        self.y = np.array([float(y) for y in ys], dtype=float)
        norms = np.linalg.norm(self.X, axis=0)
        self.norms = np.where(norms > 0, norms, 1.0)
        self.Xn = self.X / self.norms
        self.yscale = max(float(np.max(np.abs(self.y))) if len(self.y) else 0.0, 1.0)

    def screen(self, cols: tuple) -> float:
        """Max relative residual of the float least-squares fit on `cols` (inf if rank-deficient)."""
        if not cols:
            return float(np.max(np.abs(self.y))) / self.yscale if len(self.y) else 0.0
        A = self.Xn[:, cols]
        coef, _, rank, _ = np.linalg.lstsq(A, self.y, rcond=None)
        if rank < len(cols):
            return float("inf")
        return float(np.max(np.abs(A @ coef - self.y))) / self.yscale

    def rational(self, cols: tuple, max_den: int) -> list[Fraction] | None:
        """Coefficients on `cols` as small rationals reproducing every point exactly, else None."""
        if not cols:
            return [] if all(y == 0 for y in self.ys) else None
        A = self.Xn[:, cols]
        coef = np.linalg.lstsq(A, self.y, rcond=None)[0] / self.norms[list(cols)]
        snapped = [Fraction(float(c)).limit_denominator(max_den) for c in coef]
        if self._reproduces(cols, snapped):
            return snapped
        # Float noise can defeat limit_denominator on large features: solve exactly and check the denominators.
        sol = _exact_solve([[row[c] for c in cols] for row in self.exact], list(self.ys))
        if sol is not None and all(c.denominator <= max_den for c in sol) and self._reproduces(cols, sol):
            return sol
        return None

    def _reproduces(self, cols: tuple, coefs: list[Fraction]) -> bool:
        return all(sum((c * row[j] for c, j in zip(coefs, cols)), Fraction(0)) == y
                   for row, y in zip(self.exact, self.ys))

    def float_fit(self, cols: tuple) -> list[Fraction]:
        coef = np.linalg.lstsq(self.Xn[:, cols], self.y, rcond=None)[0] / self.norms[list(cols)]
        return [Fraction(float(c)).limit_denominator(1 << 16) for c in coef]


# ------------------------------------------------------------------------------------------------- search
def _exact_fits(pb: _Problem, size: int, max_den: int, tol: float) -> list[tuple[tuple, list[Fraction]]]:
    out = []
    for cols in _screen_batch(pb, size, tol):
        coefs = pb.rational(cols, max_den)
        if coefs is not None and all(c != 0 for c in coefs):
            out.append((cols, coefs))
    return out


def _screen_batch(pb: _Problem, size: int, tol: float, chunk: int = 4096) -> list[tuple]:
    """All `size`-subsets whose least-squares residual is ~0, screened in batches through the normal equations
    (pinv copes with singular ones; exact rational verification follows, so a loose screen is harmless)."""
    k = len(pb.cands)
    G, rhs = pb.Xn.T @ pb.Xn, pb.Xn.T @ pb.y
    ynorm = pb.y / pb.yscale
    hits = []
    it = itertools.combinations(range(k), size)
    while True:
        combos = np.array(list(itertools.islice(it, chunk)), dtype=int)
        if len(combos) == 0:
            return hits
        Gs = G[combos[:, :, None], combos[:, None, :]]
        coef = np.einsum("cij,cj->ci", np.linalg.pinv(Gs), rhs[combos]) / pb.yscale
        pred = np.einsum("ncm,cm->nc", pb.Xn[:, combos], coef)
        res = np.max(np.abs(pred - ynorm[:, None]), axis=0)
        hits.extend(tuple(int(x) for x in combos[i]) for i in np.flatnonzero(res <= tol))


def _greedy(pb: _Problem, max_terms: int) -> tuple:
    """Forward selection: add the candidate that lowers the residual most, up to max_terms."""
    chosen: tuple = ()
    best = pb.screen(chosen)
    for _ in range(max_terms):
        scored = [(pb.screen(tuple(sorted(chosen + (j,)))), j) for j in range(len(pb.cands)) if j not in chosen]
        scored = [s for s in scored if s[0] < float("inf")]
        if not scored:
            break
        res, j = min(scored)
        if res >= best:
            break
        chosen, best = tuple(sorted(chosen + (j,))), res
        if res <= 1e-9:
            break
    return chosen


def _probe_points(points: list[Point], fixed: set, ties: Mapping[str, str], n: int = 12) -> list[dict]:
    """Random configs in the formula's domain: free variables vary, `fixed` keep their observed value, `ties`
    copy another variable (st = t under sequence parallelism); an untied st is 1 or t, as Megatron allows."""
    rng = random.Random(1234)
    names = sorted(points[0])
    out = []
    for _ in range(n):
        p = {v: Fraction(rng.randint(2, 4099)) for v in names}
        for v in fixed:
            if v in p:
                p[v] = points[0][v]
        for v, other in ties.items():
            if v in p and other in p:
                p[v] = p[other]
        if "st" in p and "st" not in fixed and "st" not in ties:
            p["st"] = rng.choice([Fraction(1), p.get("t", Fraction(1))])
        out.append(p)
    return out


def _same_in_domain(a: Terms, b: Terms, probes: list[dict]) -> bool:
    val = lambda terms, p: sum((c * evaluate(m, p) for c, m in terms), Fraction(0))  # noqa: E731
    return all(val(a, p) == val(b, p) for p in probes)


def _vary_hint(points: list[Point], a: Terms, b: Terms, pinned: set = frozenset()) -> str:
    """Which variable(s) the data never varies (or varies only in lockstep) so that `a` and `b` look alike."""
    ma, mb = {m for _, m in a}, {m for _, m in b}
    differing = (ma ^ mb) or (ma | mb)
    involved = (set().union(*(variables_of(m) for m in differing)) if differing else set()) - set(pinned)
    constant = sorted(v for v in involved if len({p[v] for p in points}) == 1)
    if constant:
        return "; ".join(f"vary {v} (always {points[0][v]} here; {FLAG_HINTS.get(v, v)})" for v in constant)
    # No single constant variable: some ratio of the competing monomials is constant (e.g. a*d/h = 1).
    for x, y in itertools.product(sorted(ma - mb), sorted(mb - ma)):
        ratio = tuple(sorted((k, e) for k, e in
                             {k: dict(x).get(k, 0) - dict(y).get(k, 0) for k in variables_of(x) | variables_of(y)}
                             .items() if e))
        try:
            vals = {evaluate(ratio, p) for p in points}
        except ZeroDivisionError:    # a variable that is 0 here (E on a dense config) divides
            continue
        if len(vals) == 1:
            vs = sorted(variables_of(ratio))
            return (f"vary {format_monomial(ratio)} (always {vals.pop()} here): change "
                    + " / ".join(FLAG_HINTS.get(v, v) for v in vs) + " independently")
    return "add configs that vary " + ", ".join(sorted(involved)) + " independently"


def fit_group(points: Sequence[Point], ys: Sequence[int], cands: list[Monomial], *, fixed: set = frozenset(),
              ties: Mapping[str, str] | None = None, max_terms: int = 6, exhaustive: int = 3,
              max_den: int = 1000, tolerance: float = 0.0, bound: float = 0.0, largest_untraced: bool = False,
              guess: bool = False) -> Fit:
    """Sparsest determined fit of ys over the candidate monomials.

    `fixed`: variables constant over the whole domain of the formula (e when the dtype is pinned), so fits that
    differ only through them are equivalent. `tolerance` > 0 accepts an inexact greedy fit whose max relative
    residual is within it (flagged exact=False); 0 demands an exact identity. `bound` > 0 (for transient peaks,
    which are a max over allocation patterns and so need not be one polynomial) finally accepts a nonnegative
    fit that never under-predicts a traced config and over-predicts by at most `bound`. `largest_untraced`: exact
    fits that differ only at parallel sizes no point has (TP 2 on every run) are not refused as ambiguous; the
    largest there is taken (see _pick). `guess`: of exact fits that differ in the domain, the first in basis order
    instead of a refusal (a consensus search's trial, which the other points then check). Raises FitRefused.
    """
    ties = dict(ties or {})
    pts, yv = _dedupe(points, ys)
    n = len(pts)
    if n == 0:
        raise FitRefused("no data")
    if all(y == 0 for y in yv):
        return Fit([], True, n, 0.0, 0.0)
    if n < 3:
        raise FitRefused(f"underdetermined: {n} config(s) cannot determine a nonzero formula; a formula of m "
                         f"terms needs m + 2 configs (m to fit, two to confirm)")
    pb = _Problem(pts, yv, cands)
    probes = _probe_points(pts, set(fixed), ties)
    pinned = set(fixed) | set(ties)
    screen_tol = 1e-6
    for size in range(1, min(exhaustive, n - 2) + 1):
        found = _exact_fits(pb, size, max_den, screen_tol)
        if found:
            return _pick(pb, found, probes, pinned, largest_untraced, guess)
    # Larger formulas: greedy, then a swap check for an equally good but different alternative.
    limit = min(max_terms, n - 2)
    cols = _greedy(pb, limit) if limit > exhaustive else ()
    if cols:
        coefs = pb.rational(cols, max_den)
        if coefs is not None and not all(coefs):  # a zero coefficient: that term is not needed
            cols = tuple(j for j, c in zip(cols, coefs) if c)
            coefs = pb.rational(cols, max_den) if cols else None
        if coefs is not None:
            alts = [(cols, coefs)]
            for alt in _swaps(cols, len(cands)):
                if pb.screen(alt) <= screen_tol and (c2 := pb.rational(alt, max_den)) is not None:
                    alts.append((alt, c2))
            return _pick(pb, alts, probes, pinned, largest_untraced, guess)
    if tolerance > 0:
        cols = _greedy(pb, limit)
        if cols:
            coefs = pb.float_fit(cols)
            terms = [(c, cands[j]) for c, j in zip(coefs, cols)]
            fit = _finish(pb, terms, exact=False)
            if fit.max_rel_residual <= tolerance:
                fit.notes.append(f"inexact: max relative residual {fit.max_rel_residual:.2e}")
                return fit
    if bound > 0:
        fit = upper_bound_fit(pb, limit)
        if fit is not None and fit.max_rel_residual <= bound:
            return fit
    raise FitRefused(_no_fit_message(pts, cands, n, max_terms, pinned))


def near_fit(points: Sequence[Point], ys: Sequence[int], cands: list[Monomial], *, slack: float,
             fixed: set = frozenset(), ties: Mapping[str, str] | None = None, max_terms: int = 5,
             max_den: int = 8) -> Fit:
    """A fit within `slack` of every point, for data with no exact fit because a stray scalar moved a few levels
    by a few bytes. The greedy terms' coefficients snap to small rationals, and terms that nowhere contribute
    more than the slack are dropped: they fit the noise, and grow with the config where the noise does not.
    Refused as ambiguous when swapping one term for another candidate fits as well but predicts otherwise in the
    domain; where that happens only at parallel sizes no point has, the largest there is taken (as in _pick).
    Raises FitRefused."""
    pts, yv = _dedupe(points, ys)
    n = len(pts)
    if n < 3:
        raise FitRefused(f"underdetermined: {n} config(s) cannot determine a nonzero formula")
    pb = _Problem(pts, yv, cands)
    cols = _greedy(pb, min(max_terms, n - 2))
    best = _settled(pb, cols, slack, max_den)
    if best is None:
        raise FitRefused(f"no fit within {slack:.0f} B of every config")
    found = {best[0]: best[1]}
    for swapped in _swaps(best[0], len(cands)):
        if (alt := _settled(pb, swapped, slack, max_den)) is not None:
            found.setdefault(alt[0], alt[1])
    fit = _pick(pb, list(found.items()), _probe_points(pts, set(fixed), dict(ties or {})),
                set(fixed) | set(ties or {}), largest_untraced=True, within=slack)
    fit.exact = False
    fit.notes.append(f"within {fit.max_abs_residual:.0f} B of every run")
    return fit


def _swaps(cols: tuple, k: int):
    """Every column set with one of `cols` swapped for another of the k candidates (an equally good rival)."""
    for i, j in itertools.product(range(len(cols)), range(k)):
        if j not in cols:
            yield tuple(sorted(cols[:i] + (j,) + cols[i + 1:]))


def _settled(pb: _Problem, cols: tuple, slack: float, max_den: int) -> tuple[tuple, list[Fraction]] | None:
    """(columns, coefficients) of the least-squares fit on `cols` with its coefficients snapped to denominators of
    at most `max_den` and the terms that contribute at most `slack` anywhere dropped (then refitted), if every
    residual is within `slack`; else None."""
    while cols:
        if np.linalg.matrix_rank(pb.Xn[:, cols]) < len(cols):
            return None
        coefs = [c.limit_denominator(max_den) for c in pb.float_fit(cols)]
        noise = [j for c, j in zip(coefs, cols) if max(abs(c * row[j]) for row in pb.exact) <= slack]
        if noise:
            cols = tuple(j for j in cols if j not in noise)
            continue
        worst = max(abs(sum((c * row[j] for c, j in zip(coefs, cols)), Fraction(0)) - y)
                    for row, y in zip(pb.exact, pb.ys))
        return (cols, coefs) if worst <= slack else None
    return None


def _scales_of(points: Sequence[Point], scales: Sequence[float], kept: list[Point]) -> np.ndarray:
    """Per deduplicated point, the largest scale given for that config."""
    by: dict = {}
    for p, sc in zip(points, scales):
        key = tuple(sorted(p.items()))
        by[key] = max(by.get(key, 1.0), float(sc))
    return np.array([by[tuple(sorted(p.items()))] for p in kept])


def bound_fit(points: Sequence[Point], ys: Sequence[int], cands: list[Monomial], bound: float,
              scales: Sequence[float], max_terms: int = 6, **_ignored) -> Fit:
    """Only the upper-bound part of fit_group (for data already known to have no exact fit): a nonnegative fit
    that never under-predicts a traced config and over-predicts it by at most `bound` x its scale (for one
    allocation point of a transient: the config's peak, the largest of its points, which is what an over-
    prediction would raise). Raises FitRefused."""
    pts, yv = _dedupe(points, ys)
    n = len(pts)
    if n < 4:
        raise FitRefused(f"underdetermined: {n} config(s) cannot determine a bound")
    pb = _Problem(pts, yv, cands)
    sc = _scales_of(points, scales, pts)
    # Nonnegative terms: a bound made of signed terms fits the traced configs as tightly but can fall below the
    # level (or far above it) on a config of other proportions. At most n - 3 terms, so that every leave-one-out
    # fold still has two configs more than terms (a bound no fold can check is not accepted).
    fit = upper_bound_fit(pb, min(max_terms, n - 3), scale=sc)
    if fit is None:
        raise FitRefused(f"no upper bound from {n} config(s)")
    over = max(float(fit.predict(p) - y) / s for p, y, s in zip(pts, yv, sc))
    if over > bound:
        raise FitRefused(f"no upper bound within {bound:.0%} of the peak from {n} config(s)")
    fit.max_rel_residual = over
    fit.notes[-1] = (f"upper bound: never under-predicts a traced config, over-predicts by at most {over:.2%} of "
                     f"its peak")
    return fit


def _pick(pb: _Problem, found: list, probes: list[dict], pinned: set = frozenset(),
          largest_untraced: bool = False, guess: bool = False, within: float | None = None) -> Fit:
    """Among equally sparse exact fits (with `within`, fits within that many bytes), the first in basis order,
    unless another differs in the domain; with `largest_untraced`, one that differs only at parallel sizes no
    point has leaves the largest there."""
    how = "exactly" if within is None else f"within {within:.0f} B"
    found.sort(key=lambda fc: fc[0])
    cols, coefs = found[0]
    best = [(c, pb.cands[j]) for c, j in zip(coefs, cols)]
    n = len(pb.points)
    if n < len(cols) + 2:
        raise FitRefused(f"underdetermined: {len(cols)} term(s) need at least {len(cols) + 2} configs, have {n}")
    if guess:
        return _finish(pb, best, exact=True)
    rivals = []
    traced = _at_traced_parallel_sizes(pb.points, probes) if largest_untraced else []
    for cols2, coefs2 in found[1:]:
        other = [(c, pb.cands[j]) for c, j in zip(coefs2, cols2)]
        if _same_in_domain(best, other, probes):
            continue
        if not traced or not _same_in_domain(best, other, traced):
            raise Ambiguous(f"ambiguous: {format_terms(best)}  and  {format_terms(other)} both fit all {n} "
                            f"configs {how}; {_vary_hint(pb.points, best, other, pinned)}")
        rivals.append(other)
    if rivals:
        # The fits differ only at parallel sizes no run had (a CPU campaign runs TP 2 at most): every one is exact
        # wherever the runs were; the largest at other sizes is taken, so the extrapolation errs high.
        alts = [best] + rivals
        val = lambda terms, p: sum((c * evaluate(m, p) for c, m in terms), Fraction(0))  # noqa: E731
        wins = [sum(all(val(a, p) >= val(o, p) for o in alts) for p in probes) for a in alts]
        best = alts[wins.index(max(wins))]
        fit = _finish(pb, best, exact=True)
        pins, tied = _traced_parallel(pb.points)
        fixed = ", ".join([f"{v} = {x}" for v, x in pins.items()] + (["st = t"] if tied else []))
        kind = "exact fits" if within is None else f"fits within {within:.0f} B"
        fit.notes.append(f"{len(alts)} {kind} differ only at parallel sizes never traced ({fixed} on every run): "
                         "the largest there taken")
        return fit
    return _finish(pb, best, exact=True)


# Parallel sizes a campaign on a few CPU processes cannot vary beyond its one traced value.
_PARALLEL = ("t", "st", "cp", "ep", "etp")


def _constant(points: list[Point], v: str) -> bool:
    return v in points[0] and len({p[v] for p in points}) == 1


def _at_traced_parallel_sizes(points: list[Point], probes: list[dict]) -> list[dict]:
    """The probes with every parallel size the runs never varied set to its traced value, and st = t where every
    run had sequence parallelism with its TP (TP without it never traced)."""
    pins, tied = _traced_parallel(points)
    if not pins and not tied:
        return []
    out = [{**p, **pins} for p in probes]
    return [{**p, "st": p["t"]} for p in out] if tied else out


def _traced_parallel(points: list[Point]) -> tuple[dict, bool]:
    """({parallel size: its value} for those constant over the points, whether st = t on every point with st
    varying)."""
    pins = {v: points[0][v] for v in _PARALLEL if _constant(points, v)}
    tied = "st" not in pins and "st" in points[0] and "t" in points[0] and all(p["st"] == p["t"] for p in points)
    return pins, tied


def _finish(pb: _Problem, terms: Terms, exact: bool) -> Fit:
    pred = [float(sum((c * evaluate(m, p) for c, m in terms), Fraction(0))) for p in pb.points]
    res = [abs(a - float(y)) for a, y in zip(pred, pb.ys)]
    rel = [r / max(abs(float(y)), 1.0) for r, y in zip(res, pb.ys)]
    return Fit(terms, exact, len(pb.points), max(res, default=0.0), max(rel, default=0.0))


def _no_fit_message(pts: list[Point], cands: list[Monomial], n: int, max_terms: int, pinned: set) -> str:
    used = set().union(*(variables_of(m) for m in cands)) - pinned
    constant = sorted((v for v in used if len({p[v] for p in pts}) == 1), key=lambda v: (v == "e", v))
    hint = ("; configs that vary " + ", ".join(f"{v} ({FLAG_HINTS.get(v, v)})" for v in constant)
            if constant else "")
    return (f"no exact fit with at most {min(max_terms, n - 2)} term(s) from {n} config(s): add configs{hint}, "
            f"or the basis lacks a term")


def _round_coef(x: float, up: bool) -> int:
    near = round(x)
    return near if not up and abs(x - near) < 1e-6 else math.ceil(x * (1 + 1e-12))


def upper_bound_fit(pb: _Problem, limit: int, only: tuple | None = None, scale=None) -> Fit | None:
    """Nonnegative coefficients minimising the total relative over-prediction (relative to |y|, or to `scale`
    per point) subject to never under-predicting (a linear program per candidate subset): pairs exhaustively,
    then greedy growth while it helps by > 1%."""
    from scipy.optimize import linprog
    w = 1.0 / np.maximum(np.abs(pb.y) if scale is None else scale, 1.0)

    def solve_lp(cols: tuple):
        A = pb.Xn[:, cols]
        res = linprog(c=(w[:, None] * A).sum(axis=0), A_ub=-A, b_ub=-pb.y, bounds=[(0, None)] * len(cols),
                      method="highs")
        return (float(res.fun - (w * pb.y).sum()), res.x) if res.status == 0 else (float("inf"), None)

    k = len(pb.cands)
    subsets = [only] if only else [c for n in range(1, min(2, limit) + 1) for c in itertools.combinations(range(k), n)]
    scored = [(solve_lp(c), c) for c in subsets]
    scored = [s for s in scored if s[0][1] is not None]
    if not scored:
        return None
    (obj, x), cols = min(scored, key=lambda s: (s[0][0], len(s[1])))
    while len(cols) < limit and not only:
        more = [(solve_lp(tuple(sorted(cols + (j,)))), tuple(sorted(cols + (j,)))) for j in range(k) if j not in cols]
        more = [m for m in more if m[0][1] is not None]
        if not more:
            break
        (o2, x2), c2 = min(more, key=lambda s: s[0][0])
        if o2 >= obj * 0.99:
            break
        (obj, x), cols = (o2, x2), c2
    coefs = x / pb.norms[list(cols)]
    # Each coefficient as a multiple of 1/1024: the nearest one where the LP's vertex is (up to float noise) on
    # it, if that still never under-predicts; else each rounded up (features are nonnegative, so the bound holds).
    fit = None
    for up in (False, True):
        terms = [(Fraction(_round_coef(float(c) * 1024, up), 1024), pb.cands[j])
                 for c, j in zip(coefs, cols) if c > 1e-12]
        fit = _finish(pb, terms, exact=False)
        if all(fit.predict(p) >= y for p, y in zip(pb.points, pb.ys)):
            break
        fit = None
    if fit is None:
        return None
    fit.notes.append(f"upper bound: never under-predicts a traced config, over-predicts by at most "
                     f"{fit.max_rel_residual:.2%}")
    return fit


# ------------------------------------------------------------------------------------------------- LOO
def leave_one_out(fit: Fit, points: Sequence[Point], ys: Sequence[int], cands: list[Monomial],
                  scales: Sequence[float] | None = None, **kw) -> Fit:
    """Refit without each distinct config in turn and predict it; fills fit.loo_*. Returns fit.
    Exact fits are searched afresh per fold (structure and coefficients); inexact/bound fits refit their own
    terms only (a fresh upper-bound search per fold would cost a linear program per candidate subset)."""
    pts, yv = _dedupe(points, ys)
    # errors relative to |y|, or to a per-config scale (a bound point's: the config's peak)
    sc = _scales_of(points, scales, pts) if scales is not None else [max(abs(float(y)), 1.0) for y in yv]
    errs, undetermined = [], 0
    own = [m for _, m in fit.terms]
    for i in range(len(pts)):
        rest_p, rest_y = pts[:i] + pts[i + 1:], yv[:i] + yv[i + 1:]
        try:
            if fit.exact:
                held = fit_group(rest_p, rest_y, cands, **{**kw, "bound": 0.0, "tolerance": 0.0})
            else:
                rest_sc = None if scales is None else np.concatenate([sc[:i], sc[i + 1:]])
                held = _refit_bound(rest_p, rest_y, own, rest_sc)
        except FitRefused:
            undetermined += 1
            continue
        errs.append(abs(float(held.predict(pts[i]) - yv[i])) / float(sc[i]))
    fit.loo_max_rel_err = max(errs) if errs else None
    fit.loo_undetermined = undetermined
    return fit


def _refit_bound(points, ys, monos, scale=None) -> Fit:
    if not monos or len(points) < len(monos) + 2:
        raise FitRefused("underdetermined")
    pb = _Problem(list(points), list(ys), monos)
    fit = upper_bound_fit(pb, len(monos), only=tuple(range(len(monos))), scale=scale)
    if fit is None:
        raise FitRefused("no bound")
    return fit
