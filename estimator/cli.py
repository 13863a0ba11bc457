"""`get_training_info.py`: a Megatron command line in, a memory and communication report out.

Imports no torch and no megatron. Errors in the input are one line on stderr and exit code 2.
"""
from __future__ import annotations

from typing import Optional

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
from estimator.report_json import json_chunks
from estimator import report as R
from estimator import torchrun as TR
from estimator import verdict as V
from estimator.args import ConfigError, TrainingConfig, parse_args
from estimator.moe_tokens import DEFAULT_IMBALANCE

PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")

USAGE = """usage: get-training-info [torchrun flags] [TRAINING_SCRIPT] [Megatron-LM flags] [options]

Offline memory and communication estimate for a Megatron-LM GPT training job. Takes the command line
that follows `torchrun` (or `python -m torch.distributed.run`) in a launch script: torchrun's flags
(--nproc_per_node x --nnodes give the world size), the training script (not run, not read), its
Megatron-LM flags. Flags that do not change memory or communication are listed once as ignored;
one Megatron-LM does not have is an error; one whose effect is not modelled is refused.
Options may also come from the environment variable MEMTRACE_ARGS, e.g.
MEMTRACE_ARGS="--gpu-memory H100-80GB --json" bash estimate.sh

  --gpu-memory GIB|NAME   verdict per pipeline stage: fits with N GiB headroom / does not fit by
                          N GiB. NAME: {gpus}
  --exit-code             with --gpu-memory: exit 1 when some stage does not fit (0: all fit;
                          2: bad input)
  --cuda-context-gib X    allowance for the CUDA context per GPU (default {ctx:g})
  --nccl-gib-per-communicator X   allowance per NCCL communicator (default {nccl:g})
  --fragmentation-percent X       caching-allocator fragmentation, % of the peak (default: the
                          modelled reserved minus allocated; {frag:g} with --search)
  --cuda-alloc-conf CONF  PyTorch caching-allocator settings for the modelled reserved memory, as
                          PYTORCH_CUDA_ALLOC_CONF (default: $PYTORCH_ALLOC_CONF or
                          $PYTORCH_CUDA_ALLOC_CONF when set), e.g. expandable_segments:True
  --torch-adam            neither Transformer Engine nor apex is installed: megatron-core steps with
                          torch's AdamW, whose multi-tensor step holds an fp32 temporary per
                          parameter of a whole group (default: TE / apex FusedAdam, in place)
  --detail N              0 summary only; 1 (default) + memory by category, per-rank table,
                          communication per dimension; 2 + model tree, every collective, process
                          groups; 3 + every stage's tree
  --png FILE              each pipeline stage's predicted memory over the schedule (matplotlib)
  --memory-snapshot FILE  the predicted allocations of every pipeline stage (stage r as device r), as
                          the pickle torch.cuda.memory._snapshot() writes: open it in PyTorch's
                          memory_viz beside a snapshot of the real run
  --preset NAME           prepend a bundled model preset's flags (your flags after it win):
                          {presets}
  --hf-config FILE        the model shape from a HuggingFace config.json (Llama, Mistral, Mixtral,
                          Qwen2/3 and their MoE, DeepSeek-V2/V3, GPT-2)
  --moe-imbalance F       dropless MoE: assume no expert receives more than F times its balanced
                          share of routed tokens (F >= 1; default {imb:g}, the bound a fresh
                          router's natural routing stayed within: README, Accuracy); with
                          --moe-expert-capacity-factor C the bound is also C, with
                          --moe-pad-expert-input-to-capacity exactly C
  --formulas NAME|FILE    activation formula set: a shipped name ({sets})
                          or a formula-set JSON file; default {default} (measured from traces)
  --json                  print the estimate as JSON (bytes) instead of the text report
  --search                with --gpu-memory: try every parallel layout Megatron accepts for this
                          model and world size (TP, PP, VPP, CP, EP, expert TP, micro batch,
                          recompute, distributed optimizer); list those whose every stage fits with
                          the allowances above, least communication per rank first, then least
                          pipeline bubble (--exit-code: exit 1 when none fits)
  --top N                 how many layouts --search lists (default 20)
"""

ENV_ARGS = TR.ENV_ARGS


@dataclass
class Report:
    """Everything the text and JSON renderers need, computed once."""
    cfg: TrainingConfig
    formula_set: F.FormulaSet
    estimate: MEM.Estimate
    layout: PAR.ParallelLayout
    comm: C.CommReport
    _rank_params: Optional[list] = None
    budget: Optional[V.Budget] = None   # allowances and, with --gpu-memory, the verdict (estimator.verdict)
    reserved: Optional[object] = None   # estimator.reserved.ReservedModel: modelled reserved memory per stage

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


# This tool's own options: name -> (key, kind). Kinds: flag (no value), str, int, float, preset.
OWN_OPTIONS = {
    "--json": ("json", "flag"), "--exit-code": ("exit_code", "flag"), "--search": ("search", "flag"),
    "--top": ("top", "int"),
    "--formulas": ("formulas", "str"), "--preset": ("preset", "preset"), "--png": ("png", "str"),
    "--memory-snapshot": ("memory_snapshot", "str"),
    "--gpu-memory": ("gpu_memory", "str"), "--detail": ("detail", "int"),
    "--cuda-context-gib": ("cuda_context_gib", "float"),
    "--nccl-gib-per-communicator": ("nccl_gib_per_communicator", "float"),
    "--fragmentation-percent": ("fragmentation_percent", "float"),
    "--cuda-alloc-conf": ("cuda_alloc_conf", "str"),
    "--torch-adam": ("torch_adam", "flag"),
}


def split_own_options(argv: list[str]) -> tuple[list[str], dict]:
    """Take this tool's own options out; everything else is the torchrun line. A torchrun line with a training
    script (`--nproc_per_node 8 pretrain_gpt.py --num-layers ...`) becomes the world flags plus the script's
    flags; preset flags go first, so the user's flags after them win."""
    own = {"json": False, "exit_code": False, "formulas": None, "help": False, "png": None, "gpu_memory": None,
           "memory_snapshot": None,
           "detail": 1, "cuda_context_gib": None, "nccl_gib_per_communicator": None, "fragmentation_percent": None,
           "search": False, "top": 20, "cuda_alloc_conf": None, "torch_adam": False}
    rest: list[str] = []
    preset_flags: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        spec = OWN_OPTIONS.get(name)
        if a in ("-h", "--help"):
            own["help"] = True
        elif spec is None or (spec[1] == "flag" and eq):
            rest.append(a)
        elif spec[1] == "flag":
            own[spec[0]] = True
        else:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise UsageError(f"{name} needs a value")
                i += 1
                val = argv[i]
            if not val:
                raise UsageError(f"{name} needs a value, got an empty one")
            if spec[1] == "preset":
                preset_flags += _preset_flags(val)
            elif spec[1] == "str":
                own[spec[0]] = val
            else:
                try:
                    num = int(val) if spec[1] == "int" else float(val)
                except ValueError:
                    raise UsageError(f"{name}: expected a{'n integer' if spec[1] == 'int' else ' number'}, "
                                     f"got '{val}'") from None
                if not num >= 0 or num == float("inf"):
                    raise UsageError(f"{name}: must be a finite number >= 0, got '{val}'")
                own[spec[0]] = num
        i += 1
    if own["exit_code"] and own["gpu_memory"] is None:
        raise UsageError("--exit-code needs --gpu-memory (what would fit?)")
    if own["detail"] > 3:
        raise UsageError(f"--detail: 0, 1, 2 or 3, got {own['detail']}")
    if own["top"] < 1:
        raise UsageError(f"--top: must be at least 1, got {own['top']}")
    line = TR.split(rest)
    return preset_flags + line.world_flags() + line.script_args, own


def _merged_stage_params(cfg: TrainingConfig) -> list:
    vpp = MODEL.virtual_stages(cfg)
    stages = []
    for pp_rank in range(cfg.pipeline_model_parallel_size):
        chunks = [MODEL.rank_params(cfg, pp_rank, vp if vpp > 1 else None) for vp in range(vpp)]
        merged = MODEL.RankParams(pp_rank, None, [op for ch in chunks for op in ch.ops])
        stages.append(merged)
    return stages


def build_report(argv: list[str], formulas: Optional[str] = None, reserved: bool = True,
                 device: str = "cuda", kernels: Optional[dict] = None) -> Report:
    """Parse, validate and estimate; raises ConfigError / FormulaError with a one-line message. reserved=False
    leaves out the caching-allocator replay (estimator.reserved; tens of milliseconds on large layouts): the
    verdict then takes fragmentation as a percent of the peak, as --search does. device="cpu": the same run on
    the CPU (no GPU-only runtime buffers; for comparisons with CPU traces). `kernels`: the kernel families a
    traced run recorded (the accuracy benchmarks predict CPU runs); else what a GPU runs for the flags."""
    megatron_argv, own = split_own_options(argv)
    cfg = parse_args(megatron_argv)
    if kernels is not None:
        cfg.kernels = dict(kernels)
    cfg.torch_adam = own["torch_adam"]
    fset = F.load(own["formulas"] or formulas or F.DEFAULT_SET)
    if fset.profiled.get("device") == "cpu" and kernels is None:
        # a set profiled on CPU (profile-training-info --campaign --cpu) predicts CPU runs of the kernels it traced
        cfg.kernels, device = dict(fset.profiled.get("kernels") or {}), "cpu"
    chunks = MEM.all_param_chunks(cfg)  # shared by the static memory and the DP communication rows
    est = invariants.checked_estimate(cfg, fset, chunks_by_stage=chunks, device=device)
    layout = PAR.layout_from_config(cfg)
    comm = C.communication(cfg, layout, chunks)
    invariants.check_comm(comm)
    report = Report(cfg, fset, est, layout, comm)
    if reserved:
        from estimator import reserved as RES   # the caching-allocator replay: single estimates only (not --search)
        report.reserved = RES.model(cfg, fset, est, own["cuda_alloc_conf"])
    gpu = V.parse_gpu(own["gpu_memory"]) if own["gpu_memory"] is not None else None
    allow = {k: own[k] for k in V.DEFAULTS}
    if device == "cpu":     # a CPU run (a CPU-profiled set): no CUDA context or NCCL buffers beside the tensors
        allow = {**allow, **{k: 0.0 for k in ("cuda_context_gib", "nccl_gib_per_communicator") if allow[k] is None}}
    report.budget = V.budget(report, gpu, **allow)
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


def _with_env_options(argv: list[str]) -> list[str]:
    """Options from $MEMTRACE_ARGS go after the command line's: a launch script need not forward "$@"."""
    import shlex
    extra = os.environ.get(ENV_ARGS, "")
    try:
        return argv + shlex.split(extra)
    except ValueError as exc:
        raise UsageError(f"{ENV_ARGS}: {exc}") from None


def _search(argv: list[str], own: dict) -> int:
    """--search: the layouts that fit on --gpu-memory with the verdict's allowances, best first."""
    from estimator import search as SEARCH  # only with --search
    if own["gpu_memory"] is None:
        raise UsageError("--search needs --gpu-memory GIB|NAME (the memory of one GPU)")
    megatron_argv, _ = split_own_options(argv)
    gpu = V.parse_gpu(own["gpu_memory"])
    allowances = {k: own[k] for k in V.DEFAULTS}
    fset = F.load(own["formulas"] or F.DEFAULT_SET)
    result = SEARCH.search(megatron_argv, gpu.bytes, fset, progress=sys.stderr.isatty(), allowances=allowances,
                           gpu_name=gpu.name, torch_adam=own["torch_adam"])
    write_quietly(lambda: sys.stdout.write(dumps_indent1(SEARCH.to_json(result, own["top"])) + "\n" if own["json"]
                                           else SEARCH.to_text(result, own["top"])))
    return 1 if own["exit_code"] and not result.fits else 0


def write_quietly(write) -> None:
    """Run `write` (output to stdout) and flush. A reader that went away (`--json | head -1`) ends the output
    quietly: stdout then points at /dev/null, so no later flush (ours, the interpreter's at exit) complains."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = _with_env_options(argv)
        _, own = split_own_options(argv)
        if own["help"]:
            import textwrap
            def fill(items, first):  # wrapped at 98 columns under the option texts, the first line at `first`
                return textwrap.fill(", ".join(items), 98, initial_indent=" " * first,
                                     subsequent_indent=" " * 26).lstrip()
            print(USAGE.format(presets=fill(presets(), 26) or "none", sets=", ".join(F.shipped_sets()),
                               default=F.DEFAULT_SET,
                               gpus=fill(V.GPUS, 39),
                               ctx=V.DEFAULTS["cuda_context_gib"],
                               nccl=V.DEFAULTS["nccl_gib_per_communicator"],
                               frag=V.DEFAULTS["fragmentation_percent"], imb=DEFAULT_IMBALANCE))
            return 0
        if own["search"]:
            return _search(argv, own)
        report = build_report(argv)
        if own["png"]:
            from estimator import plot
            try:
                plot.save(report, own["png"])
            except plot.PlotError as exc:
                raise UsageError(str(exc)) from None
        if own["memory_snapshot"]:
            from estimator import reserved as RES
            from estimator import snapshot
            conf, _ = RES.allocator_settings(own["cuda_alloc_conf"])
            snapshot.save(report.cfg, report.formula_set, report.estimate, own["memory_snapshot"], conf)
    except (ConfigError, F.FormulaError, PAR.ParallelConfigError, V.GPUMemoryError,
            invariants.EstimateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    def write():
        if own["json"]:
            sys.stdout.writelines(json_chunks(report))
            sys.stdout.write("\n")
        else:
            sys.stdout.write(R.to_text(report, detail=own["detail"]))
    write_quietly(write)
    if own["exit_code"] and report.budget.fits is False:
        return 1
    return 0


def console_main() -> None:
    """Entry point of the installed `get-training-info` command (and of get_training_info.py)."""
    import gc
    gc.disable()   # a one-shot run: garbage collection passes and the teardown below are pure overhead
    rc = 0
    try:
        rc = main()
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing left to report
        pass
    os._exit(rc)   # skips the interpreter's teardown of every module and object
