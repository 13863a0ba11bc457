"""Per op: choose which switches split the data into separate formulas, and fit each part.

Switches that enter through a variable (dtype through e, sequence parallelism through st) or not at all should
not split the data: one formula over both values is better determined. So, per op, switches are added greedily
(most likely first) until every part of the data split by them has a determined exact fit of its saved bytes;
transient peaks are then fitted on the same parts (a peak that stays undetermined is reported, not guessed). A formula's `when` lists every switch constant in its part: it
claims nothing about switch values it has not seen. A fit whose leave-one-out predictions miss is refused as
overfitted (exact byte counts leave no room for a formula that only interpolates).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from . import basis
from .dataset import METRICS, Sample
from .solve import Fit, FitRefused, bound_fit, fit_group, leave_one_out

# Switches most likely to change what an op saves come first, so ties between equally small S prefer them.
SWITCH_ORDER = ("attention", "recompute", "moe", "moe_comm", "activation", "position", "normalization", "gqa", "dropout",
                "sp", "dtype", "softmax_fp32", "tp")
MOE_VARS = ("E", "k", "fs", "ep")
NOT_ALIGNED = "points do not align"
LOO_EXACT_LIMIT = 1e-6      # an exact formula must predict held-out configs exactly (up to float printing)


@dataclass
class OpFormula:
    op: str
    per: str
    when: dict
    fits: dict                                   # metric -> Fit (metrics without data are absent)
    refused: dict = field(default_factory=dict)  # metric -> reason
    runs: list = field(default_factory=list)     # trace dirs of this part

    @property
    def ok(self) -> bool:
        """Writable: saved bytes are determined (an undetermined peak is left out and noted, not guessed)."""
        return "saved" in self.fits


def domain(when: dict) -> tuple[set, dict]:
    """Variables a `when` pins (fixed at their observed value, or tied to another variable)."""
    fixed, ties = set(), {}
    if "dtype" in when:
        fixed.add("e")
    if when.get("sp") is False:
        fixed.add("st")
    elif when.get("sp") is True:
        ties["st"] = "t"
    if when.get("tp") is False:     # no tensor parallelism: t (and with it st) is 1 throughout the part
        fixed.update(("t", "st"))
    if when.get("gqa") is False:
        ties["g"] = "a"
    if when.get("moe") is False:
        fixed.update(MOE_VARS)
        ties.update({"fe": "f", "etp": "t"})
    elif when.get("moe") is True and when.get("moe_comm") is False:
        fixed.update(("ep", "etp"))     # an expert group of one rank
    if when.get("mb1") is True:
        fixed.add("b")
    return fixed, ties


def constant_switches(samples: list[Sample]) -> dict:
    keys = [k for k in SWITCH_ORDER if all(k in s.switches for s in samples)]
    keys += sorted({k for s in samples for k in s.switches} - set(keys))
    return {k: samples[0].switches.get(k) for k in keys
            if all(s.switches.get(k) == samples[0].switches.get(k) for s in samples)}


class _OpFitter:
    def __init__(self, op: str, samples: list[Sample], peak_bound: float = 0.0, **kw):
        self.op, self.samples, self.kw, self.peak_bound = op, samples, kw, peak_bound
        self.cands = basis.candidates(op)
        self._cands_by_moe: dict = {}
        self.cache: dict = {}

    def cands_for(self, part: list[Sample]) -> list:
        """The op's candidates for a part: a part of MoE layers only, or of dense layers only, gets the layer
        basis of its kind (basis.candidates), which also keeps the exhaustive point search small."""
        moe = constant_switches(part).get("moe")
        if moe not in self._cands_by_moe:
            self._cands_by_moe[moe] = basis.candidates(self.op, moe)
        return self._cands_by_moe[moe]

    def fit_metric(self, part: list[Sample], metric: str):
        """Fit or refusal reason (str) for one metric of one part; None when the part has no such data."""
        key = (tuple(sorted(id(s) for s in part)), metric)
        if key not in self.cache:
            have = [s for s in part if s.values.get(metric) is not None]
            if not have:
                self.cache[key] = None
            elif all(s.points.get(metric) for s in have):
                r = self.fit_points(have, metric, part)
                if isinstance(r, str) and r.startswith(NOT_ALIGNED):
                    # The allocation pattern changes with the shapes (an MoE layer loops over its local experts):
                    # no point matches across configs, but the layer's maximum may still be one formula.
                    whole = self.fit_scalar(have, metric, part)
                    if isinstance(whole, Fit):
                        whole.notes.append(f"{r}: fitted as the layer's maximum, not per point")
                        r = whole
                    else:
                        r = f"{r}; as the layer's maximum: {whole}"
                self.cache[key] = r
            else:
                self.cache[key] = self.fit_scalar(have, metric, part)
        return self.cache[key]

    def fit_scalar(self, have: list[Sample], metric: str, part: list[Sample]):
        """One formula for the metric's value per config (a peak may be an upper bound: self.peak_bound)."""
        fixed, ties = domain(constant_switches(part))
        cands = self.cands_for(part)
        try:
            fit = fit_group([s.point for s in have], [s.values[metric] for s in have], cands, fixed=fixed,
                            ties=ties, bound=0.0 if metric == "saved" else self.peak_bound, **self.kw)
        except FitRefused as exc:
            return str(exc)
        fit.runs_used, fit.pins, fit.cands = sorted({s.run for s in have}), (fixed, ties), cands
        return fit

    def fit_points(self, have: list[Sample], metric: str, part: list[Sample]):
        """A transient measured per point (the layer op's: a maximum over allocation points whose dominant one
        changes with the shapes): one fit per point, the quantity being their maximum. Every point must be
        determined (exactly, or by the peak bound); points must align (same count on every config), or else
        align at both ends of the scope (fit_end_points)."""
        n = {len(s.points[metric][0]) for s in have}
        if len(n) != 1 and constant_switches(part).get("moe") is True:
            return self.fit_end_points(have, metric, part)
        if len(n) != 1:
            return _not_aligned(n)
        idx = [k for k in range(n.pop()) if any(s.points[metric][1][k] for s in have)]
        fixed, ties = domain(constant_switches(part))
        cands = self.cands_for(part)
        fits, dropped, failed = [], [], []
        for k in idx:
            try:
                fit = self.fit_point(have, metric, k, fixed, ties, cands)
            except FitRefused as exc:
                fit = self.bound_or_none(have, metric, k, fixed, ties, cands)
                if fit is None:
                    dropped.append(k)
                    if not low_point(have, metric, k):
                        failed.append(f"point {point_name(k)}: {exc}")
                    continue
            fits.append(fit)
        if not fits:
            return failed[0] if failed else "no point could be fitted"
        # A point no formula fits (e.g. a level that depends on whether a communication thread freed its buffer
        # just before) may be left out only while the fitted points reach the peak on every traced config.
        if failed and not all(covers_peaks(fits, s, metric) for s in have):
            return failed[0]
        return PointsFit(fits, sorted({s.run for s in have}), (fixed, ties), dropped=dropped, cands=cands)

    def fit_point(self, have: list[Sample], metric: str, k: int, fixed, ties, cands) -> Fit:
        """Exact fit of point k (a negative k counts from the scope's end) over the configs; FitRefused if none."""
        fit = fit_group([s.point for s in have], [s.points[metric][0][k] for s in have], cands,
                        fixed=fixed, ties=ties, bound=0.0, **{"exhaustive": POINT_EXHAUSTIVE, **self.kw})
        return _as_point(fit, have, k, fixed, ties, cands)

    def bound_or_none(self, have: list[Sample], metric: str, k: int, fixed, ties, cands) -> Fit | None:
        """Upper-bound fit (within self.peak_bound) of a point with no exact formula that sets some traced
        config's peak, else None. Such a level differs with thread timing: a gloo thread frees a communication
        buffer just before or just after the point's allocation (an EP all-to-all's before the first expert's,
        a sequence-parallel gather's before a weight gradient), so no shape formula fits it exactly."""
        if self.peak_bound <= 0 or not any(_argmax_at(s, metric, k) for s in have):
            return None
        try:
            fit = bound_fit([s.point for s in have], [s.points[metric][0][k] for s in have], cands,
                            self.peak_bound, [max(s.points[metric][0]) for s in have], **self.kw)
        except FitRefused:
            return None
        return _as_point(fit, have, k, fixed, ties, cands)

    def fit_end_points(self, have: list[Sample], metric: str, part: list[Sample]):
        """Points of scopes whose allocation count changes with the shapes (an MoE layer loops over its local
        experts): the first n and the last n allocations (n = the smallest count) are matched across configs
        from each end. Every such point that could hold the peak (above LOW_POINT of it on some config) and fits
        exactly is kept; the transient is accepted only if, on every traced config, the kept points reach the
        scope's maximum over all its points, the unmatched middle included (covers_peaks)."""
        counts = sorted({len(s.points[metric][0]) for s in have})
        fixed, ties = domain(constant_switches(part))
        cands = self.cands_for(part)
        fits = []
        for k in list(range(counts[0])) + [-j for j in range(1, counts[0] + 1)]:
            if low_point(have, metric, k):
                continue
            try:
                fits.append(self.fit_point(have, metric, k, fixed, ties, cands))
            except FitRefused:
                fit = self.bound_or_none(have, metric, k, fixed, ties, cands)
                if fit is not None:
                    fits.append(fit)
        missed = [s.run for s in have if not covers_peaks(fits, s, metric)]
        if missed:
            return (f"{_not_aligned(counts)}; matched from both ends, the fitted points miss the peak of "
                    f"{len(missed)} config(s)")
        return PointsFit(fits, sorted({s.run for s in have}), (fixed, ties), ends=counts, cands=cands)

    def formula(self, part: list[Sample], saved_from: list[Sample] | None = None) -> OpFormula:
        """The part's formula; `saved_from` (a superset) supplies the saved-bytes fit when peaks were split."""
        fits, refused = {}, {}
        for m in METRICS:
            r = self.fit_metric(saved_from if (m == "saved" and saved_from) else part, m)
            if isinstance(r, (Fit, PointsFit)):
                fits[m] = r
            elif r is not None:
                refused[m] = r
        per = "layer" if any(s.per == "layer" for s in part) else "model"
        return OpFormula(self.op, per, constant_switches(part), fits, refused, sorted({s.run for s in part}))

    def split(self, keys: tuple) -> list[list[Sample]]:
        return self._split(self.samples, keys)

    def covered(self, keys: tuple) -> int:
        """Configs whose part has a determined saved-bytes fit when split by `keys`."""
        return sum(len(p) for p in self.split(keys) if isinstance(self.fit_metric(p, "saved"), Fit))

    def run(self) -> list[OpFormula]:
        extra = sorted(set().union(*(s.switches for s in self.samples)) - set(SWITCH_ORDER))
        varying = [k for k in SWITCH_ORDER + tuple(extra)
                   if len({repr(s.switches.get(k)) for s in self.samples}) > 1]
        keys: tuple = ()
        cov = self.covered(keys)
        best = (cov, keys)
        while cov < len(self.samples):
            scored = [(self.covered(keys + (k,)), -i, k) for i, k in enumerate(varying) if k not in keys]
            if not scored:
                break
            c, _, k = max(scored)
            if c <= cov:
                # No single switch helps yet (two may have to split together): take the likeliest, go on.
                k = next(x for x in varying if x not in keys)
            keys += (k,)
            cov = self.covered(keys)
            if cov > best[0]:
                best = (cov, keys)
        keys = best[1]  # most configs covered, fewest switches: an unhelpful split only fragments refusals
        out = []
        for p in self.split(keys):
            leaves = self.refine_peaks(p, varying)
            # When peaks were split, keep the unsplit formula too: it still carries the saved bytes for switch
            # combinations no leaf covers (the estimator prefers the more specific leaves where they match).
            out.extend(([self.formula(p)] if len(leaves) > 1 else []) + leaves)
        return out

    def peaks_covered(self, parts: list[list[Sample]]) -> int:
        return sum(len(p) for p in parts
                   if all(not isinstance(self.fit_metric(p, m), str) for m in METRICS if m != "saved"))

    def refine_peaks(self, part: list[Sample], varying: list, saved_from: list[Sample] | None = None,
                     depth: int = 3) -> list[OpFormula]:
        """Transient peaks may depend on switches that saved bytes do not (CPU bf16 matmuls use fp32 scratch,
        sequence parallelism gathers): split the part by the switch that determines peaks for the most configs,
        recursively (up to `depth` switches), every piece sharing the part's saved-bytes fit."""
        saved_from = saved_from or part
        # MoE layers repeat allocations per local expert, so their counts differ even within one pattern;
        # points matched from both ends may still determine the whole part, which splitting would only thin out.
        whole = constant_switches(part).get("moe") is True and self.peaks_covered([part]) == len(part)
        split = None if whole else self.split_points(part, varying)
        if split is not None:
            return [f for p in split for f in self.refine_peaks(p, varying, saved_from, depth)]
        base = self.peaks_covered([part])
        if base == len(part) or depth == 0 or not isinstance(self.fit_metric(saved_from, "saved"), Fit):
            return [self.formula(part, saved_from=saved_from)]
        const = constant_switches(part)
        best = (base, None)
        for k in varying:
            if k in const:
                continue
            sub = self._split(part, (k,))
            cov = self.peaks_covered(sub)
            if cov > best[0]:
                best = (cov, sub)
        if best[1] is None:
            if any(s.points for s in part):
                # Per-point transients of one allocation pattern: more switches would only shrink the part.
                return [self.formula(part, saved_from=saved_from)]
            # No single switch helps; a pair might (e.g. dtype and sp): try the first still-varying switch.
            k = next((k for k in varying if k not in const), None)
            if k is None:
                return [self.formula(part, saved_from=saved_from)]
            best = (base, self._split(part, (k,)))
        return [f for p in best[1] for f in self.refine_peaks(p, varying, saved_from, depth - 1)]

    @staticmethod
    def _pattern(s: Sample) -> int | None:
        """The backward's allocation count: the layer's backward holds the peaks that matter (a forward point
        count that still differs within a part leaves only the forward transient undetermined)."""
        return len(s.points["bwd_peak"][0]) if "bwd_peak" in s.points else None

    def split_points(self, part: list[Sample], varying: list) -> list[list[Sample]] | None:
        """Per-point transients can only be matched between configs with the same allocation pattern: split a
        part whose configs differ in it by the switch that leaves the most configs in parts of one pattern
        (None when the part already has one pattern, or no switch helps)."""
        def homogeneous(parts):  # configs that share their part's most common pattern
            return sum(Counter(self._pattern(s) for s in p).most_common(1)[0][1] for p in parts)
        if not any(s.points for s in part) or homogeneous([part]) == len(part):
            return None
        const = constant_switches(part)
        best = (homogeneous([part]), None)
        for k in varying:
            if k in const:
                continue
            sub = self._split(part, (k,))
            cov = homogeneous(sub)
            if cov > best[0]:
                best = (cov, sub)
        return best[1]

    def _split(self, samples: list[Sample], keys: tuple) -> list[list[Sample]]:
        parts: dict = {}
        for s in samples:
            parts.setdefault(tuple(repr(s.switches.get(k)) for k in keys), []).append(s)
        return list(parts.values())


POINT_EXHAUSTIVE = 4  # every subset of up to 4 terms is tried per point (a point is one allocation pattern)
LOW_POINT = 0.5   # a point at most this fraction of the op's peak on every traced config never sets the peak


def low_point(have: list[Sample], metric: str, k: int) -> bool:
    """Point k stays at or below LOW_POINT of the op's peak (its largest point) on every config: the peak is
    set by other points throughout the traced domain, so a point no formula fits exactly is left out (and
    named in the fit's notes) rather than refusing the whole transient."""
    return all(s.points[metric][0][k] <= LOW_POINT * max(s.points[metric][0]) for s in have)


def _not_aligned(counts) -> str:
    return (f"{NOT_ALIGNED}: {sorted(counts)} allocations in the scope on different configs (the allocation "
            f"pattern changes within this part)")


def covers_peaks(fits: list, s: Sample, metric: str) -> bool:
    """The points of `fits` (their measured values on config s) reach s's largest point."""
    vals = s.points[metric][0]
    return bool(fits) and max(vals[f.point_index] for f in fits) == max(vals)


def _as_point(fit: Fit, have: list[Sample], k: int, fixed, ties, cands) -> Fit:
    """Tag a fit of point k with what leave-one-out and the notes need."""
    fit.runs_used, fit.pins, fit.cands = sorted({s.run for s in have}), (fixed, ties), cands
    fit.point_index = k
    return fit


def _argmax_at(s: Sample, metric: str, k: int) -> bool:
    vals = s.points[metric][0]
    return vals[k] == max(vals)


def point_name(k: int) -> str:
    """Point k as the notes show it: 1-based from the scope's start, or counted from its end."""
    return str(k + 1) if k >= 0 else f"{-k} from the end"


@dataclass
class PointsFit:
    """A transient that is the maximum over per-point fits (FORMATS 4: `<op>#<k>` point formulas)."""
    fits: list
    runs_used: list = field(default_factory=list)
    pins: tuple = ((), ())
    loo_max_rel_err: float | None = None
    loo_undetermined: int = 0
    dropped: list = field(default_factory=list)   # point indices left out (low_point)
    ends: list | None = None    # allocation counts, when points were matched from both ends (fit_end_points)
    cands: list | None = None   # the candidate monomials its points were fitted from (leave-one-out refits)

    @property
    def exact(self) -> bool:
        return all(f.exact for f in self.fits)

    @property
    def n_points(self) -> int:
        return max(f.n_points for f in self.fits)

    @property
    def max_abs_residual(self) -> float:
        return max(f.max_abs_residual for f in self.fits)

    @property
    def max_rel_residual(self) -> float:
        return max(f.max_rel_residual for f in self.fits)

    @property
    def notes(self) -> list:
        out = [f"point {point_name(f.point_index)}: {n}" for f in self.fits for n in f.notes]
        if self.ends:
            out.append(f"the scope allocates {self.ends} times on different configs: points matched from both "
                       f"ends, {len(self.fits)} fitted; on every traced config they reach the scope's peak (the "
                       f"unmatched middle stays below it); a config with more repeats than traced is extrapolated")
        if self.dropped and self.ends:
            out.append("left out (leave-one-out mispredicts them; the others still reach every traced peak): "
                       "point(s) " + ", ".join(point_name(k) for k in self.dropped))
        elif self.dropped:
            out.append(f"{len(self.fits)} point(s) fitted; left out (no determined formula, or one that "
                       f"leave-one-out mispredicts; at most {LOW_POINT:.0%} of the peak on every traced config, or "
                       f"below the fitted points' maximum on every traced config): allocation(s) "
                       + ", ".join(point_name(k) for k in self.dropped))
        return out

    @property
    def terms(self) -> list:
        return []   # the op's own quantity: 0, its points carry it

    def predict(self, point):
        return max(f.predict(point) for f in self.fits)

    def __str__(self) -> str:
        return "max(" + ", ".join(str(f) for f in self.fits) + ")"


def fit_op(op: str, samples: list[Sample], loo: bool = True, peak_bound: float = 0.0, **kw) -> list[OpFormula]:
    """Formulas (and refusals) for one op; with loo, each accepted fit gets its leave-one-out error and an
    exact fit that mispredicts a held-out config (or a bound fit off by more than twice the bound) is refused.
    peak_bound > 0 lets transient peaks fall back to an upper-bound fit (see solve.fit_group's `bound`)."""
    fitter = _OpFitter(op, samples, peak_bound, **kw)
    out = fitter.run()
    if loo:
        checked: dict = {}   # id(fit) -> refusal reason or None; peak-split parts share one saved-bytes fit
        for f in out:
            for m, fit in list(f.fits.items()):
                if id(fit) not in checked:
                    checked[id(fit)] = _loo_check(fit, m, samples, fitter.cands, peak_bound, kw)
                if checked[id(fit)]:
                    del f.fits[m]
                    f.refused[m] = checked[id(fit)]
    return out


def _loo_check(fit: Fit, metric: str, samples: list[Sample], cands, peak_bound: float, kw: dict) -> str | None:
    """Fill the fit's leave-one-out error; the refusal reason when it shows an overfit, else None."""
    fixed, ties = fit.pins
    cands = getattr(fit, "cands", None) or cands
    have = [s for s in samples if s.run in fit.runs_used and s.values.get(metric) is not None]
    if isinstance(fit, PointsFit):
        errs, und, keep = [], 0, []
        for f in fit.fits:
            k = f.point_index
            f.pins = fit.pins
            leave_one_out(f, [s.point for s in have], [s.points[metric][0][k] for s in have], cands,
                          scales=None if f.exact else [max(s.points[metric][0]) for s in have],
                          fixed=fixed, ties=ties, bound=0.0 if f.exact else peak_bound,
                          **{"exhaustive": POINT_EXHAUSTIVE, **kw})
            limit = LOO_EXACT_LIMIT if f.exact else max(2 * peak_bound, LOO_EXACT_LIMIT)
            unchecked = not f.exact and (f.loo_undetermined or f.loo_max_rel_err is None)   # a bound no fold checks
            if unchecked or (f.loo_max_rel_err is not None and f.loo_max_rel_err > limit):
                if low_point(have, metric, k) or fit.ends or len(fit.fits) > 1:   # coverage is checked below
                    fit.dropped.append(k)
                    continue
                if unchecked:
                    return (f"unchecked: point {point_name(k)}: the bound {f} leaves too few configs for leave-one-out "
                            f"to check it; add configs")
                return (f"overfitted: point {point_name(k)}: {f} fits all {f.n_points} configs but leave-one-out "
                        f"mispredicts a held-out one by {f.loo_max_rel_err:.1%}; add configs")
            keep.append(f)
            if f.loo_max_rel_err is not None:
                errs.append(f.loo_max_rel_err)
            und = max(und, f.loo_undetermined)
        fit.fits = keep
        if not keep:
            return "overfitted: no point survives leave-one-out"
        if fit.dropped and not all(covers_peaks(keep, s, metric) for s in have):
            return "overfitted: the points that survive leave-one-out miss a traced config's peak"
        fit.loo_max_rel_err, fit.loo_undetermined = (max(errs) if errs else None), und
        return None
    leave_one_out(fit, [s.point for s in have], [s.values[metric] for s in have], cands,
                  fixed=fixed, ties=ties, bound=0.0 if metric == "saved" else peak_bound, **kw)
    limit = LOO_EXACT_LIMIT if fit.exact else max(2 * peak_bound, LOO_EXACT_LIMIT)
    if fit.loo_max_rel_err is not None and fit.loo_max_rel_err > limit:
        return (f"overfitted: {fit} fits all {fit.n_points} configs but leave-one-out mispredicts a held-out "
                f"one by {fit.loo_max_rel_err:.1%}; add configs")
    return None


def fit_all(samples: list[Sample], ops: list[str] | None = None, **kw) -> list[OpFormula]:
    by_op: dict[str, list[Sample]] = {}
    for s in samples:
        by_op.setdefault(s.op, []).append(s)
    out = []
    for op in sorted(by_op) if ops is None else ops:
        out.extend(fit_op(op, by_op[op], **kw))
    return out


__all__ = ["OpFormula", "PointsFit", "fit_op", "fit_all", "domain", "Fit"]
