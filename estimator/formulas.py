"""Formula sets: per-op activation formulas (docs/FORMATS.md section 4).

A formula set maps (op, switches) to three byte counts: `saved` (held until the op's backward),
`fwd_peak` and `bwd_peak` (transient above the level at op entry). Coefficients are exact rationals
(fractions.Fraction; plain int for integers) so a fitted set round-trips without float drift; evaluation is compiled to plain
float products once per (set, config) so thousands of estimates per second stay cheap.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple
from fractions import Fraction

import itertools
import os

from . import jsonload
from estimator._record import dataclass, field

FORMAT = "megatron-memtrace-formulas"
VERSION = 1
PROGRAM_FORMAT = "megatron-memtrace-programs"   # estimator.programs (FORMATS 7), imported only for such a set
COMPOSED_VERSION = 2   # a composed set: per-segment formulas and the op structure (FORMATS 4.1)
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "formula_sets")
# Fitted sets are the fit stage's output; the estimator reads them as data (it imports nothing from fit/).
FITTED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "sets")
SET_DIRS = (SHIPPED_DIR, FITTED_DIR)
# The default: programs measured from traces (Megatron's GPU kernels on CPU stand-ins across layouts, and the CPU
# kernels), falling back to the hand-modelled set where no program answers (docs/ACCURACY.md).
DEFAULT_SET = "cpu_compose"
MODELLED_SET = "modelled"

# Switch indicators (FORMATS 4.1): 1 where the config's switch has the value, else 0. A composed set carries a
# switch's effect on a segment as terms times its indicator, so the effects of switches traced apart add up in a
# combination never traced together.
INDICATORS = {
    "x_flash": ("attention", "flash"), "x_sp": ("sp", True), "x_sel": ("recompute", "selective"),
    "x_swiglu": ("activation", "swiglu"), "x_bf16": ("dtype", "bf16"), "x_fp16": ("dtype", "fp16"),
    "x_rope": ("position", "rope"), "x_nope": ("position", "none"), "x_rms": ("normalization", "RMSNorm"),
    "x_moe": ("moe", True), "x_moecomm": ("moe_comm", True), "x_dropout": ("dropout", True), "x_gqa": ("gqa", True),
    "x_tp": ("tp", True), "x_sm32": ("softmax_fp32", True), "x_bias": ("bias", True), "x_tied": ("tied", True),
    "x_te": ("spec", "te"), "x_fact": ("fuse_act", True), "x_fsm": ("fuse_softmax", True),
    "x_frope": ("fuse_rope", True), "x_mask8": ("dropout_mask", "byte"), "x_fce": ("fuse_ce", "native"),
    "x_mb1": ("mb1", True), "x_qcopy": ("qcopy", True), "x_a2a": ("a2a", True),
    "x_le1": ("le1", True), "x_epx": ("epx", True), "x_presoft": ("pre_softmax", True),
}
VARIABLES = ("s", "b", "h", "f", "a", "g", "d", "v", "E", "k", "fe", "fs",
             "t", "st", "cp", "ep", "etp", "e", "P", "Pmax", "Pstep", "L",
             # multi-latent attention (0 without it): the query and key-value latent ranks (ql 0 without a query
             # latent), the query / key head width without and with rotary positions, the value head width
             "ql", "kl", "dq", "dr", "dv",
             # multi-token prediction's depth (--mtp-num-layers; 0 without): its block joins 1 + D hidden states
             "D") + tuple(INDICATORS)
# Per-stage variables (FORMATS 4): parameters the rank's optimizer holds after DP sharding, its largest parameter
# tensor, the largest 2*p_i + p_(i-1) over consecutive parameters of one optimizer parameter group (a
# one-tensor-at-a-time Adam step's temporaries: two of the current parameter's size while the previous one's
# result is still referenced), and its decoder layers. They come from the estimator's own parameter model (memory.param_chunks and
# static_memory), are computed only when a formula asks for them, and belong to one pipeline stage.
STAGE_VARIABLES = ("P", "Pmax", "Pstep", "L")
# Allowed values per switch; `gqa` is an extension (a > g changes what unfused attention saves).
SWITCHES: Dict[str, Tuple[Any, ...]] = {
    "attention": ("unfused", "flash"),
    # multi-latent attention (MLASelfAttention: latent projections, rotary and plain head parts) for the attention
    "mla": (True, False),
    # MLA with a query latent (--q-lora-rank: linear_q_down_proj / linear_q_up_proj instead of linear_q_proj)
    "q_lora": (True, False),
    # multi-token prediction (--mtp-num-layers): the loss's stage runs the MTP block and one more output layer and
    # loss per MTP layer
    "mtp": (True, False),
    # ... whose layers call the model's own embedding in the chunk that holds it (one pipeline stage): both
    # lookups' weight gradients are summed before the gradient hook, where an MTP stage after the first has an
    # embedding of its own
    "mtp_shared": (True, False),
    # the query's and key's per-head norm in standard attention (--qk-layernorm: the layer spec's norm module;
    # --qk-l2-norm: megatron's parameter-free L2Norm, which takes its place), separate modules of the attention;
    # multi-latent attention's latent norms are part of its own programs ('none' under MLA)
    "qk_norm": ("none", "layernorm", "l2"),
    # --attention-output-gate: linear_qkv also projects a gate, and the attention's output is multiplied by its
    # sigmoid in fp32 (megatron-core SelfAttention._apply_output_gate)
    "output_gate": (True, False),
    "sp": (True, False),
    "recompute": ("none", "selective", "full"),
    "activation": ("gelu", "swiglu", "squared_relu"),
    "dtype": ("fp32", "bf16", "fp16"),
    "position": ("learned_absolute", "rope", "none"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "moe": (True, False),
    "moe_comm": (True, False),
    "dropout": (True, False),
    "gqa": (True, False),
    "tp": (True, False),
    "softmax_fp32": (True, False),
    "bias": (True, False),
    "tied": (True, False),
    # GPU kernel families (kernels()): Transformer Engine's modules, the fused bias-activation, masked-softmax and
    # RoPE kernels, and the dropout mask's element size (1 byte on a GPU, the input's dtype in CPU eager mode).
    "spec": ("local", "te"),
    "fuse_act": (True, False),
    "fuse_softmax": (True, False),
    "fuse_rope": (True, False),
    # the bias-dropout-add into the residual stream as one fused (jit) function or as separate ops
    "fuse_bda": (True, False),
    "dropout_mask": ("byte", "dtype"),
    # How collectives get their buffers: gloo (the CPU runs) stages a flat copy of what it reduces or gathers and
    # frees some tensors on its own thread; NCCL on a GPU, and torch's fake process group that traces one rank of a
    # larger world (tracer/fake_world.py), work on the tensors megatron-core hands them.
    "collectives": ("gloo", "direct"),
    # --cross-entropy-loss-fusion and its --cross-entropy-fusion-impl: the native one's scripted kernels hold one
    # more fp32 copy of the logits in forward on a GPU (measured on H100), TE's is its own kernel
    "fuse_ce": ("none", "native", "te"),
    # A micro-batch of one sequence: [b, s, h] -> [s, b, h] by transpose(0, 1).contiguous() is then a view, no copy
    # (the embedding's output, the loss's logits), so which tensors a segment frees changes at b = 1.
    "mb1": (True, False),
    # SelfAttention reshapes the query [s, b, g, a/g * d] -> [s, b, a, d]: a copy only where a rank has more than
    # one query group and more than one head per group (MHA and one group per rank, MQA or g <= TP, get a view).
    "qcopy": (True, False),
    # Where SelfAttention hands the query on as a view of the QKV projection with one group per rank and more than
    # one head ([s, b, 1, a*d] viewed as [s, b, a, d]), the unfused core attention's reshape to [s, b*a, d] is a
    # copy unless b = 1 (the merged dimensions' strides disagree); a rotated query is a new contiguous tensor.
    "qcore": (True, False),
    # MoE with the all-to-all token dispatcher (permutes its tokens and exchanges them over EP; the allgather one
    # gathers every token over the expert group): the same ops, other tensors.
    "a2a": (True, False),
    # MoE with one expert per expert rank (E = EP): the dispatcher skips the sort of its received tokens by local
    # expert, and a SequentialMLP runs its one expert on them without splitting and joining.
    "le1": (True, False),
    # MoE over more than one expert rank (EP > 1): the all-to-all dispatcher's exchange returns new tensors, where
    # over one rank it hands back its input; with `moe_comm` it tells EP from expert TP (whose tokens are gathered).
    "epx": (True, False),
    # MoE routing by --moe-router-pre-softmax (softmax over every expert, then the top k; megatron-core requires it
    # for top-1): the router keeps the probabilities of all E experts per token, not of the k it picked.
    "pre_softmax": (True, False),
    # MoE experts as Transformer Engine's grouped GEMM (--moe-grouped-gemm with the TE spec: TEGroupedMLP, one GEMM
    # over every local expert's tokens into one output) rather than megatron's SequentialMLP (a GEMM per expert,
    # the outputs joined by a copy): other ops, other tensors. (The local spec's legacy GroupedMLP, deprecated and
    # needing the grouped_gemm package, is not told apart: it is read as SequentialMLP.)
    "grouped_gemm": (True, False),
    # Where the unfused attention's [b, a/t, s, s] scores live: megatron's global memory buffer (the local spec's
    # DotProductAttention: one persistent tensor) or a new tensor per call (Transformer Engine's unfused backend: a
    # forward transient). Runs traced before TE's per-call stand-in kept them in the buffer under the TE spec too.
    "scores": ("buffer", "call"),
    # torch's LayerNorm / RMSNorm (the local spec's norms) as CUDA runs them, fp32 statistics and a fused RMSNorm
    # that keeps its input and one value per row, or as the CPU runs them (16-bit statistics; RMSNorm decomposed
    # into elementwise ops that keep more). The TE spec runs none ('cpu', as traces before the switch record).
    "torch_norm": ("cpu", "cuda"),
}
# The switches that change which ops a layer has (the op structure the fit records): a combination of their values
# that no run had is a different layer, not a composition of measured parts.
STRUCTURE_SWITCHES = ("spec", "attention", "mla", "mtp", "moe", "position", "normalization", "activation", "gqa", "tp",
                      "sp", "recompute", "grouped_gemm")
QUANTITIES = ("saved", "fwd_peak", "bwd_peak")
PER = ("layer", "model")


class FormulaError(ValueError):
    """A malformed formula-set file or a config no formula covers; the message names where."""


@dataclass(frozen=True)
class Term:
    coef: Fraction
    vars: Tuple[Tuple[str, int], ...]

    def __post_init__(self):
        object.__setattr__(self, "_fcoef", float(self.coef))  # converted once, not per evaluation

    def value(self, env: Mapping[str, float]) -> float:
        x = self._fcoef
        try:
            for name, exp in self.vars:
                x *= env[name] ** exp
        except ZeroDivisionError:
            # Tokens per expert (s*b*k/E) on a dense layer: k = E = 0, and the term is 0 there.
            if any(exp > 0 and env[name] == 0 for name, exp in self.vars):
                return 0.0
            raise
        return x


@dataclass(frozen=True)
class MaxTerm:
    """A transient that is the larger of alternative allocation patterns (segment quantities of composed sets,
    FORMATS 4.1 `{"max": [[terms], [terms]]}`): each alternative a sum of terms. Evaluates like one term (a
    coefficient of 1 and no variables of its own, so a quantity holding it is one tensor in the allocation stream)."""
    alternatives: Tuple[Tuple[Term, ...], ...]
    coef: int = 1
    vars: Tuple[Tuple[str, int], ...] = ()

    def value(self, env: Mapping[str, float]) -> float:
        return max(sum(t.value(env) for t in alt) for alt in self.alternatives)


@dataclass(frozen=True)
class Formula:
    op: str
    per: str
    when: Tuple[Tuple[str, Any], ...]
    saved: Tuple[Term, ...]
    fwd_peak: Tuple[Term, ...]
    bwd_peak: Tuple[Term, ...]

    def matches(self, sw: Mapping[str, Any]) -> bool:
        return all(sw.get(k) == v for k, v in self.when)

    def evaluate(self, env: Mapping[str, float]) -> Tuple[float, float, float]:
        """(saved, fwd_peak, bwd_peak) in bytes (== sum(t.value(env) for t in terms) per quantity)."""
        fn = self.__dict__.get("_compiled")
        if fn is None:
            # Compiling costs about 50 plain evaluations: a one-shot CLI run never pays it, a caller that estimates
            # many configs does after a few.
            n = self.__dict__.get("_evaluations", 0) + 1
            object.__setattr__(self, "_evaluations", n)
            if n <= _COMPILE_AFTER:
                return tuple(sum([t.value(env) for t in terms]) for terms in (self.saved, self.fwd_peak, self.bwd_peak))
            fn = _compile_quantities((self.saved, self.fwd_peak, self.bwd_peak))
            object.__setattr__(self, "_compiled", fn)
        return fn(env)


_COMPILE_AFTER = 8


def _compile_quantities(quantities) -> Any:
    """One Python function computing every quantity's term sum, compiled once per formula: evaluation runs
    thousands of times per second. It does the same float operations in the same order as Term.value summed
    left to right (coef * v1 ** e1 * v2 ** e2 ..., `** 1` dropped: exact), so results are bit-identical.
    Only repr'd variable names and int exponents reach the source; coefficients are the function's globals."""
    consts: Dict[str, Any] = {}
    src = "lambda env: (" + ", ".join(_quantity_exprs(quantities, consts)) + ",)"
    return eval(src, {"__builtins__": {}, **consts})  # noqa: S307 -- source built above from validated parts


def _quantity_exprs(quantities, consts: Dict[str, Any]) -> List[str]:
    """One Python expression per quantity (its terms summed left to right from int 0); coefficients are added to
    `consts` under fresh names."""
    exprs = []
    for terms in quantities:
        parts = ["0"]  # sum() starts from int 0: an empty quantity stays int 0, as before
        for t in terms:
            c = f"c{len(consts)}"
            consts[c] = t._fcoef
            factors = [c]
            for name, exp in t.vars:
                if not isinstance(name, str) or int(exp) != exp:
                    raise FormulaError(f"bad term variable {name!r}**{exp!r}")
                factors.append(f"env[{name!r}]" if exp == 1 else f"env[{name!r}] ** {int(exp)!r}")
            parts.append(" * ".join(factors))
        exprs.append(" + ".join(parts))
    return exprs


@dataclass
class FormulaSet:
    name: str
    kind: str
    description: str
    provenance: Dict[str, Any]
    formulas: List[Formula]
    path: Optional[str] = None
    # Where an op or a quantity is missing (None: the fit could not determine it), the modelled set answers,
    # so a gap in a fitted set never reads as 0 bytes. `fallbacks` records what was taken from it.
    fallback: Optional["FormulaSet"] = None
    fallbacks: set = field(default_factory=set, repr=False)
    segments: List["SegmentFormula"] = field(default_factory=list)    # composed sets (FORMATS 4.1)
    structure: List[Tuple[str, Tuple[Tuple[str, Any], ...], Tuple[str, ...]]] = field(default_factory=list)
    programs: Any = None    # a program set (estimator.programs, FORMATS 7): evaluated by estimator.program_cache
    _by_op: Dict[str, List[Formula]] = field(default_factory=dict, repr=False)
    _cache: Dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for fo in self.formulas:
            self._by_op.setdefault(fo.op, []).append(fo)
        # Most specific first, stable for ties (file order).
        for lst in self._by_op.values():
            lst.sort(key=lambda fo: -len(fo.when))

    @property
    def composed(self) -> bool:
        return bool(self.segments) or self.programs is not None

    @property
    def profiled(self) -> Dict[str, Any]:
        """The stack a job's own set was profiled on (fit.job_campaign: device, kernels, versions); {} otherwise."""
        return self.programs.profiled if self.programs is not None else {}

    @property
    def measured_on_standins(self) -> bool:
        """Fitted from traces of the built-in harness, which runs Transformer Engine's modules as stand-ins
        (tracer/standins.py) on CPU and on the H100 alike: every fitted set; the modelled set describes TE itself."""
        return self.kind != "modelled"

    def measures(self, switch: str, value: Any) -> bool:
        """Whether some run of the set had this switch value."""
        return value in self.seen_switch_values().get(switch, ())

    def seen_switch_values(self) -> Dict[str, set]:
        """Per switch, the values some run of the set had (a composed or program set; cached)."""
        seen = self._cache.get("seen switch values")
        if seen is None:
            seen = self._cache["seen switch values"] = {}
            for sf in self.segments:
                for k, vals in sf.seen:
                    seen.setdefault(k, set()).update(vals)
            for cell in self.programs.cells if self.programs is not None else ():
                for i in range(len(cell.when)):
                    for k, vals in cell.seen_of(i).items():
                        seen.setdefault(k, set()).update(vals)
            # A set fitted before the kernel switches existed saw only the CPU kernels.
            # (fuse_bda and collectives are recorded since program sets: older sets never told them apart)
            for k, v in CPU_KERNELS.items():
                if k not in ("fuse_bda", "collectives"):
                    seen.setdefault(k, {v})
            seen.setdefault("fuse_ce", {"none"})   # a set fitted before this switch existed
        return seen

    @property
    def te_scores_in_buffer(self) -> bool:
        """A fitted set whose runs never had Transformer Engine's unfused attention make its scores per call (the
        stand-ins kept them in megatron's global buffer before): for TE's unfused backend the estimate then adds
        that buffer, standing for the scores' forward transient its programs lack (errs high)."""
        return self.measured_on_standins and "call" not in self.seen_switch_values().get("scores", ())

    @property
    def measured_on_gpu(self) -> bool:
        """Fitted from GPU traces only (provenance `backends`, written by fit.programs): its kernel families
        were measured on the GPU itself, not on CPU stand-ins."""
        return self.provenance.get("backends") == ["cuda"]

    @property
    def ops(self) -> List[str]:
        return list(self._by_op)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.kind})"


SEGMENT_QUANTITIES = ("fwd_delta", "fwd_peak", "bwd_delta", "bwd_peak")
NOT_GIVEN = "not given"   # a segment entry without this quantity: another entry of the label (split otherwise) has it


@dataclass(frozen=True)
class SegmentFormula:
    """One segment label's four quantities (None: undetermined; NOT_GIVEN: given by the label's entries of
    another split) under `when`, and the switch values its runs had."""
    label: str
    when: Tuple[Tuple[str, Any], ...]
    quantities: Tuple[Optional[Tuple[Term, ...]], ...]    # in SEGMENT_QUANTITIES order
    seen: Tuple[Tuple[str, Tuple[Any, ...]], ...]
    # Per quantity, the switch values of the parts it was measured on (None: wherever the entry covers); a
    # formula with switch indicators predicts other combinations of those switches from them.
    measured: Tuple[Optional[Tuple[Tuple[Tuple[str, Any], ...], ...]], ...] = (None, None, None, None)
    # Per quantity, the cells (switch values) of runs the formula misses (fit/unfitted.py): never measured there.
    unfitted: Tuple[Optional[Tuple[Tuple[Tuple[str, Any], ...], ...]], ...] = (None, None, None, None)

    def matches(self, sw: Mapping[str, Any]) -> bool:
        return all(sw.get(k) == v for k, v in self.when)

    def covers(self, sw: Mapping[str, Any]) -> bool:
        """Every switch value of the config was among the part's runs' (so the formula was measured there)."""
        return all(sw.get(k) in vals for k, vals in self.seen if k in sw)

    def measured_for(self, i: int, sw: Mapping[str, Any]) -> bool:
        """Quantity i was measured for the config's values of the switches it was split by: on a part with all of
        them, or, its formula adding up per-switch effects and interactions (fit/switch_terms.py), on parts that had
        each pair of them together, so that every effect and every interaction of two switches it composes was
        measured. (A part not split by a switch was fitted over that switch's values: it agrees with any.) Never
        where the formula misses a run of the config's cell (`unfitted`), and a part holding such a cell is no
        evidence for the pairs."""
        missed = self.unfitted[i] or ()
        if any(_agrees(c, sw) for c in missed):
            return False
        parts = self.measured[i]
        if parts is None or any(_agrees(p, sw) for p in parts):
            return True
        parts = [p for p in parts if not any(_agrees(p, dict(c)) for c in missed)]
        keys = sorted({k for p in parts for k, _ in p})
        return len(keys) > 2 and all(any(_agrees(p, sw, pair) for p in parts)
                                     for pair in itertools.combinations(keys, 2))


def _agrees(part, sw: Mapping[str, Any], only=None) -> bool:
    return all(sw.get(k) == v for k, v in part if only is None or k in only)


# ---------------------------------------------------------------- parsing / validation

def _coef(raw: Any, where: str) -> Fraction:
    coef = _coef_value(raw)
    if coef is None:
        raise FormulaError(f"{where}: coef must be a number or 'p/q' string, got {_short(raw)}")
    if not -COEF_LIMIT <= coef <= COEF_LIMIT:
        raise FormulaError(f"{where}: coef {_short(raw)} is beyond any formula (magnitude at most 2**53)")
    return coef


def _short(value: Any) -> str:
    """repr(value), cut to keep an error message on one readable line (a damaged file may hold 10^300)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _coef_value(raw: Any) -> Optional[Fraction]:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        # An integer is already exact; fractions (which imports decimal) is loaded only for 'p/q' and floats.
        return raw
    from fractions import Fraction
    try:
        if isinstance(raw, str):
            return Fraction(raw.strip())
        if isinstance(raw, float):
            # Floats in a file are snapped to the nearest small rational (fits write 'p/q' anyway).
            return Fraction(raw).limit_denominator(1 << 20)
    except (ValueError, ZeroDivisionError, OverflowError):   # 'x', '1/0', NaN and Infinity
        pass
    return None


def _terms(raw: Any, where: str, allow_max: bool = False) -> Optional[Tuple[Term, ...]]:
    """The terms of one quantity. Well-formed input takes the fast path below; anything it does not accept is
    checked term by term by _terms_checked (same result, or the error message naming the bad term). allow_max: a
    segment quantity may be the larger of alternatives (MaxTerm)."""
    if allow_max and raw.__class__ is dict and set(raw) == {"max"}:
        alts = raw["max"]
        if not isinstance(alts, list) or len(alts) < 2:
            raise FormulaError(f"{where}.max: expected a list of at least two term lists")
        parsed = tuple(_terms_checked(alt, f"{where}.max[{i}]") for i, alt in enumerate(alts))
        if any(alt is None for alt in parsed):
            raise FormulaError(f"{where}.max: an alternative cannot be null")
        return (MaxTerm(parsed),)
    if raw.__class__ is not list:
        return _terms_checked(raw, where)
    out = []
    for t in raw:
        if t.__class__ is not dict:
            return _terms_checked(raw, where)
        coef = t.get("coef", _NO_COEF)
        vs = t.get("vars") or {}
        if (coef.__class__ is not int or len(t) != (2 if "vars" in t else 1) or vs.__class__ is not dict
                or not -COEF_LIMIT <= coef <= COEF_LIMIT):
            return _terms_checked(raw, where)
        pairs = []
        for name, exp in vs.items():
            if exp.__class__ is not int or name not in VARIABLES or not -EXP_LIMIT <= exp <= EXP_LIMIT:
                return _terms_checked(raw, where)
            if exp:
                pairs.append((name, exp))
        out.append(Term(coef, tuple(sorted(pairs))))
    return tuple(out)


_NO_COEF = object()
# Bounds on a term, far beyond any fitted or modelled formula (coefficients are small rationals, exponents 1 or 2):
# a larger one is a damaged file, and evaluating it would overflow a float or, for an exponent like 10^30, never end.
COEF_LIMIT = 2 ** 53
EXP_LIMIT = 8


def _terms_checked(raw: Any, where: str) -> Optional[Tuple[Term, ...]]:
    if raw is None:
        return None  # undetermined by the data (a fitted set says so); select() falls back for it
    if not isinstance(raw, list):
        raise FormulaError(f"{where}: expected a list of terms")
    out = []
    for i, t in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(t, dict) or "coef" not in t:
            raise FormulaError(f"{w}: a term is {{'coef': ..., 'vars': {{var: exponent}}}}")
        extra = set(t) - {"coef", "vars"}
        if extra:
            raise FormulaError(f"{w}: unknown keys {sorted(extra)}")
        vs = t.get("vars", {}) or {}
        if not isinstance(vs, dict):
            raise FormulaError(f"{w}: vars must be an object")
        pairs = []
        for name, exp in vs.items():
            if name not in VARIABLES:
                raise FormulaError(f"{w}: unknown variable {name!r} (known: {', '.join(VARIABLES)})")
            if isinstance(exp, bool) or not isinstance(exp, int) or not -EXP_LIMIT <= exp <= EXP_LIMIT:
                raise FormulaError(f"{w}: exponent of {name!r} must be an integer in [-{EXP_LIMIT}, {EXP_LIMIT}], "
                                   f"got {_short(exp)}")
            if exp:
                pairs.append((name, exp))
        out.append(Term(_coef(t["coef"], w), tuple(sorted(pairs))))
    return tuple(out)


def _when(raw: Any, where: str) -> Tuple[Tuple[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise FormulaError(f"{where}: 'when' must be an object")
    for k, v in raw.items():
        if k not in SWITCHES:
            raise FormulaError(f"{where}: unknown switch {k!r} (known: {', '.join(SWITCHES)})")
        if v not in SWITCHES[k] or isinstance(v, bool) != isinstance(SWITCHES[k][0], bool):
            raise FormulaError(f"{where}: switch {k!r} has value {v!r}; allowed {list(SWITCHES[k])}")
    return tuple(sorted(raw.items()))


def from_dict(doc: Any, path: Optional[str] = None) -> FormulaSet:
    src = path or "<formula set>"
    if not isinstance(doc, dict):
        raise FormulaError(f"{src}: top level must be a JSON object")
    if doc.get("format") == PROGRAM_FORMAT:
        return _program_set(doc, src, path)
    if doc.get("format") != FORMAT:
        raise FormulaError(f"{src}: 'format' must be {FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") not in (VERSION, COMPOSED_VERSION):
        raise FormulaError(f"{src}: unsupported version {doc.get('version')!r} (this estimator reads {VERSION} "
                           f"and {COMPOSED_VERSION})")
    composed = doc["version"] == COMPOSED_VERSION
    kind = doc.get("kind")
    if kind not in ("modelled", "fitted"):
        raise FormulaError(f"{src}: 'kind' must be 'modelled' or 'fitted', got {kind!r}")
    if not isinstance(doc.get("name"), str) or not doc["name"]:
        raise FormulaError(f"{src}: 'name' must be a non-empty string")
    raw = doc.get("formulas")
    if not isinstance(raw, list) or not (raw or composed):
        raise FormulaError(f"{src}: 'formulas' must be a non-empty list")
    formulas, seen = [], set()
    for i, fo in enumerate(raw):
        w = f"{src}: formulas[{i}]"
        if not isinstance(fo, dict):
            raise FormulaError(f"{w}: must be an object")
        extra = set(fo) - {"op", "per", "when", "note", *QUANTITIES}
        if extra:
            raise FormulaError(f"{w}: unknown keys {sorted(extra)}")
        op = fo.get("op")
        if not isinstance(op, str) or not op:
            raise FormulaError(f"{w}: 'op' must be a non-empty string")
        w = f"{w} (op {op!r})"
        per = fo.get("per")
        if per not in PER:
            raise FormulaError(f"{w}: 'per' must be 'layer' or 'model', got {per!r}")
        when = _when(fo.get("when"), w)
        if (op, when) in seen:
            raise FormulaError(f"{w}: duplicate formula for the same op and 'when'")
        seen.add((op, when))
        formulas.append(Formula(op, per, when, *(_terms(fo.get(q), f"{w}.{q}") for q in QUANTITIES)))
    prov = doc.get("provenance", {})
    if not isinstance(prov, dict):
        raise FormulaError(f"{src}: 'provenance' must be an object")
    fset = FormulaSet(doc["name"], kind, str(doc.get("description", "")), prov, formulas, path)
    if composed:
        fset.segments, fset.structure = _segments(doc, src), _structure(doc, src)
    return fset


def _program_set(doc: dict, src: str, path: Optional[str]) -> FormulaSet:
    """A program set (estimator.programs) behind the FormulaSet interface the estimator selects by."""
    from . import programs as P
    try:
        ps = P.from_dict(doc, path)
    except P.ProgramError as exc:
        raise FormulaError(str(exc)) from None
    if ps.kind not in ("modelled", "fitted") or not ps.name:
        raise FormulaError(f"{src}: a program set needs a 'name' and 'kind' 'modelled' or 'fitted'")
    fset = FormulaSet(ps.name, ps.kind, ps.description, {"backends": ps.backends}, [], path, programs=ps)
    fset.structure = _structure(doc, src)
    return fset


def _segments(doc: dict, src: str) -> List[SegmentFormula]:
    raw = doc.get("segments")
    if not isinstance(raw, list) or not raw:
        raise FormulaError(f"{src}: a composed set (version {COMPOSED_VERSION}) needs a non-empty 'segments' list")
    out, seen = [], set()
    for i, e in enumerate(raw):
        w = f"{src}: segments[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("label"), str) or not e["label"]:
            raise FormulaError(f"{w}: needs a 'label'")
        extra = set(e) - {"label", "per", "when", "seen", "runs", "note", "measured", "unfitted",
                          *SEGMENT_QUANTITIES}
        if extra:
            raise FormulaError(f"{w}: unknown keys {sorted(extra)}")
        w = f"{w} ({e['label']!r})"
        when = _when(e.get("when"), w)
        if (e["label"], when) in seen:
            raise FormulaError(f"{w}: duplicate segment formula for the same label and 'when'")
        seen.add((e["label"], when))
        raw_seen = e.get("seen") or {}
        if not isinstance(raw_seen, dict) or any(k not in SWITCHES or not isinstance(v, list)
                                                 for k, v in raw_seen.items()):
            raise FormulaError(f"{w}: 'seen' maps switches to lists of values")
        out.append(SegmentFormula(e["label"], when, tuple(_terms(e[q], f"{w}.{q}", True) if q in e else NOT_GIVEN
                                                          for q in SEGMENT_QUANTITIES),
                                  tuple(sorted((k, tuple(v)) for k, v in raw_seen.items())),
                                  _switch_cells(e.get("measured"), w, "measured"),
                                  _switch_cells(e.get("unfitted"), w, "unfitted")))
    return out


def _switch_cells(raw: Any, where: str, key: str) -> tuple:
    if raw is None:
        return (None, None, None, None)
    if not isinstance(raw, dict) or any(q not in SEGMENT_QUANTITIES or not isinstance(v, list) for q, v in raw.items()):
        raise FormulaError(f"{where}: '{key}' maps quantities to lists of switch values")
    return tuple(None if q not in raw else tuple(_when(p, f"{where}.{key}.{q}") for p in raw[q])
                 for q in SEGMENT_QUANTITIES)


def _structure(doc: dict, src: str) -> list:
    raw = doc.get("structure")
    if not isinstance(raw, list) or not raw:
        raise FormulaError(f"{src}: a composed set needs a non-empty 'structure' list")
    out = []
    for i, e in enumerate(raw):
        w = f"{src}: structure[{i}]"
        if (not isinstance(e, dict) or not isinstance(e.get("op"), str) or not isinstance(e.get("children"), list)
                or not all(isinstance(c, str) for c in e["children"])):
            raise FormulaError(f"{w}: needs 'op' and a list of 'children' op names")
        out.append((e["op"], _when(e.get("when"), w), tuple(e["children"])))
    return out


def shipped_sets() -> list:
    """Names usable with --formulas: the modelled set(s) and the fitted sets shipped under fit/sets/."""
    names = set()
    for d in SET_DIRS:
        if os.path.isdir(d):
            names.update(f[:-5] for f in os.listdir(d) if f.endswith(".json") and not f.endswith(".provenance.json"))
    return sorted(names)


def resolve(name_or_path: str) -> str:
    """A shipped set's name ('modelled', 'cpu_local') or a file path -> the file path."""
    if os.path.isfile(name_or_path):
        return name_or_path
    for d in SET_DIRS:
        cand = os.path.join(d, name_or_path + ("" if name_or_path.endswith(".json") else ".json"))
        if os.path.isfile(cand):
            return cand
    raise FormulaError(f"formula set {name_or_path!r}: no such file and not a shipped set "
                       f"(shipped: {', '.join(shipped_sets()) or 'none'})")


_LOADED: Dict[Tuple[str, float], FormulaSet] = {}


def load(name_or_path: str = DEFAULT_SET) -> FormulaSet:
    path = resolve(name_or_path)
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _LOADED:
        try:
            with open(path, encoding="utf-8") as fh:
                doc = jsonload.load(fh)
        except ValueError as exc:  # json.JSONDecodeError, or text that is not UTF-8
            raise FormulaError(f"{path}: not valid JSON: {exc}") from None
        except RecursionError:
            raise FormulaError(f"{path}: not valid JSON: nested too deeply") from None
        except OSError as exc:
            raise FormulaError(f"{path}: cannot read: {exc}") from None
        fset = from_dict(doc, path)
        if fset.kind == "fitted":
            fset.fallback = load(MODELLED_SET)
        _LOADED[key] = fset
    return _LOADED[key]


# ---------------------------------------------------------------- config -> variables / switches

def _get(cfg: Any, name: str, default: Any = None) -> Any:
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def qk_norm_of(cfg: Any) -> str:
    """The `qk_norm` switch: the query's and key's per-head norm modules of standard attention ('none' under
    multi-latent attention, whose latent norms are its own programs; the L2 norm takes the layer norm's place)."""
    if _get(cfg, "multi_latent_attention", False):
        return "none"
    return "l2" if _get(cfg, "qk_l2_norm", False) else "layernorm" if _get(cfg, "qk_layernorm", False) else "none"


def dtype_of(cfg: Any) -> str:
    return "bf16" if _get(cfg, "bf16", False) else "fp16" if _get(cfg, "fp16", False) else "fp32"


class _Variables(dict):
    """The variables of one config; the per-stage ones (STAGE_VARIABLES) are computed on first access."""

    def __init__(self, values: Dict[str, float], cfg: Any, pp_rank: int):
        super().__init__(values)
        self._cfg, self._pp_rank = cfg, pp_rank

    def __missing__(self, key: str) -> float:
        if key in INDICATORS:
            self.update(indicators(switches(self._cfg, self)))
            return self[key]
        if key not in STAGE_VARIABLES:
            raise KeyError(key)
        self.update(stage_variables(self._cfg, self._pp_rank))
        return self[key]

    def complete(self) -> Dict[str, float]:
        """A plain dict with every variable, the per-stage ones included."""
        for k in STAGE_VARIABLES:
            self[k]
        return dict(self)


def stage_variables(cfg: Any, pp_rank: int = 0) -> Dict[str, int]:
    """P, Pmax and L of pipeline stage `pp_rank` (all its virtual chunks), from the estimator's parameter model:
    P = parameter elements the rank's optimizer holds (static_memory's state elements: the DP shard under the
    distributed optimizer, the DP rank holding the most), Pmax = the largest parameter tensor's elements,
    L = decoder layers on the stage. `cfg` is a TrainingConfig or its to_dict() (a trace header's config)."""
    from . import model as M
    from .args import TrainingConfig
    from .memory import param_chunks
    from .static_memory import static_memory
    if isinstance(cfg, dict):
        cfg = TrainingConfig.from_dict(cfg)
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    chunks = param_chunks(cfg, pp_rank, vpp)
    st = static_memory(cfg, chunks, pp_rank=pp_rank)
    layers = sum(len(M.stage_layers(cfg, pp_rank, vp if vpp > 1 else None)) for vp in range(vpp))
    return {"P": st.optimizer_detail["state_elements"], "Pmax": max((p.numel for c in chunks for p in c), default=0),
            "Pstep": _step_pairs(cfg, chunks, pp_rank), "L": layers}


def _step_pairs(cfg: Any, chunks: Sequence[Sequence[Any]], pp_rank: int) -> int:
    """Pstep: static_memory.step_transient_bytes (the estimator's model of torch AdamW's one-tensor-at-a-time step:
    max over megatron-core's optimizer parameter groups of prev + 2 * cur, on DP shards in grad-buffer order under
    the distributed optimizer) in elements, whatever the spec (the set decides whether the step works that way)."""
    from .static_memory import dp_layout, step_transient_bytes
    return step_transient_bytes(chunks, *dp_layout(cfg), pp_rank) // 4


def variables(cfg: Any, pp_rank: int = 0) -> Dict[str, float]:
    """The per-rank variables of FORMATS 4 (plain numbers) for one config; P, Pmax and L (STAGE_VARIABLES) are
    those of pipeline stage `pp_rank` and are computed only when looked up (`.complete()` forces them)."""
    h = _get(cfg, "hidden_size")
    a = _get(cfg, "num_attention_heads")
    t = _get(cfg, "tensor_model_parallel_size", 1)
    cp = _get(cfg, "context_parallel_size", 1)
    f = _get(cfg, "ffn_hidden_size", 4 * h)
    E = _get(cfg, "num_experts", 0)
    values = {
        "s": _get(cfg, "seq_length") / cp,
        "b": _get(cfg, "micro_batch_size", 1),
        "h": h, "f": f, "a": a,
        "g": _get(cfg, "num_query_groups", a) if _get(cfg, "group_query_attention", True) else a,
        "d": _get(cfg, "kv_channels", h // a),
        "v": _get(cfg, "padded_vocab_size", _get(cfg, "vocab_size", 0)),
        "E": E, "k": _get(cfg, "moe_router_topk", 2 if E else 0),
        "fe": _get(cfg, "moe_ffn_hidden_size", f),
        "fs": _get(cfg, "moe_shared_expert_intermediate_size", 0),
        "t": t, "st": t if _get(cfg, "sequence_parallel", False) else 1, "cp": cp,
        "ep": _get(cfg, "expert_model_parallel_size", 1),
        "etp": _get(cfg, "expert_tensor_parallel_size", t),
        "e": 4 if dtype_of(cfg) == "fp32" else 2,
    }
    mla = bool(_get(cfg, "multi_latent_attention", False))
    values.update(ql=_get(cfg, "q_lora_rank", 0) if mla else 0, kl=_get(cfg, "kv_lora_rank", 32) if mla else 0,
                  dq=_get(cfg, "qk_head_dim", 128) if mla else 0,
                  dr=_get(cfg, "qk_pos_emb_head_dim", 64) if mla else 0, dv=_get(cfg, "v_head_dim", 128) if mla else 0,
                  D=_get(cfg, "mtp_num_layers", 0))
    return _Variables(values, cfg, pp_rank)


# What the built-in harness ran on CPU before the GPU stand-ins (tracer/standins.py), whatever the flags: the local
# spec, no fused kernel, eager CPU dropout. Traces without a `kernels` record in their header ran this.
CPU_KERNELS = {"spec": "local", "attention": "unfused", "fuse_act": False, "fuse_softmax": False,
               "fuse_rope": False, "dropout_mask": "dtype", "fuse_bda": False, "collectives": "gloo",
               "grouped_gemm": False, "scores": "buffer", "torch_norm": "cpu"}


def collectives(process_group: str) -> str:
    """The `collectives` switch of a process-group backend ("gloo", "nccl", "fake")."""
    return "gloo" if process_group == "gloo" else "direct"


def softmax_batch_per_block(sk: int) -> int:
    """megatron's scaled_masked_softmax_cuda.get_batch_per_block (csrc scaled_masked_softmax.h): warps of 32
    threads, 128 threads per block, two rows per warp while a row has at most 128 elements."""
    elements = 1 << max(0, (sk - 1).bit_length())
    warp = min(elements, 32)
    return (128 // warp) * (2 if elements <= 128 else 1)


def _softmax_kernel_fits(cfg: Any, s: int, b: int, heads: int) -> bool:
    """megatron's FusedScaleMaskSoftmax.is_kernel_available for a causal mask: the fused kernel runs only for these
    shapes (else megatron falls back to torch's softmax)."""
    batches = b * heads
    if not (16 < s <= 4096 and s % 4 == 0 and batches % 4 == 0):
        return False
    return batches % softmax_batch_per_block(s) == 0


def kernels(cfg: Any) -> Dict[str, Any]:
    """The kernel family per switch that a GPU runs for these flags (Megatron-LM's rules), or what a trace records
    it ran (`kernels`, set from its header by fit.dataset)."""
    recorded = _get(cfg, "kernels", None)
    if isinstance(recorded, dict):
        return {**CPU_KERNELS, **recorded}
    attention = attention_kernel(cfg)
    fp16ish = dtype_of(cfg) != "fp32"
    t = max(1, int(_get(cfg, "tensor_model_parallel_size", 1) or 1))
    heads = int(_get(cfg, "num_attention_heads", 1) or 1) // t
    s = int(_get(cfg, "seq_length", 0) or 0) // max(1, int(_get(cfg, "context_parallel_size", 1) or 1))
    spec = "te" if _get(cfg, "transformer_impl", "transformer_engine") == "transformer_engine" else "local"
    return {
        "spec": spec,
        "attention": attention,
        "fuse_act": bool(_get(cfg, "bias_swiglu_fusion", True) if _get(cfg, "swiglu", False)
                         else _get(cfg, "bias_gelu_fusion", True)),
        "fuse_softmax": bool(attention == "unfused" and fp16ish and _get(cfg, "masked_softmax_fusion", True)
                             and _softmax_kernel_fits(cfg, s, int(_get(cfg, "micro_batch_size", 1) or 1), heads)),
        "fuse_rope": bool(_get(cfg, "apply_rope_fusion", True)
                          and _get(cfg, "position_embedding_type", "learned_absolute") in ("rope", "yarn")),
        "dropout_mask": "byte",
        "fuse_bda": bool(_get(cfg, "bias_dropout_fusion", True)),
        "collectives": "direct",
        "grouped_gemm": bool(_get(cfg, "moe_grouped_gemm", False) and _get(cfg, "num_experts", None)
                             and spec == "te"),
        "scores": "call" if spec == "te" and attention == "unfused" else "buffer",
        "torch_norm": "cuda" if spec == "local" else "cpu",
    }


def fused_cross_entropy(cfg: Any) -> str:
    """The `fuse_ce` switch: 'none', or the implementation --cross-entropy-loss-fusion runs ('native' | 'te')."""
    if not _get(cfg, "cross_entropy_loss_fusion", False):
        return "none"
    return str(_get(cfg, "cross_entropy_fusion_impl", "native") or "native")


def attention_kernel(cfg: Any) -> str:
    """'flash' for TE / flash-attn, 'unfused' for the local spec (and the unfused backend)."""
    if _get(cfg, "attention_kernel", None) in SWITCHES["attention"]:
        return _get(cfg, "attention_kernel")  # estimator.args derives it with Megatron's own rules
    impl = _get(cfg, "transformer_impl", "transformer_engine")
    backend = str(_get(cfg, "attention_backend", "auto")).split(".")[-1]
    if backend in ("unfused", "local") or (backend == "auto" and dtype_of(cfg) == "fp32"):
        # flash-attn and cuDNN fused attention take only 16-bit inputs: TE's 'auto' falls back to unfused (an
        # explicit flash backend in fp32 fails on a GPU, but its CPU stand-in traces it: the campaign's fp32 flash)
        return "unfused"
    if _get(cfg, "use_flash_attn", False) or impl == "transformer_engine":
        return "flash"
    return "unfused"


def rank_heads(v: Mapping[str, float]) -> Tuple[float, float]:
    """(attention heads, query groups) on one TP rank, from variables(): megatron-core gives a rank one group
    where there are fewer groups than TP ranks."""
    return v["a"] / v["t"], max(1.0, v["g"] / v["t"])


def indicators(sw: Mapping[str, Any]) -> Dict[str, int]:
    """The switch indicators (INDICATORS) of a switch dict."""
    return {name: int(sw.get(k) == v) for name, (k, v) in INDICATORS.items()}


def switches(cfg: Any, env: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """The config's switches (SWITCHES); env: variables(cfg), when the caller has it already."""
    rg = _get(cfg, "recompute_granularity", None)
    if _get(cfg, "recompute_activations", False) and not rg:
        rg = "selective"
    pos = _get(cfg, "position_embedding_type", "learned_absolute")
    v = env if env is not None else variables(cfg)
    dtype = dtype_of(cfg)
    kern = kernels(cfg)
    a_rank, g_rank = rank_heads(v)
    position = "rope" if pos in ("rope", "mrope", "yarn") else pos if pos in SWITCHES["position"] else "none"
    return {
        "attention": kern["attention"],
        "mla": bool(_get(cfg, "multi_latent_attention", False)),
        "q_lora": bool(_get(cfg, "multi_latent_attention", False)) and bool(_get(cfg, "q_lora_rank", None)),
        "qk_norm": qk_norm_of(cfg),
        "output_gate": bool(_get(cfg, "attention_output_gate", False)),
        "mtp": bool(_get(cfg, "mtp_num_layers", 0)),
        "mtp_shared": bool(_get(cfg, "mtp_num_layers", 0))
        and (_get(cfg, "pipeline_model_parallel_size", 1) or 1) == 1,
        "sp": bool(_get(cfg, "sequence_parallel", False)),
        "recompute": rg if rg in ("selective", "full") else "none",
        # --quick-geglu is a gated unit too: fc1 output 2 x ffn, the product ffn; its activations are modelled by
        # the swiglu formulas (the same tensors; a quick-GELU instead of a SiLU)
        "activation": "swiglu" if _get(cfg, "swiglu", False) or _get(cfg, "quick_geglu", False)
        else "squared_relu" if _get(cfg, "squared_relu", False) else "gelu",
        "dtype": dtype,
        "position": position,
        "normalization": "RMSNorm" if _get(cfg, "normalization", "LayerNorm") == "RMSNorm" else "LayerNorm",
        "moe": bool(v["E"]),
        # The token dispatcher gathers / exchanges tokens only over an expert group larger than one rank, which
        # changes the MoE layer's allocation pattern (measured: megatron-core 0.16.1, allgather dispatcher).
        "moe_comm": bool(v["E"]) and v["ep"] * v["etp"] > 1,
        "dropout": bool(_get(cfg, "hidden_dropout", 0.1) or _get(cfg, "attention_dropout", 0.1)),
        "gqa": v["g"] != v["a"],
        "tp": v["t"] > 1,
        # Megatron-LM runs the unfused attention softmax of a 16-bit model in its dtype unless
        # --attention-softmax-in-fp32 (or --apply-query-key-layer-scaling, which implies it) is given.
        "softmax_fp32": dtype == "fp32" or bool(_get(cfg, "attention_softmax_in_fp32", False)
                                                or _get(cfg, "apply_query_key_layer_scaling", False)),
        # Linear biases (bias-dropout-add and bias-activation code keep other tensors) and tied embeddings (the
        # output layer's weight gradient is the embedding's, freed in its backward): composed sets split on them.
        # Under pipeline parallelism the last stage's output layer holds its own copy of the tied weight (synced by
        # the embedding group's all-reduce), used once in its chunk like an untied one.
        "bias": bool(_get(cfg, "add_bias_linear", True)),
        "tied": not _get(cfg, "untie_embeddings_and_output_weights", False)
        and (_get(cfg, "pipeline_model_parallel_size", 1) or 1) == 1,
        **{k: kern[k] for k in ("spec", "fuse_act", "fuse_softmax", "fuse_rope", "dropout_mask",
                                     "fuse_bda", "collectives", "grouped_gemm", "scores",
                                     "torch_norm")},
        "fuse_ce": fused_cross_entropy(cfg),
        "mb1": v["b"] == 1,
        "qcopy": 1 < g_rank < a_rank,
        "qcore": kern["attention"] == "unfused" and g_rank == 1 < a_rank and v["b"] > 1 and position != "rope",
        "a2a": bool(v["E"]) and _get(cfg, "moe_token_dispatcher_type", "allgather") == "alltoall",
        "le1": bool(v["E"]) and v["E"] <= max(1, v["ep"]),
        "epx": bool(v["E"]) and v["ep"] > 1,
        "pre_softmax": bool(v["E"]) and bool(_get(cfg, "moe_router_pre_softmax", False))
        and _get(cfg, "moe_router_score_function", "softmax") == "softmax",
    }


# ---------------------------------------------------------------- selection / evaluation

def select(fset: FormulaSet, op: str, sw: Any) -> Optional[Formula]:
    """The matching formula for `op` with the most `when` keys (first in file order on ties), with any quantity
    the set leaves undetermined (or an op it lacks) taken from its fallback set. `sw` is a switch dict or a config.
    None when neither set has a formula for the op/switches."""
    return _selection(fset, op, sw)[0]


def select_and_fallbacks(fset: FormulaSet, op: str, sw: Any) -> Tuple[Optional[Formula], Tuple[Tuple[str, str], ...]]:
    """(select(fset, op, sw), fallbacks_used(fset, op, sw)) from one lookup."""
    return _selection(fset, op, sw)


def fallbacks_used(fset: FormulaSet, op: str, sw: Any) -> Tuple[Tuple[str, str], ...]:
    """The (op, quantity) pairs that select(fset, op, sw) takes from the fallback set. `fset.fallbacks` gathers
    them over every selection the process ever made; a report lists only its own estimate's (this)."""
    return _selection(fset, op, sw)[1]


def _selection(fset: FormulaSet, op: str, sw: Any) -> Tuple[Optional[Formula], Tuple[Tuple[str, str], ...]]:
    """(select's formula, the (op, quantity) pairs it took from the fallback set), searched once per (op, switches)
    -- the set's formulas are fixed once loaded."""
    if not isinstance(sw, dict) or "attention" not in sw:
        sw = switches(sw)
    try:
        key = ("select", op, tuple(sw.items()))
        return fset._cache[key]
    except TypeError:  # unhashable switch values: search every time
        key = None
    except KeyError:
        pass
    found = next((fo for fo in fset._by_op.get(op, ()) if fo.matches(sw)), None)
    gaps = [q for q in QUANTITIES if found is None or getattr(found, q) is None]
    used: Tuple[Tuple[str, str], ...] = ()
    if gaps and fset.fallback is not None:
        backup = select(fset.fallback, op, sw)
        if backup is not None:
            if found is None:
                found = backup
            else:
                found = Formula(found.op, found.per, found.when,
                                *(getattr(backup if q in gaps else found, q) for q in QUANTITIES))
            used = tuple((op, q) for q in gaps)
            fset.fallbacks.update(used)
    if found is not None and any(getattr(found, q) is None for q in QUANTITIES):
        found = Formula(found.op, found.per, found.when, *(getattr(found, q) or () for q in QUANTITIES))
    if key is not None:
        fset._cache[key] = (found, used)
    return found, used


def evaluate_selected(fset: FormulaSet, op: str, fo: Formula, env: Mapping[str, float]) -> Tuple[float, float, float]:
    """(saved, fwd_peak, bwd_peak) of `op` by its selected formula `fo`, the transients raised to the maximum over
    the op's point formulas (FORMATS 4) where the set has them."""
    saved, fwd, bwd = fo.evaluate(env)
    for pf in point_formulas(fset, op, fo.when):
        _, pf_fwd, pf_bwd = pf.evaluate(env)
        fwd, bwd = max(fwd, pf_fwd), max(bwd, pf_bwd)
    return (saved, fwd, bwd)


def rows_evaluator(fset: FormulaSet, ops: Tuple[str, ...], sw: Dict[str, Any]) -> Optional[tuple]:
    """(fn, fallbacks) for a run of ops under switches `sw`: fn(env) gives [(op, saved, fwd_peak, bwd_peak)] per
    op, equal to evaluate_selected for each op's selection ((op, 0.0, 0.0, 0.0) where none), and `fallbacks` the
    (op, quantity) pairs those selections took from the fallback set. One function compiled per (ops, switches):
    a layer's dozen ops and their point formulas cost one call. None (evaluate op by op) for unhashable switch
    values, and for the first _COMPILE_AFTER asks: compiling costs more than a one-shot CLI run saves."""
    try:
        key = ("rows", ops, tuple(sw.items()))
        hit = fset._cache.get(key, 0)
    except TypeError:
        return None
    if hit.__class__ is int:
        if hit < _COMPILE_AFTER:
            fset._cache[key] = hit + 1
            return None
    else:
        return hit
    consts: Dict[str, Any] = {"max": max}
    body, used_all = [], []
    for i, op in enumerate(ops):
        consts[f"o{i}"] = op
        fo, used = select_and_fallbacks(fset, op, sw)
        used_all += used
        if fo is None:
            body.append(f"    r{i} = (o{i}, 0.0, 0.0, 0.0)")
            continue
        # evaluate_selected: the formula's three quantities, then each point formula's (all three evaluated,
        # as Formula.evaluate does), the transients raised to their maximum in order.
        body.append("    s, f, b = " + ", ".join(_quantity_exprs((fo.saved, fo.fwd_peak, fo.bwd_peak), consts)))
        for pf in point_formulas(fset, op, fo.when):
            body.append("    _, pf, pb = " + ", ".join(_quantity_exprs((pf.saved, pf.fwd_peak, pf.bwd_peak), consts)))
            body.append("    f, b = max(f, pf), max(b, pb)")
        body.append(f"    r{i} = (o{i}, s, f, b)")
    src = "def rows(env):\n" + "\n".join(body) + "\n    return [" + ", ".join(f"r{i}" for i in range(len(ops))) + "]\n"
    ns: Dict[str, Any] = {"__builtins__": {}, **consts}
    exec(src, ns)  # noqa: S102 -- source built above from validated parts
    hit = fset._cache[key] = (ns["rows"], tuple(used_all))
    return hit


def evaluate(fset: FormulaSet, op: str, cfg: Any, sw: Optional[Dict[str, Any]] = None,
             env: Optional[Dict[str, float]] = None) -> Tuple[float, float, float]:
    """(saved, fwd_peak, bwd_peak) bytes of `op` for `cfg`; zeros when the set has no formula for it."""
    sw = sw if sw is not None else switches(cfg)
    fo = select(fset, op, sw)
    if fo is None:
        return (0.0, 0.0, 0.0)
    return evaluate_selected(fset, op, fo, env if env is not None else variables(cfg))


def point_formulas(fset: FormulaSet, op: str, when: Tuple[Tuple[str, Any], ...]) -> Tuple[Formula, ...]:
    """The point formulas `<op>#<k>` of `op` fitted with the formula whose `when` is `when` (FORMATS 4): the op's
    transient is the maximum over them and its own formula's."""
    key = ("points", op, when)
    hit = fset._cache.get(key)
    if hit is None:
        prefix = op + "#"
        hit = fset._cache[key] = tuple(fo for fo in fset.formulas if fo.op.startswith(prefix) and fo.when == when)
    return hit
