"""Activations of a chunk from a program set (estimator.programs, FORMATS 7): the composed walk of estimator.compose,
each segment's delta and peak replayed from its allocation program at the config's sizes.

The walk (the op structure, layers, experts, checkpoints, pipeline boundaries) is compose.ComposedCache's; only a
segment's values come from elsewhere: its program's events evaluated and replayed, never a fitted aggregate. The
evaluated events are kept, so the allocation stream (estimator.alloc_stream) takes the program's own tensors in
their own order rather than a decomposition of a byte count.
"""
from __future__ import annotations

from collections import ChainMap

from . import formulas as F
from .compose import ComposedCache


class ProgramCache(ComposedCache):
    """Per-(set, config) evaluation of a program set: segment values per (label, switches), memoised."""

    def __init__(self, fset: F.FormulaSet, cfg):
        super().__init__(fset, cfg)
        self.programs = fset.programs
        self._by_label = {label: True for label in self.programs.labels()}
        self._events: dict = {}    # id(values) -> (values, (fwd, bwd) cells, env), then (values, (fwd, bwd) events)

    def _evaluate(self, label: str, sw: dict, tokens: float = 1.0, first: bool = False,
                  instance: str | None = None) -> tuple:
        """Each phase from the program of the label's cell matching sw (measured where its runs had each of sw's
        values; the highest of alternatives); where none matches, the highest replay among the nearest cells
        (fewest differing switch values), extrapolated."""
        env = self.env if tokens == 1.0 else ChainMap({"k": self.env["k"] * tokens}, self.env)
        out: list = []
        cells: list = []
        measured = True
        for phase in ("fwd", "bwd"):
            cell, dp, ok = self.programs.answer(phase, label, sw, env, first, instance)
            out += list(dp)
            measured = measured and ok
            cells.append(cell)
        # sizes fitted where one of the label's shape variables never moved hold at that value only
        pinned = self.programs.fixed.get(label)
        if pinned and any(self.env[v] != x for v, x in pinned.items()):
            measured = False
        values = (*out, measured)
        self._events[id(values)] = (values, cells, env)    # evaluated by events(), which only the reserved model asks
        return values

    def events(self, values: tuple):
        """(forward, backward) events [(op, bytes, ref)] of the programs behind `values` (what values() returned),
        in order; None where `values` did not come from this cache (a walk adjusted them: compose._defer_frees)."""
        hit = self._events.get(id(values))
        if hit is None or hit[0] is not values:
            return None
        if len(hit) == 3:   # first ask: evaluate once
            hit = self._events[id(values)] = (values, tuple(c.evaluated(hit[2]) if c is not None else []
                                                            for c in hit[1]))
        return hit[1]

    def parts(self, values: tuple) -> tuple:
        return (None,) * 4
