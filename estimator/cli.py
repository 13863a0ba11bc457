"""`get_training_info.py`: a Megatron command line in, a memory and communication report out.

Imports no torch and no megatron. Errors in the input are one line on stderr and exit code 2.
"""
from __future__ import annotations

import os
import sys
from estimator._record import dataclass

from estimator import comm as C
from estimator import formulas as F
from estimator import invariants
from estimator import jsonload
from estimator import memory as MEM
from estimator import model as MODEL
from estimator import parallel as PAR
from estimator import report as R
from estimator.args import ConfigError, TrainingConfig, parse_args

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")

USAGE = """usage: get_training_info.py [torchrun flags] [Megatron-LM flags] [--preset NAME] [--hf-config config.json]
                            [--formulas NAME|FILE] [--json] [--help]

Offline memory and communication estimate for a Megatron-LM GPT training job. Takes the same flags as
`torchrun ... pretrain_gpt.py` (torchrun's --nproc_per_node/--nnodes give the world size); flags that do not
change memory or communication are accepted and listed once as ignored.

  --preset NAME        prepend a bundled model preset's flags (your flags after it win): {presets}
  --hf-config FILE     take the model shape from a HuggingFace config.json (Llama, Mistral, Mixtral, Qwen2, GPT-2)
  --formulas NAME|FILE activation formula set: a shipped name ({sets}) or a formula-set JSON file
  --json               print the estimate as JSON (bytes) instead of the text report
"""


@dataclass
class Report:
    """Everything the text and JSON renderers need, computed once."""
    cfg: TrainingConfig
    formula_set: F.FormulaSet
    estimate: MEM.Estimate
    layout: PAR.ParallelLayout
    comm: C.CommReport
    _rank_params: Optional[list] = None

    @property
    def rank_params(self) -> list:
        """model.RankParams per pipeline stage (virtual stages merged); built when a renderer first asks."""
        if self._rank_params is None:
            self._rank_params = _merged_stage_params(self.cfg)
        return self._rank_params


class UsageError(ConfigError):
    pass


def presets() -> list[str]:
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


_PRESET_FLAGS: dict = {}  # name -> flags: presets are package data, read once per process


def _preset_flags(name: str) -> list[str]:
    flags = _PRESET_FLAGS.get(name)
    if flags is None:
        if name not in presets():   # a name, never a path: '../x' must not read a file elsewhere
            raise UsageError(f"unknown preset '{name}'; available: {', '.join(presets())}")
        path = os.path.join(PRESET_DIR, name + ".json")
        with open(path) as fh:
            doc = jsonload.load(fh)
        flags = _PRESET_FLAGS[name] = [str(x) for x in doc["args"]]
    return list(flags)


def split_own_options(argv: list[str]) -> tuple[list[str], dict]:
    """Take this tool's own options out; everything else is a Megatron/torchrun flag."""
    own = {"json": False, "formulas": None, "help": False}
    rest: list[str] = []
    preset_flags: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key, eq, val = a.partition("=")
        if a in ("-h", "--help"):
            own["help"] = True
        elif a == "--json":
            own["json"] = True
        elif key in ("--formulas", "--preset"):
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise UsageError(f"{key} needs a value")
                i += 1
                val = argv[i]
            if not val:
                raise UsageError(f"{key} needs a value, got an empty one")
            if key == "--formulas":
                own["formulas"] = val
            else:
                preset_flags += _preset_flags(val)
        else:
            rest.append(a)
        i += 1
    return preset_flags + rest, own


def _merged_stage_params(cfg: TrainingConfig) -> list:
    vpp = MODEL.virtual_stages(cfg)
    stages = []
    for pp_rank in range(cfg.pipeline_model_parallel_size):
        chunks = [MODEL.rank_params(cfg, pp_rank, vp if vpp > 1 else None) for vp in range(vpp)]
        merged = MODEL.RankParams(pp_rank, None, [op for ch in chunks for op in ch.ops])
        stages.append(merged)
    return stages


def build_report(argv: list[str], formulas: Optional[str] = None) -> Report:
    """Parse, validate and estimate; raises ConfigError / FormulaError with a one-line message."""
    megatron_argv, own = split_own_options(argv)
    cfg = parse_args(megatron_argv)
    fset = F.load(own["formulas"] or formulas or F.DEFAULT_SET)
    chunks = MEM.all_param_chunks(cfg)  # shared by the static memory and the DP communication rows
    try:
        est = MEM.estimate(cfg, fset, chunks_by_stage=chunks)
    except (ZeroDivisionError, OverflowError) as exc:   # a term like E**-1 with E = 0, or a float overflow
        raise F.FormulaError(f"formula set {fset.name!r}: a formula cannot be evaluated for this config ({exc})") \
            from None
    layout = PAR.layout_from_config(cfg)
    comm = C.communication(cfg, layout, chunks)
    report = Report(cfg, fset, est, layout, comm)
    invariants.check(report)
    return report


def dumps_indent1(obj) -> str:
    """json.dumps(obj, indent=1, allow_nan=False), byte for byte, for the JSON types the report holds (dict, list,
    tuple, str, int, float, bool, None). json's encoder is pure Python once an indent is asked for; this one is a little faster.
    Any other type goes to json.dumps for that value (so an unsupported one still raises TypeError there)."""
    enc = jsonload.encode_string
    out: list = []
    emit = out.append
    float_repr = float.__repr__
    int_repr = int.__repr__
    inf = float("inf")

    def fl(o):
        if o != o or o == inf or o == -inf:
            # strict JSON (json.dumps(allow_nan=False)'s message): NaN and Infinity are not JSON
            raise ValueError(f"Out of range float values are not JSON compliant: {o!r}")
        return float_repr(o)

    def key(k):
        if isinstance(k, str):
            return enc(k)
        if k is True:
            return '"true"'
        if k is False:
            return '"false"'
        if k is None:
            return '"null"'
        if isinstance(k, float):
            return enc(fl(k))
        if isinstance(k, int):
            return enc(int_repr(k))
        raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")

    def walk(o, level):
        if isinstance(o, str):
            emit(enc(o))
        elif o is None:
            emit("null")
        elif o is True:
            emit("true")
        elif o is False:
            emit("false")
        elif isinstance(o, int):
            emit(int_repr(o))
        elif isinstance(o, float):
            emit(fl(o))
        elif isinstance(o, (list, tuple)):
            if not o:
                emit("[]")
                return
            nl = "\n" + " " * (level + 1)
            emit("[")
            first = True
            for v in o:
                emit(nl if first else "," + nl)
                first = False
                walk(v, level + 1)
            emit("\n" + " " * level + "]")
        elif isinstance(o, dict):
            if not o:
                emit("{}")
                return
            nl = "\n" + " " * (level + 1)
            emit("{")
            first = True
            for k, v in o.items():
                emit((nl if first else "," + nl) + key(k) + ": ")
                first = False
                walk(v, level + 1)
            emit("\n" + " " * level + "}")
        else:
            import json
            text = json.dumps(o, indent=1, allow_nan=False)  # raises TypeError as json.dump would
            emit(text.replace("\n", "\n" + " " * level))

    walk(obj, 0)
    return "".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _, own = split_own_options(argv)
        if own["help"]:
            print(USAGE.format(presets=", ".join(presets()) or "none", sets=", ".join(F.shipped_sets())))
            return 0
        report = build_report(argv)
    except (ConfigError, F.FormulaError, PAR.ParallelConfigError, invariants.EstimateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        if own["json"]:
            sys.stdout.write(dumps_indent1(R.to_json(report)))
            sys.stdout.write("\n")
        else:
            sys.stdout.write(R.to_text(report))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`--json | head -1`): nothing left to say. stdout now points at /dev/null so the
        # interpreter's own flush at exit stays quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
