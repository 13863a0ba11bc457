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
import math
from fractions import Fraction

from estimator.formulas import INDICATORS

from .basis import Monomial, times
from .solve import _Problem, _screen_batch

MAX_DEGREE = 3      # indicator products of up to this many switches
LITERAL_DEGREE = 4  # products of indicators and complements: up to this many
EXHAUSTIVE = 3      # coefficient models of up to this many terms are searched exhaustively, larger ones greedily
EXHAUSTIVE_COMBOS = 200_000   # ... where that is at most this many column subsets (literal products are many)
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


def _literal_products(names: list, points: list, degree: int) -> list[tuple]:
    """Products of indicators and complements ((name, True) is the indicator, (name, False) its complement) of up
    to `degree` factors, fewest factors and complements first; like _multipliers, a product zero on every part or
    equal on every part to an earlier one is left out."""
    literals = [(n, pos) for n in names for pos in (True, False)]
    out, columns = [], set()
    for d in range(1, degree + 1):
        combos = [c for c in itertools.combinations(literals, d) if len({n for n, _ in c}) == d]
        combos.sort(key=lambda c: sum(not pos for _, pos in c))
        for combo in combos:
            col = tuple(int(all(p[n] == pos for n, pos in combo)) for p in points)
            if not any(col) or col in columns:
                continue
            columns.add(col)
            out.append(combo)
    return out


def _literal_problem(points: list, coefs: list, products: list) -> _Problem:
    """The exact problem of one coefficient over literal products (solve._Problem evaluates only monomials)."""
    exact = [[Fraction(int(all(p[n] == pos for n, pos in c))) for c in products] for p in points]
    return _Problem(points, coefs, products, exact)


def _expanded(m: Monomial, product: tuple) -> list:
    """[(sign, monomial)]: m times a literal product, each complement (1 - x) multiplied out."""
    out = []
    pos = [n for n, p in product if p]
    neg = [n for n, p in product if not p]
    for k in range(len(neg) + 1):
        for chosen in itertools.combinations(neg, k):
            term = m
            for name in sorted(pos + list(chosen)):
                term = times(term, name)
            out.append((Fraction((-1) ** k), term))
    return out


def _sparsest(pb: _Problem) -> list | None:
    """[(coef, column)] of the fewest columns reproducing every value exactly, else None."""
    n = len(pb.cands)
    if pb.rational((), MAX_DEN) is not None:
        return []
    for size in range(1, min(EXHAUSTIVE, n) + 1):
        if math.comb(n, size) > EXHAUSTIVE_COMBOS:
            break
        for cols in _screen_batch(pb, size, 1e-6):   # a loose screen: every hit is verified exactly
            if (c := pb.rational(cols, MAX_DEN)) is not None:
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
    literal: list = []    # built only where indicator products do not reproduce a coefficient
    out: dict = {}
    for m in monos:
        coefs = [sum((c for c, mm in parts[p] if mm == m), Fraction(0)) for p in order]
        terms = None
        for mults in by_degree:
            sol = _sparsest(_Problem(points, coefs, mults))
            if sol is not None:
                terms = [(c, [(Fraction(1), _times_all(m, mults[j]))]) for c, j in sol]
                break
        if terms is None:
            literal = literal or _literal_products(names, points, LITERAL_DEGREE)
            sol = _sparsest(_literal_problem(points, coefs, literal))
            if sol is None:
                return None
            terms = [(c, _expanded(m, literal[j])) for c, j in sol]
        for c, expansion in terms:
            for sign, term in expansion:
                out[term] = out.get(term, Fraction(0)) + sign * c
    return [(c, term) for term, c in out.items() if c]


def _times_all(m: Monomial, product: tuple) -> Monomial:
    for name, _ in product:
        m = times(m, name)
    return m
