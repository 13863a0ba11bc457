"""A microbatch's forward and backward as a flat sequence of op segments (docs/FORMATS.md 3.1).

Composition needs every byte of a microbatch's timeline attributed to exactly one op, forward and backward, so
that a config never traced can be replayed from ops that were. A *segment* is a stretch of records that belongs to
one op's own code:

  forward   an op scope (`mod:`, `loss`, `data:`) with op children C1..Cn is cut at its children: its own code
            before C1 is segment `<op>`, between Ci and Ci+1 segment `<op>@<Ci>`, after Cn `<op>@<Cn>`; a leaf is one
            segment `<op>`. The microbatch's `fwd:` scope is the root op `step` (the forward step's own code:
            the model's root module and the loss function, which have no scope of their own).
  backward  the marks `bwd>path` (autograd reached the op's output) and `bwd<path` (its input's gradient is
            complete) written by tracer.scopes.mark_backward cut the microbatch's `bwd:` scope the same way:
            after `bwd>X` the records belong to X's own code after its last child (`X@<Cn>`, or `X` for a leaf),
            after `bwd<Ci` to its parent's code before Ci (`P@<Ci-1>`, or `P` before the first child). So a
            backward segment carries the label of the forward segment whose autograd nodes it runs.

Each segment has `delta` (live bytes at its end minus at its start) and `peak` (the highest live level inside it
minus the level at its start). Replaying a phase's segments in order from its entry level reproduces every level
the trace reached inside that phase, exactly: the segments partition the phase's records.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator.compose import own_label

from .parse import (K_BWD, K_DATA, K_FWD, K_ITER, K_LOSS, K_MOD, ParsedRank, _classify_name, inherit, iteration_of,
                    normalise_op)

ROOT = "step"
_OP_KINDS = (K_MOD, K_LOSS, K_DATA)


@dataclass
class Segment:
    phase: str          # "fwd" | "bwd"
    iteration: int
    microbatch: int
    chunk: int | None
    label: str          # `<op>` or `<op>@<child op>`
    layer: int | None   # the layer the segment's op belongs to (None outside layers)
    start: int          # record index of the boundary it starts at (its entry level is live[start])
    end: int            # record index of the boundary it ends at
    delta: int
    peak: int


def _chunk_of(name: str) -> tuple[int, int | None]:
    rest = name.split(":", 1)[1]
    mb, _, c = rest.partition(":c")
    return int(mb), (int(c) if c.isdigit() else None)


def _node(pr: ParsedRank, row: int) -> tuple[str, int | None]:
    _, _, op, layer = _classify_name(pr.scope_name(row))
    return op, layer


def _op_children(sc) -> dict[int, list[int]]:
    """Scope row -> its op-scope children rows in push order (the nearest op or fwd scope is the parent)."""
    is_op = np.isin(sc.kind, _OP_KINDS)
    op_parent = _op_parents(sc, is_op)
    children: dict[int, list[int]] = {}
    for row in np.flatnonzero(is_op):
        children.setdefault(int(op_parent[row]), []).append(int(row))
    return children


def rank_segments(pr: ParsedRank) -> list[Segment]:
    """Every forward and backward segment of one parsed rank, in record order per phase instance."""
    sc = pr.scopes
    if len(sc.open) == 0:
        return []
    it_row = inherit(sc, sc.kind == K_ITER)
    out: list[Segment] = []
    tree: dict = {}     # (op, layer) -> (parent (op, layer), [children (op, layer)]) from the forward scopes
    children = _op_children(sc)
    live = pr.live
    for row in np.flatnonzero(sc.kind == K_FWD):
        row = int(row)
        it = iteration_of(pr, int(it_row[row]))
        mb, chunk = _chunk_of(pr.scope_name(row))
        cuts: list[tuple[int, str, int | None]] = []   # (boundary record, label of what follows, layer)
        _walk(pr, row, (ROOT, None), children, cuts, tree)
        cuts.append((int(sc.close[row]), "", None))
        out += _segments("fwd", it, mb, chunk, cuts, live)
    bwd_rows = np.flatnonzero(sc.kind == K_BWD)
    if len(bwd_rows):
        marks = [(i, nm) for i, _, nm in pr.marks if nm.startswith(("bwd>", "bwd<"))]
        mark_at = np.array([i for i, _ in marks], np.int64)
        for row in bwd_rows:
            row = int(row)
            name = pr.scope_name(row)
            if not name.split(":", 1)[1].split(":")[0].isdigit():
                continue
            it = iteration_of(pr, int(it_row[row]))
            mb, chunk = _chunk_of(name)
            o, c = int(sc.open[row]), int(sc.close[row])
            lo, hi = np.searchsorted(mark_at, [o, c])
            # The backward starts in the step's own code after its last op (the loss function's backward).
            cuts = [(o, *_after_entering((ROOT, None), tree))] + _backward_cuts(marks[lo:hi], tree, live)
            cuts.append((c, "", None))
            out += _segments("bwd", it, mb, chunk, cuts, live)
    return out


def _op_parents(sc, is_op: np.ndarray) -> np.ndarray:
    """For each scope row, the nearest op-scope (or fwd-scope) ancestor row, -1 if none."""
    nearest = inherit(sc, is_op | (sc.kind == K_FWD))   # innermost anchor, the row itself included
    out = np.full(len(sc.open), -1, np.int64)
    ok = sc.parent >= 0
    out[ok] = nearest[sc.parent[ok]]
    return out


def _walk(pr: ParsedRank, row: int, node: tuple, children: dict, cuts: list, tree: dict) -> None:
    """Cuts of scope `row` (op node `node`) and its op descendants, in record order."""
    sc = pr.scopes
    op, layer = node
    cuts.append((int(sc.open[row]), op, layer))
    kids = children.get(row, [])
    names = []
    for k in kids:
        kid = _node(pr, k)
        names.append(kid)
        _walk(pr, k, kid, children, cuts, tree)
        cuts.append((int(sc.close[k]), own_label(op, kid[0]), layer))
    if node not in tree or len(tree[node][1]) < len(names):
        parent = tree.get(node, (None, []))[0]
        tree[node] = (parent, names)
    for kid in names:
        tree[kid] = (node, tree.get(kid, (None, []))[1])


def _backward_cuts(marks: list, tree: dict, live: np.ndarray) -> list:
    """Cuts of one backward from its marks. Marks with no memory event between them fall on one moment; they
    are applied leaving ops innermost first, then entering ops outermost first, so a module sharing its output's
    grad_fn with its last child ends up in the child."""
    depth = {}

    def depth_of(node):
        d = depth.get(node)
        if d is None:
            d, p = 0, tree.get(node, (None,))[0]
            while p is not None and d < 64:
                d, p = d + 1, tree.get(p, (None,))[0]
            depth[node] = d
        return d

    cuts = []
    i = 0
    while i < len(marks):
        j = i + 1
        while j < len(marks) and _no_memory_between(marks[j - 1][0], marks[j][0], live):
            j += 1
        group = [(nm[4:], nm[:4]) for _, nm in marks[i:j]]
        leave = sorted((normalise_op(p) for p, k in group if k == "bwd<"), key=lambda n: -depth_of(n))
        enter = sorted((normalise_op(p) for p, k in group if k == "bwd>"), key=depth_of)
        label = None
        for node in leave:
            label = _after_leaving(node, tree)
        for node in enter:
            label = _after_entering(node, tree)
        if label is not None:
            cuts.append((marks[j - 1][0], label[0], label[1]))
        i = j
    return cuts


def _no_memory_between(a: int, b: int, live: np.ndarray) -> bool:
    # Marks are records too: no memory event between two marks means every record between them left the level
    # unchanged (a malloc and a free of the same size in between is also a moment without a net change; close
    # enough: such a pair would be a zero-length transient).
    return bool((live[a:b + 1] == live[a]).all())


def _after_entering(node: tuple, tree: dict) -> tuple:
    op, layer = node
    kids = tree.get(node, (None, []))[1]
    return (own_label(op, kids[-1][0]) if kids else op), layer


def _after_leaving(node: tuple, tree: dict) -> tuple:
    parent = tree.get(node, ((ROOT, None),))[0] or (ROOT, None)
    sibs = tree.get(parent, (None, []))[1]
    k = sibs.index(node) if node in sibs else 0
    return (own_label(parent[0], sibs[k - 1][0]) if k > 0 else parent[0]), parent[1]


def _segments(phase: str, it: int, mb: int, chunk, cuts: list, live: np.ndarray) -> list[Segment]:
    out = []
    for (a, label, layer), (b, _, _) in zip(cuts, cuts[1:]):
        if b < a:
            continue
        base = int(live[a])
        out.append(Segment(phase, it, mb, chunk, label, layer, a, b, int(live[b]) - base,
                           int(live[a:b + 1].max()) - base))
    return out


def op_children(pr: ParsedRank) -> dict[str, list[str]]:
    """op -> its op children in forward order (a run of one op, the decoder's layers, counted once), read from
    the first forward of the last iteration: the structure a composed estimate replays (FORMATS 4.1)."""
    sc = pr.scopes
    fwd = [int(r) for r in np.flatnonzero(sc.kind == K_FWD)]
    if not fwd:
        return {}
    it_row = inherit(sc, sc.kind == K_ITER)
    last = max(iteration_of(pr, int(it_row[r])) for r in fwd)
    row = next(r for r in fwd if iteration_of(pr, int(it_row[r])) == last)
    tree: dict = {}
    _walk(pr, row, (ROOT, None), _op_children(sc), [], tree)
    out: dict[str, list[str]] = {}
    for (op, _), (_, kids) in tree.items():
        names = []
        for kop, _ in kids:
            if not names or names[-1] != kop:
                names.append(kop)
        out.setdefault(op, names)
    return out
