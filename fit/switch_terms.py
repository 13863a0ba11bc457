"""Per-part formulas of one segment quantity -> one formula over shapes and switch indicators.

The segment fitter splits a label's runs by the switches that change a quantity and fits each part exactly. A
config whose combination of those switches was never traced needs the parts combined: here each monomial's
coefficient, as a function of the parts' switch values, is written as the sparsest sum of indicator products (an
effect per switch, then per pair of switches, ...) that reproduces every part exactly. So the effect of dropout
measured with selective recompute and the effect of GQA measured without it add up for a config that has both,
and a part whose data fit no formula is predicted from the parts around it.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

from estimator.formulas import INDICATORS

from .basis import Monomial, times
from .solve import _Problem

MAX_DEGREE = 3      # indicator products of up to this many switches
EXHAUSTIVE = 3      # coefficient models of up to this many terms are searched exhaustively, larger ones greedily
MAX_DEN = 1 << 16


def _indicators(keys: tuple, parts: list) -> list[str]:
    """The indicators of the split switches that some part has on."""
    return [n for n, (k, v) in INDICATORS.items() if k in keys and any(dict(zip(keys, p))[k] == v for p in parts)]


def _point(keys: tuple, part: tuple, names: list) -> dict:
    sw = dict(zip(keys, part))
    return {n: Fraction(int(sw[INDICATORS[n][0]] == INDICATORS[n][1])) for n in names}


def _multipliers(names: list, points: list, degree: int) -> list[Monomial]:
    """Products of indicators of different switches, lowest degree first; a product zero on every part, or equal
    on every part to an earlier one, is left out (the parts cannot tell it apart)."""
    out, columns = [], set()
    for d in range(degree + 1):
        for combo in itertools.combinations(names, d):
            if len({INDICATORS[n][0] for n in combo}) < d:
                continue
            col = tuple(int(all(p[n] for n in combo)) for p in points)
            if (d and not any(col)) or col in columns:
                continue
            columns.add(col)
            out.append(tuple(sorted((n, 1) for n in combo)))
    return out


def _sparsest(pb: _Problem) -> list | None:
    """[(coef, column)] of the fewest columns reproducing every value exactly, else None."""
    n = len(pb.cands)
    if pb.rational((), MAX_DEN) is not None:
        return []
    for size in range(1, min(EXHAUSTIVE, n) + 1):
        for cols in itertools.combinations(range(n), size):
            if pb.screen(cols) < 1e-9 and (c := pb.rational(cols, MAX_DEN)) is not None:
                return list(zip(c, cols))
    cols: tuple = ()
    while len(cols) < min(n, len(pb.ys)):
        rest = [j for j in range(n) if j not in cols]
        j = min(rest, key=lambda j: pb.screen(tuple(sorted(cols + (j,)))))
        cols = tuple(sorted(cols + (j,)))
        if pb.screen(cols) < 1e-9 and (c := pb.rational(cols, MAX_DEN)) is not None:
            return list(zip(c, cols))
    return None


def merge(keys: tuple, parts: dict) -> list | None:
    """One term list [(coef, monomial with indicators)] reproducing every part's terms on that part's switch
    values; parts: {part values (in `keys` order): [(coef, monomial)]}. None if no model of the coefficients
    up to MAX_DEGREE reproduces them."""
    if not parts:
        return None
    if not keys:
        return list(next(iter(parts.values())))
    order = list(parts)
    names = _indicators(keys, order)
    points = [_point(keys, p, names) for p in order]
    monos: list = []
    for terms in parts.values():
        monos += [m for _, m in terms if m not in monos]
    by_degree = [_multipliers(names, points, degree) for degree in range(1, MAX_DEGREE + 1)]
    out = []
    for m in monos:
        coefs = [sum((c for c, mm in parts[p] if mm == m), Fraction(0)) for p in order]
        for mults in by_degree:
            sol = _sparsest(_Problem(points, coefs, mults))
            if sol is not None:
                break
        else:
            return None
        for c, j in sol:
            if not c:
                continue
            term = m
            for name, _ in mults[j]:
                term = times(term, name)
            out.append((c, term))
    return out


def measured_on(keys: tuple, parts: list) -> list[dict]:
    """The switch values of the parts a formula was measured on (FORMATS 4.1 `measured`)."""
    return [{k: v for k, v in zip(keys, p)} for p in parts]

