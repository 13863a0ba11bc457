"""Exact size formulas: one allocation's bytes over a cell's runs as the sparsest small sum of monomials.

A tensor's size is a product of its shape and its element size, so across runs that differ in shapes an
allocation's bytes are one monomial in the sharded shapes (`e*s*b*h/st`), or a few where a tensor concatenates
(`e*s*b*(a+2g)*d/t`). This solves each aligned allocation exactly: the fewest terms (one, two, three) from a
candidate list (fit.basis: the label's family of atoms, times `e` and bare, then every family's atoms) whose
rational coefficients reproduce every run to the byte. Ties between equally sparse fits go to simpler
coefficients (integers, then small ones), then to the candidate order. Nothing is approximated: a size no
candidate sum reproduces is reported, naming the event and its runs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from fit.basis import FAMILIES, candidates, evaluate, parse_monomial, times

MAX_TERMS = 3
MAX_DENOMINATOR = 64


@dataclass(frozen=True)
class SizeFit:
    terms: tuple          # ((Fraction, monomial), ...); () is 0 bytes
    alternatives: int     # other fits as sparse that also reproduce every run (0: the data decide it)


def _all_atoms() -> list:
    seen, out = set(), []
    for atoms in FAMILIES.values():
        for a in atoms:
            m = parse_monomial(a)
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


_WIDE = None


def basis_for(label: str) -> list:
    """Candidate monomials for a label's allocations: its family first, then every other atom (times e, bare)."""
    global _WIDE
    if _WIDE is None:
        atoms = _all_atoms()
        _WIDE = [times(a, "e") for a in atoms] + atoms
    op = label.split("@")[0]
    own = candidates(op)
    return own + [m for m in _WIDE if m not in own]


class SizeSolver:
    """Fits the sizes of one cell's runs: `points` are the runs' variables (dicts of plain numbers)."""

    def __init__(self, label: str, points: list, known: list | None = None):
        self.points = points
        # formulas fitted on larger groups (of this label first, then of others), most supported first: a small
        # group's sizes take one of them where it reproduces every run, before any fresh search, whose sparse
        # fits on a few runs can be coincidences (`16*e*s*b*d` for a logits tensor of three runs)
        self.known = known or []
        basis = basis_for(label)
        own = set(candidates(label.split("@")[0]))
        cols = np.array([[float(evaluate(m, p)) if _defined(m, p) else np.nan for p in points] for m in basis]).T
        # columns equal on every run are one candidate to this data: keep the first (preferred) of each
        keep, seen = [], set()
        for j in range(len(basis)):
            col = cols[:, j]
            if np.isnan(col).any() or not np.any(col):
                continue
            key = tuple(np.round(col, 6))
            if key not in seen:
                seen.add(key)
                keep.append(j)
        self.basis = [basis[j] for j in keep]
        # three-term sums only over the label's own family: the wide list's triples are many, and a sum of three
        # arbitrary atoms fits a few runs by coincidence
        self.own = np.array([basis[j] in own for j in keep], bool)
        # variables every run has at one value carry no information: a monomial using them is a guess (k and the
        # expert sizes of dense runs, t = 1), so fits that need fewer of them are preferred (e aside: whether a
        # tensor scales with the element size is the natural guess for an activation)
        self.constant = {v for v in (points[0] if points else {})
                         if v != "e" and len({p.get(v) for p in points}) == 1}
        self.M = cols[:, keep] if keep else np.zeros((len(points), 0))
        self._memo: dict = {}

    def fit(self, ys: list, first: tuple | list = ()) -> SizeFit | None:
        """The exact fit of sizes ys (one per point), or None; `first`: formulas to try before the known ones."""
        key = (tuple(ys), tuple(first))
        if key not in self._memo:
            self._memo[key] = self._fit(np.array(ys, dtype=float), [int(y) for y in ys], list(first))
        return self._memo[key]

    def _fit(self, y: np.ndarray, exact: list, first: list) -> SizeFit | None:
        if not any(exact):
            return SizeFit((), 0)
        for terms in first + self.known:
            if all(_defined(m, p) for _, m in terms for p in self.points) and all(sum(c * evaluate(m, p) for c, m in terms) == yv for p, yv in zip(self.points, exact)):
                return SizeFit(terms, 0)
        n, N = self.M.shape
        for k in range(1, MAX_TERMS + 1):
            if k > N:
                break
            found = self._exact_k(k, y, exact)
            if found:
                found.sort(key=lambda f: f[0])
                return SizeFit(found[0][1], len(found) - 1)
            if k >= n:      # more terms than runs: any sum would fit; the data cannot decide
                break
        return None

    def _exact_k(self, k: int, y: np.ndarray, exact: list) -> list:
        n, N = self.M.shape
        M = self.M
        out = []
        if k == 1:
            with np.errstate(divide="ignore", invalid="ignore"):
                c = y[:, None] / M
            ok = np.all(np.isclose(c, c[:1], rtol=1e-9, atol=0), axis=0) & np.all(M != 0, axis=0)
            combos = [(j,) for j in np.flatnonzero(ok)]
        else:
            combos = []
            pool = range(N) if k < 3 else np.flatnonzero(self.own).tolist()
            idx = np.array(list(itertools.combinations(pool, k)))
            if len(idx) == 0:
                return []
            A = M[:, idx]                                   # n x C x k
            A = np.transpose(A, (1, 0, 2))                  # C x n x k
            # least squares per combination through the normal equations, then an exact check below
            At = np.transpose(A, (0, 2, 1))
            G = At @ A
            rhs = At @ y
            det = np.linalg.det(G)
            good = np.abs(det) > 1e-12 * np.abs(G).max(axis=(1, 2)) ** k
            if not good.any():
                return []
            sol = np.zeros((len(idx), k))
            sol[good] = np.linalg.solve(G[good], rhs[good][..., None])[..., 0]
            res = np.abs(np.einsum("cnk,ck->cn", A, sol) - y).max(axis=1)
            ok = good & (res <= 1e-6 * max(1.0, float(np.abs(y).max())))
            combos = [tuple(idx[c]) for c in np.flatnonzero(ok)]
            combos = combos[:200]
        for combo in combos:
            terms = self._rational(combo, exact)
            if terms is not None:
                guessed = sum(1 for _, m in terms for var, _ in m if var in self.constant)
                out.append(((guessed,) + _cost(terms, combo), terms))
        return out

    def _rational(self, combo: tuple, exact: list):
        """Exact rational coefficients for the monomials `combo`, solved on the first runs and checked on all."""
        monos = [self.basis[j] for j in combo]
        rows = [[evaluate(m, p) for m in monos] for p in self.points]
        coefs = _solve_exact(rows, exact)
        if coefs is None or any(c == 0 for c in coefs):
            return None
        if any(c.denominator > MAX_DENOMINATOR for c in coefs):
            return None
        for row, y in zip(rows, exact):
            if sum(c * v for c, v in zip(coefs, row)) != y:
                return None
        return tuple(zip(coefs, monos))


def _defined(m, p) -> bool:
    return all(var in p and (exp > 0 or p[var]) for var, exp in m)


def _solve_exact(rows: list, ys: list):
    """Coefficients c with rows @ c = ys over a set of independent rows (Gaussian elimination on Fractions)."""
    k = len(rows[0])
    chosen, basis_rows = [], []
    for i, r in enumerate(rows):
        trial = basis_rows + [r]
        if _rank(trial) == len(trial):
            basis_rows.append(r)
            chosen.append(i)
        if len(chosen) == k:
            break
    if len(chosen) < k:
        return None
    A = [list(rows[i]) + [Fraction(ys[i])] for i in chosen]
    for col in range(k):
        piv = next(r for r in range(col, k) if A[r][col] != 0)
        A[col], A[piv] = A[piv], A[col]
        for r in range(k):
            if r != col and A[r][col] != 0:
                f = A[r][col] / A[col][col]
                A[r] = [a - f * b for a, b in zip(A[r], A[col])]
    return [A[i][k] / A[i][i] for i in range(k)]


def _rank(rows: list) -> int:
    A = [list(r) for r in rows]
    rank, cols = 0, len(A[0])
    for col in range(cols):
        piv = next((r for r in range(rank, len(A)) if A[r][col] != 0), None)
        if piv is None:
            continue
        A[rank], A[piv] = A[piv], A[rank]
        for r in range(len(A)):
            if r != rank and A[r][col] != 0:
                f = A[r][col] / A[rank][col]
                A[r] = [a - f * b for a, b in zip(A[r], A[rank])]
        rank += 1
    return rank


def _cost(terms: tuple, combo: tuple) -> tuple:
    """Simpler first: integer coefficients, then small ones, then the candidate order."""
    fractional = sum(c.denominator != 1 for c, _ in terms)
    size = sum(abs(c.numerator) + c.denominator for c, _ in terms)
    return fractional, size, combo
