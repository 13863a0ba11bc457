"""The estimate's JSON document as text, byte for byte `dumps_indent1(report.to_json(r))`, at a cost flat in scale.

At 100,000 GPUs the document is over 100 MB, nearly all of it per-rank records, group member lists and per-rank
communication bytes. Ranks of one pipeline stage share everything but their coordinates, and member lists recur
(one stage's ranks issue many collectives), so those parts are written from per-stage templates and from lists
rendered once each with C-level joins; the small rest goes through the ordinary writer, with a placeholder string
where each large part goes.
"""
from __future__ import annotations

import re
from itertools import chain, groupby

from estimator import report as R


def json_text(report) -> str:
    return "".join(json_chunks(report))


def json_chunks(report) -> list[str]:
    """json_text in pieces, to be written one after the other (no copy of the whole document)."""
    from estimator.cli import dumps_indent1  # the ordinary writer (cli imports this module)
    parts: list[tuple[int, object]] = []   # (indent level, renderer) per placeholder

    def hole(level: int, render) -> str:
        parts.append((level, render))
        return f"\0memtrace:{len(parts) - 1}\0"

    lists = _Lists()
    layout = report.layout
    groups = {k: hole(2, lambda lv, v=v: lists.nested(v, lv)) for k, v in layout.groups.items()}
    comm = _communication(report, hole, lists)
    doc = R.to_json(report, ranks=hole(1, lambda lv: _ranks(report, lv, dumps_indent1)), groups=groups,
                    communication=comm)
    # The skeleton is small; each placeholder string in it is replaced by its part, rendered at its level.
    pieces = _HOLE.split(dumps_indent1(doc))
    if sorted(pieces[1::2]) != sorted(str(i) for i in range(len(parts))):
        # an input string that reads as a placeholder (NUL characters): write the document the plain way
        return [dumps_indent1(R.to_json(report))]
    for i in range(1, len(pieces), 2):
        level, render = parts[int(pieces[i])]
        pieces[i] = render(level)
    return pieces


_HOLE = re.compile(r'"\\u0000memtrace:(\d+)\\u0000"')


def _communication(report, hole, lists):
    """report.comm.to_dict() with its large members left as placeholders."""
    comm = report.comm
    classes = comm.stage_classes()
    if classes is None:  # rows not made of whole stages: written the ordinary way
        return comm.to_dict()
    stage_of, per_stage, _ = classes
    rows = []
    for c in comm.collectives:
        d = c.to_dict()
        d["groups"] = hole(4, lambda lv, v=c.groups: lists.nested(v, lv))
        d["ranks"] = hole(4, lambda lv, v=c.ranks: lists.ints(v, lv))
        rows.append(d)
    return {"order": comm.layout.order,
            "groups": {k: hole(3, lambda lv, v=v: lists.nested(v, lv)) for k, v in comm.layout.groups.items()},
            "summary": comm.summary(),
            "per_rank_bytes_per_iteration": hole(2, lambda lv: _per_rank_bytes(stage_of, per_stage, lv)),
            "collectives": rows, "notes": list(comm.notes)}


def _nl(level: int) -> str:
    return "\n" + " " * level


class _Lists:
    """Lists of ints, and lists of them, as indented JSON; each distinct list object rendered once per level."""

    def __init__(self):
        self._done: dict = {}

    def ints(self, v: list, level: int) -> str:
        key = (id(v), level)
        hit = self._done.get(key)
        if hit is None:
            inner = _nl(level + 1)
            text = "[" + inner + ("," + inner).join(map(str, v)) + _nl(level) + "]" if v else "[]"
            hit = self._done[key] = (text, v)  # v kept: its id stays unique while cached
        return hit[0]

    def nested(self, v: list, level: int) -> str:
        key = (id(v), level)
        hit = self._done.get(key)
        if hit is None:
            hit = self._done[key] = (self._nested(v, level), v)
        return hit[0]

    def _nested(self, v: list, level: int) -> str:
        if not v:
            return "[]"
        inner = _nl(level + 1)
        n = len(v[0])
        if n and len(set(map(len, v))) == 1:
            # Groups of one size (every kind but embedding groups): one template, one C-level format call.
            deep = _nl(level + 2)
            one = "[" + deep + ("," + deep).join(["{}"] * n) + inner + "]"
            return "[" + inner + ("," + inner).join([one] * len(v)).format(*chain.from_iterable(v)) + _nl(level) + "]"
        return "[" + inner + ("," + inner).join([self.ints(g, level + 1) for g in v]) + _nl(level) + "]"


def _template(dumps, obj, level: int, slots: dict) -> str:
    """dumps(obj) at `level` as a str.format template: each value in `slots` (placeholder -> field) becomes a field."""
    text = dumps(obj).replace("\n", _nl(level)).replace("{", "{{").replace("}", "}}")
    for token, fieldname in slots.items():
        text = text.replace(dumps(token), "{" + fieldname + "}")
    return text


def _ranks(report, level: int, dumps) -> str:
    """The `ranks` list: one template per stage, filled with each rank's coordinates, one format call for each run
    of consecutive ranks of one stage (the whole stage in megatron's default rank order)."""
    cols = report.layout.columns
    if not cols["rank"]:
        return "[]"
    keys = ("rank", "name", "tp", "cp", "ep", "dp", "pp", "etp", "edp")   # the order rank_record writes them in
    slot = {f"\0{k}\0": "" for k in keys}
    templates = {}
    for p, r in R._stage_of_rank(report).items():
        rec = R.rank_record(_Coords(), r)
        rec["rank"], rec["name"] = "\0rank\0", "\0name\0"
        rec["coords"] = {k: f"\0{k}\0" for k in rec["coords"]}
        templates[p] = _template(dumps, rec, level + 1, slot)   # fields "{}", filled in the order of `keys`
    from estimator.jsonload import encode_string
    names = list(map(encode_string, cols["name"]))
    inner = _nl(level + 1)
    out, lo = [], 0
    for p, run in groupby(cols["pp"]):
        n = len(list(run))
        args = zip(cols["rank"][lo:lo + n], names[lo:lo + n], *(cols[k][lo:lo + n] for k in keys[2:]))
        out.append(("," + inner).join([templates[p]] * n).format(*chain.from_iterable(args)))
        lo += n
    return "[" + inner + ("," + inner).join(out) + _nl(level) + "]"


class _Coords:
    """A stand-in RankCoords for rendering a template: its values are replaced by slots."""
    rank = name = tp = cp = ep = dp = pp = etp = edp = 0


def _per_rank_bytes(stage_of: list, per_stage: list, level: int) -> str:
    """{"<rank>": {dim: bytes}} for every rank, each value its stage's."""
    if not stage_of:
        return "{}"
    from estimator.cli import dumps_indent1
    values = [dumps_indent1(d).replace("\n", _nl(level + 1)) for d in per_stage]
    inner = _nl(level + 1)
    body = ("," + inner).join([f'"{r}": {values[p]}' for r, p in enumerate(stage_of)])
    return "{" + inner + body + _nl(level) + "}"
