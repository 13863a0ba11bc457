"""Program sets: per segment label and phase, the allocation program of each cell (docs/FORMATS.md section 7).

A program is the ordered allocations and frees of one op's own code in one phase, each allocation's size a small
sum of monomials in the sharded shapes (`e*s*b*h/st`), each free naming the allocation it releases. Replaying a
program at a config's sizes gives the segment's delta and peak: nothing aggregate is stored, so a peak (a maximum
over moments) is never fitted. This module reads, checks and evaluates such a set; it imports no torch.

Events, one string each:
  `+ SIZE`             an allocation
  `- SIZE REF`         a free of an allocation made elsewhere (REF: `fwd:<label>#j`, `fwd:<label>[-1]#j` for the
                       layer before, `outside` for one made outside every segment)
  `- SIZE REF xCOUNT`  such a free repeated COUNT times (`xE/ep`: once per local expert, a SequentialMLP's
                       backward freeing each expert's share of the tokens)
  `- #j`               a free of this program's j-th allocation
  `+~ SIZE ~k`, `-~ ~k` another thread's allocation and free (gloo's worker on CPU), placed at the widest window
                       the traces showed: a bound that errs high
SIZE is `e*s*b*h/st`, `2*e*h*f/t+e*h`, `3/2*s*b`, or `0`; the variables are those of estimator.formulas.VARIABLES.

The set carries a checksum of its content (sha256 of the canonical JSON without it), checked on load: a changed
coefficient is an error, not a wrong answer.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .formulas import PROGRAM_FORMAT, VARIABLES

FORMAT = PROGRAM_FORMAT
VERSION = 1
_ABSENT = object()    # a switch the config does not have (a key of ProgramSet.choose's memo)
OPS = ("+", "-", "+~", "-~")


class ProgramError(ValueError):
    pass


Terms = Tuple[Tuple[Fraction, Tuple[Tuple[str, int], ...]], ...]


@dataclass(frozen=True)
class ProgramEvent:
    op: str
    terms: Optional[Terms]     # None: a free of a local allocation (its size)
    ref: str
    count: Optional[Terms] = None   # a free of another segment's allocation repeated this many times (None: once)


@dataclass
class ProgramCell:
    phase: str
    label: str
    when: List[Dict[str, Any]]
    events: List[ProgramEvent]
    seen: Any = field(default_factory=dict)     # per `when` dict (a list) or for all of them (a dict): switch -> values
    runs: int = 0
    first: bool = False     # the model's first layer's program ("layer": "first"), which frees what only it holds
    instance: Optional[str] = None   # "first" | "last" of a label's repeated instances in one call (local experts)
    _plan: Optional[list] = field(default=None, repr=False, compare=False)   # signed()'s events, made once

    def matches(self, sw: Mapping[str, Any]) -> bool:
        return self.entry(sw) is not None

    def entry(self, sw: Mapping[str, Any]) -> Optional[int]:
        """The index of the first `when` dict that sw matches, or None."""
        for i, cell in enumerate(self.when):
            if all(sw.get(k) == v for k, v in cell.items()):
                return i
        return None

    def seen_of(self, i: int) -> Dict[str, list]:
        return self.seen[i] if isinstance(self.seen, list) else self.seen

    def covers(self, sw: Mapping[str, Any]) -> bool:
        """The matching `when` dict's runs had every switch value of the config (so the program was measured
        there)."""
        i = self.entry(sw)
        return i is not None and not self._uncovered(i, sw)

    def _uncovered(self, i: int, sw: Mapping[str, Any]) -> int:
        return sum(1 for k, vals in self.seen_of(i).items() if k in sw and sw[k] not in vals)

    def distance(self, sw: Mapping[str, Any]) -> int:
        """Fewest switch values of the config that one of its `when` dicts' runs did not have."""
        return min(sum(sw.get(k) != v for k, v in cell.items())
                   + sum(1 for k, vals in self.seen_of(i).items() if k in sw and k not in cell and sw[k] not in vals)
                   for i, cell in enumerate(self.when))

    def signed(self, env: Mapping[str, float]) -> List[float]:
        """The events as signed byte counts at a config's variables."""
        plan = self._plan
        if plan is None:
            plan = self._plan = _plan(self.events)
        sizes: List[float] = []
        out = []
        for kind, terms, arg in plan:
            if kind == _LOCAL_FREE:
                out.append(-sizes[arg])
                continue
            # a tensor has no negative size: a formula fitted on a few runs (a kernel's block-rounded workspace) can
            # go below zero far from them
            size = 0.0
            for c, mono in terms:
                for var, exp in mono:
                    c *= env[var] ** exp
                size += c
            if size < 0.0:
                size = 0.0
            if kind == _ALLOC:
                sizes.append(size)
                out.append(size)
            elif arg is None:
                out.append(-size)
            else:
                out.append(-size * max(int(round(value(arg, env))), 0))
        return out

    def qualifier(self) -> str:
        return "layer:first" if self.first else f"instance:{self.instance}" if self.instance else ""

    def evaluated(self, env: Mapping[str, float]) -> List[Tuple[str, float, str]]:
        """The events as (op, bytes, ref) at a config's variables (a local free with its allocation's bytes, a
        repeated free once per repeat)."""
        out = []
        for ev, x in zip(self.events, self.signed(env)):
            n = repeats(ev, env)
            out += [(ev.op, (-x if x < 0 else x) / n, ev.ref)] * n if n > 1 else [(ev.op, -x if x < 0 else x, ev.ref)]
        return out

    def delta_peak(self, env: Mapping[str, float]) -> Tuple[float, float]:
        level = peak = 0.0
        for x in self.signed(env):
            level += x
            peak = max(peak, level)
        return level, peak


@dataclass
class ProgramSet:
    name: str
    kind: str
    description: str
    cells: List[ProgramCell]
    structure: list
    checksum: str
    path: Optional[str] = None
    backends: List[str] = field(default_factory=list)    # what ran the traces: "cuda", "cpu-hook"
    traced: List[Dict[str, Any]] = field(default_factory=list)   # distinct structure-switch values of the runs
    # per label, the shape variables of its family that had one value in every run of it: its sizes are pinned
    # there only, so a config with another value is extrapolated, not measured (FORMATS 7)
    fixed: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # a set profiled from one job (fit.job_campaign): the device, kernels and versions its runs had, so an estimate
    # with it predicts runs of that stack (a CPU-profiled set, CPU runs of those kernels); {} for the shipped sets
    profiled: Dict[str, Any] = field(default_factory=dict)
    _by_key: Dict[Tuple[str, str], List[ProgramCell]] = field(default_factory=dict, repr=False)
    # per label, the switches its cells' `when` and `seen` name: the only ones its choice of cells depends on
    _keys: Dict[str, Tuple[str, ...]] = field(default_factory=dict, repr=False)
    _chosen: Dict[tuple, tuple] = field(default_factory=dict, repr=False)   # choose()'s answers, memoised

    def __post_init__(self):
        keys: Dict[str, set] = {}
        for c in self.cells:
            self._by_key.setdefault((c.phase, c.label) + ((c.qualifier(),) if c.qualifier() else ()), []).append(c)
            names = keys.setdefault(c.label, set())
            for i, w in enumerate(c.when):
                names.update(w)
                names.update(c.seen_of(i))
        self._keys = {label: tuple(sorted(names)) for label, names in keys.items()}

    def labels(self) -> List[str]:
        return sorted({key[1] for key in self._by_key})

    def select(self, phase: str, label: str, sw: Mapping[str, Any], first: bool = False,
               instance: Optional[str] = None) -> Tuple[List[ProgramCell], bool]:
        """(the cells answering the label's phase under switches sw, measured: their runs had each of sw's values).
        More than one where runs of one switch combination had several event structures that no switch explains
        (a kernel that picks its workspace by shape): alternatives, of which the caller takes the highest. Where no
        cell matches: ([], False), and the nearest cells (fewest differing switch values) are the candidates."""
        cells = []
        if instance:    # the first / last repeated instance's own programs where the set has them for sw
            cells = [c for c in self._by_key.get((phase, label, f"instance:{instance}"), []) if c.matches(sw)]
        if first and not cells:   # the first layer's own programs likewise, else the label's
            cells = [c for c in self._by_key.get((phase, label, "layer:first"), []) if c.matches(sw)]
        if not cells:
            cells = [c for c in self._by_key.get((phase, label), []) if c.matches(sw)]
        return cells, bool(cells) and all(c.covers(sw) for c in cells)

    def nearest(self, phase: str, label: str, sw: Mapping[str, Any], qualifier: tuple = ()) -> List[ProgramCell]:
        """The label's cells (of the qualifier's group: the first layer's, an instance's, or the general ones)
        with the fewest switch values their runs did not have."""
        cells = self._by_key.get((phase, label) + qualifier, [])
        if not cells:
            return []
        d = [c.distance(sw) for c in cells]
        return [c for c, x in zip(cells, d) if x == min(d)]

    def choose(self, phase: str, label: str, sw: Mapping[str, Any], first: bool = False,
               instance: Optional[str] = None) -> Tuple[List[ProgramCell], bool]:
        """select()'s cells, else the nearest cells (not measured); memoised on the switches the label's cells
        name, as an estimate asks the same few dozen questions once per layer and a search once per layout."""
        key = (phase, label, first, instance) + tuple(sw.get(k, _ABSENT) for k in self._keys.get(label, ()))
        hit = self._chosen.get(key)
        if hit is None:
            cells, measured = self.select(phase, label, sw, first, instance)
            if not cells:
                cells, measured = self.nearest(phase, label, sw), False
            hit = self._chosen[key] = (cells, measured)
        return hit

    def answer(self, phase: str, label: str, sw: Mapping[str, Any], env: Mapping[str, float], first: bool = False,
               instance: Optional[str] = None) -> Tuple[Optional[ProgramCell], Tuple[float, float], bool]:
        """(the program taken for the label's phase, its (delta, peak) at env, measured: the matching cell's runs had
        each of the config's switch values). Among alternatives, or where no cell matches among the nearest cells,
        the one whose replay peaks highest (then the largest delta): a bound that errs high. A matching cell whose
        runs lacked a value still answers (its structure is the config's: other cells' programs, mixed label by
        label, would not free what they allocate), counted as not measured. (None, (0, 0), True) where the label
        never has that phase."""
        cells, measured = self.choose(phase, label, sw, first, instance)
        if not cells:
            return None, (0.0, 0.0), True
        if len(cells) == 1:
            return cells[0], cells[0].delta_peak(env), measured
        scored = [(c.delta_peak(env), i) for i, c in enumerate(cells)]
        (dp, i) = max(scored, key=lambda x: (x[0][1], x[0][0], -x[1]))
        return cells[i], dp, measured


def repeats(ev: ProgramEvent, env: Mapping[str, float]) -> int:
    """How many times a free repeats at a config (at least 0)."""
    return 1 if ev.count is None else max(int(round(value(ev.count, env))), 0)


_ALLOC, _FREE, _LOCAL_FREE = 0, 1, 2


def _plan(events: List[ProgramEvent]) -> list:
    """A cell's events as signed() walks them: (kind, float terms, arg), where arg is a local free's index into the
    program's sizes (another thread's allocations count as the program's, so `-~ ~k` is a local free too) or a
    free's repeat count (None: once). Float coefficients: a Fraction per term per estimate costs more than the
    rest of the walk."""
    out: list = []
    n = 0
    allocs: List[int] = []     # `#j` -> the j-th `+` allocation's place among the sizes
    workers: Dict[str, int] = {}
    for ev in events:
        if ev.terms is None:
            out.append((_LOCAL_FREE, None, allocs[int(ev.ref[1:])] if ev.op == "-" else workers[ev.ref]))
            continue
        terms = tuple((float(c), mono) for c, mono in ev.terms)
        if ev.op in ("+", "+~"):
            if ev.op == "+":
                allocs.append(n)
            else:
                workers[ev.ref] = n
            out.append((_ALLOC, terms, n))
            n += 1
        else:
            out.append((_FREE, terms, ev.count))
    return out


# ---------------------------------------------------------------- text <-> terms

def value(terms: Terms, env: Mapping[str, float]) -> float:
    total = 0.0
    for c, mono in terms:
        x = float(c)
        for var, exp in mono:
            x *= env[var] ** exp
        total += x
    return total


def parse_size(text: str, where: str = "") -> Terms:
    """'e*s*b*h/st+4*b*a*s*s/t' -> terms; '0' -> (). A malformed size or an unknown variable is a ProgramError."""
    text = text.strip()
    if text == "0":
        return ()
    parts, sign, start = [], 1, 0
    if text[:1] == "-":
        sign, start = -1, 1
    for i in range(start, len(text)):
        if text[i] in "+-":
            parts.append((sign, text[start:i]))
            sign, start = (1 if text[i] == "+" else -1), i + 1
    parts.append((sign, text[start:]))
    return tuple(_term(sgn, part, where or text) for sgn, part in parts)


def _term(sign: int, part: str, where: str):
    """'3*e*s*b/2*t': integers before '/' multiply the coefficient, after it divide it; names are variables."""
    num, _, den = part.partition("/")
    coef = Fraction(sign)
    exps: Dict[str, int] = {}
    for factors, exp in ((num.split("*"), 1), (den.split("*") if den else [], -1)):
        for f in factors:
            f = f.strip()
            if f.isdigit() and int(f) > 0:
                coef = coef * int(f) if exp > 0 else coef / int(f)
            elif f in VARIABLES:
                exps[f] = exps.get(f, 0) + exp
            else:
                raise ProgramError(f"{where}: malformed size term {part!r}" if not f or f.isdigit()
                                   else f"{where}: unknown variable {f!r} in size {part!r}")
    return coef, tuple(sorted((k, v) for k, v in exps.items() if v))


def format_size(terms) -> str:
    """Terms (coef, monomial) -> 'e*s*b*h/st+4*b*a*s*s/t' (e first, then estimator.formulas.VARIABLES order)."""
    out = []
    for c, mono in terms:
        num = [k for k, v in mono for _ in range(v) if v > 0]
        den = [k for k, v in mono for _ in range(-v) if v < 0]
        num.sort(key=lambda k: (k != "e", VARIABLES.index(k)))
        den.sort(key=VARIABLES.index)
        c = Fraction(c)
        head = [str(abs(c.numerator))] if abs(c.numerator) != 1 or not num else []
        text = "*".join(head + num)
        dens = ([str(c.denominator)] if c.denominator != 1 else []) + den
        if dens:
            text += "/" + "*".join(dens)
        out.append(("-" if c < 0 else "+") + text)
    text = "".join(out) or "0"
    return text[1:] if text.startswith("+") else text


def format_event(op: str, terms, ref: str, count=None) -> str:
    """'+ SIZE', '+~ SIZE ~k', '- SIZE REF', '- SIZE REF xCOUNT', '- #j', '-~ ~k' (module docstring)."""
    if terms is None:
        return f"{op} {ref}"
    return f"{op} {format_size(terms)}" + (f" {ref}" if op != "+" and ref else "") + \
        (f" x{format_size(count)}" if count is not None else "")


def parse_event(text: Any, where: str) -> ProgramEvent:
    if not isinstance(text, str):
        raise ProgramError(f"{where}: an event must be a string, not {type(text).__name__}")
    parts = text.split()
    if not parts or parts[0] not in OPS or len(parts) > 4 or len(parts) == 4 and not parts[3].startswith("x") or \
            len(parts) > 2 and parts[1].startswith(("#", "~")):
        raise ProgramError(f"{where}: malformed event {text!r} (expected '+ SIZE', '- SIZE REF', '- SIZE REF xCOUNT', "
                           f"'- #j', '+~ SIZE ~k' or '-~ ~k')")
    count = None
    if len(parts) == 4:
        if parts[0] != "-" or parts[2].startswith(("#", "~")):
            raise ProgramError(f"{where}: {text!r}: only a free of another segment's allocation repeats "
                               f"('- SIZE REF xCOUNT')")
        count = parse_size(parts[3][1:], f"{where}: {text!r}")
        parts = parts[:3]
    op = parts[0]
    if len(parts) == 2 and (parts[1].startswith("#") or parts[1].startswith("~")):
        if op not in ("-", "-~"):
            raise ProgramError(f"{where}: {text!r}: only a free names a local allocation")
        return ProgramEvent(op, None, parts[1])
    if len(parts) < 2:
        raise ProgramError(f"{where}: malformed event {text!r}")
    ref = parts[2] if len(parts) == 3 else ""
    return ProgramEvent(op, parse_size(parts[1], f"{where}: {text!r}"), ref, count)


# ---------------------------------------------------------------- files

def content_checksum(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _events(parsed: dict, texts: list, where: str) -> List[ProgramEvent]:
    """A cell's events, each distinct text parsed once per set (`parsed`; the error names the event's place)."""
    out = []
    get = parsed.get
    for j, text in enumerate(texts):
        hit = get(text) if isinstance(text, str) else None
        if hit is None:
            hit = parse_event(text, f"{where} event {j}")
            if isinstance(text, str):
                parsed[text] = hit
        out.append(hit)
    return out


def from_dict(doc: Any, path: Optional[str] = None) -> ProgramSet:
    src = path or "<program set>"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProgramError(f"{src}: not a program set (format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise ProgramError(f"{src}: program set version {doc.get('version')!r} (this estimator reads {VERSION})")
    want = doc.get("checksum")
    if want != content_checksum(doc):
        raise ProgramError(f"{src}: checksum mismatch: the file was changed after it was written (refit it, or "
                           f"restore it)")
    cells = []
    parsed: Dict[str, ProgramEvent] = {}    # one parse per distinct event text: a set repeats a few hundred
    for i, raw in enumerate(doc.get("programs") or []):
        where = f"{src}: programs[{i}]"
        if not isinstance(raw, dict) or raw.get("phase") not in ("fwd", "bwd") or not isinstance(raw.get("label"), str):
            raise ProgramError(f"{where}: needs 'label' and 'phase' ('fwd' or 'bwd')")
        if raw.get("layer", "any") not in ("any", "first"):
            raise ProgramError(f"{where}: 'layer' must be 'first' (the model's first layer) when given")
        if raw.get("instance") not in (None, "first", "last"):
            raise ProgramError(f"{where}: 'instance' must be 'first' or 'last' when given")
        when = raw.get("when", [{}])
        if not isinstance(when, list) or not all(isinstance(w, dict) for w in when) or not when:
            raise ProgramError(f"{where}: 'when' must be a non-empty list of switch dicts")
        events = _events(parsed, raw.get("events") or [], where)
        _check_refs(events, where)
        seen = raw.get("seen") or {}
        if isinstance(seen, list) and (len(seen) != len(when) or not all(isinstance(x, dict) for x in seen)) or \
                not isinstance(seen, (list, dict)):
            raise ProgramError(f"{where}: 'seen' must be a switch dict, or one per 'when' dict")
        cells.append(ProgramCell(raw["phase"], raw["label"], when, events, seen,
                                 int(raw.get("runs") or 0), raw.get("layer") == "first", raw.get("instance")))
    backends, traced = doc.get("backends") or [], doc.get("traced") or []
    if not isinstance(backends, list) or not isinstance(traced, list) or \
            not all(isinstance(t, dict) for t in traced):
        raise ProgramError(f"{src}: 'backends' must be a list of names and 'traced' a list of switch dicts")
    fixed = doc.get("fixed") or {}
    if not isinstance(fixed, dict) or not all(
            isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, (int, float)) and not isinstance(x, bool)
                                        for k, x in v.items()) for v in fixed.values()):
        raise ProgramError(f"{src}: 'fixed' must map labels to {{variable: number}}")
    profiled = doc.get("profiled") or {}
    if not isinstance(profiled, dict) or profiled and (profiled.get("device") not in ("cpu", "cuda")
                                                       or not isinstance(profiled.get("kernels", {}), dict)):
        raise ProgramError(f"{src}: 'profiled' must be an object with 'device' 'cpu' or 'cuda' and a 'kernels' object")
    return ProgramSet(str(doc.get("name", "")), str(doc.get("kind", "fitted")), str(doc.get("description", "")),
                      cells, list(doc.get("structure") or []), want, path, [str(b) for b in backends], traced,
                      {str(k): dict(v) for k, v in fixed.items()}, dict(profiled))


def _check_refs(events: List[ProgramEvent], where: str) -> None:
    allocs, workers, freed = 0, set(), set()
    for j, ev in enumerate(events):
        if ev.op == "+":
            allocs += 1
        elif ev.op == "+~":
            workers.add(ev.ref)
        elif ev.terms is None:
            ok = (ev.op == "-" and ev.ref[1:].isdigit() and int(ev.ref[1:]) < allocs) or \
                 (ev.op == "-~" and ev.ref in workers)
            if not ok or ev.ref in freed:
                raise ProgramError(f"{where} event {j}: {ev.op} {ev.ref} frees no allocation made before it")
            freed.add(ev.ref)


def load(path: str) -> ProgramSet:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except ValueError as exc:
        raise ProgramError(f"{path}: not valid JSON: {exc}") from None
    except OSError as exc:
        raise ProgramError(f"{path}: cannot read: {exc}") from None
    return from_dict(doc, path)


def to_json(doc: Mapping[str, Any]) -> str:
    """The file text: one event per line, so that a refit's diff reads line by line."""
    return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"
