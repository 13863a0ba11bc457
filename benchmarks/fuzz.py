"""Seeded fuzzing of every input the tools read: estimator command lines, formula-set files, HF configs, traces.

    python benchmarks/fuzz.py [--seed 0] [--cases 2000] [--kinds cli,formulas,hf,traces] [--time-limit 10]

Each case is a random (mostly damaged) input; the promise checked is the README's: exit 0 with a valid report
(strict JSON, no negative or inconsistent number) or exit 2 with one line on stderr, within the time limit, and
never an exception, a hang or a MemoryError. Estimator cases run in this process (`estimator.cli.main`, a few ms
each) under an address-space limit; trace cases run the public `python -m tracer.report` CLI, one process each.
Prints one summary line per kind and each failure with what reproduces it; exit status 1 if any case failed.
`tests/test_fuzz.py` runs a short seeded pass in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimator import args as A  # noqa: E402
from estimator import cli  # noqa: E402
from estimator import formulas as F  # noqa: E402
from estimator.invariants import SIGNED_OPS  # noqa: E402

# Realistic starting points; mutations are applied on top.
BASES = [
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
    "--micro-batch-size 1 --vocab-size 1000",
    "--nproc_per_node 8 --num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 32 --vocab-size 32000 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --bf16 "
    "--use-distributed-optimizer",
    "--nproc_per_node 4 --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8 --vocab-size 5000 --num-experts 8 "
    "--moe-router-topk 2 --expert-model-parallel-size 4 --disable-bias-linear --moe-token-dispatcher-type alltoall",
    "--nproc_per_node 8 --nnodes 2 --num-layers 16 --hidden-size 128 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 64 --vocab-size 1000 "
    "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --recompute-granularity full "
    "--recompute-method block --recompute-num-layers 1 --fp16",
    "--nproc_per_node 8 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 --bf16 "
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --fp8-format hybrid "
    "--fp8-param-gather --use-distributed-optimizer",   # modelled features: fp8 (a signed per-op row)
]
EDGE_VALUES = ["0", "-1", "1", "2", "3", "7", "8", "64", "100000", "10000000", "10000001", "2147483647",
               "2147483648", "1000000000000", str(2 ** 63), str(2 ** 64), "nan", "inf",
               "-inf", "1e3", "0.5", "x", "", "0x10", "1_0", " 4", "-0", "[1]*4", "([1]*3+[0])*2", "[1]+1",
               "[1]*100000000000", "4:8", "gpu", "auto", "cpu", "\u0663"]
# World sizes stay at most 64 x 64 GPUs (or far beyond the limit, refused at once): estimating 10^5 GPUs and more
# is a scale question with its own benchmark (benchmarks/estimator_speed.py), not an input-handling one.
WORLD_FLAGS = ("--nproc_per_node", "--nproc-per-node", "--nnodes")
WORLD_VALUES = ["0", "-1", "1", "2", "3", "8", "64", "1000000000000", str(2 ** 63), "nan", "x", "", "4:8", "2:64",
                "gpu", "auto", "cpu"]
_GIB_VALUES = ["0", "0.5", "5", "80", "-1", "nan", "inf", "1e400", "x", ""]
# The tool's own options with values ("{tmp}" is the case's scratch folder), and those without.
OWN_VALUES = {"--preset": ["llama2_7b", "mixtral_8x7b", "../presets/llama2_7b", "/etc/passwd", "", "nope"],
              "--formulas": ["modelled", "gpu_h100", "cpu_compose", "", "/dev/null", "/nonexistent.json", "."],
              "--hf-config": ["/dev/null", "/nonexistent.json", ".", "/dev/zero"],
              "--gpu-memory": ["80", "H100-80GB", "h200", "B200", "0.001", "1e400"] + _GIB_VALUES,
              "--detail": ["0", "1", "2", "3", "4", "-1", "x", ""],
              "--top": ["1", "3", "0", "-1", "x", str(2 ** 64)],
              "--cuda-context-gib": _GIB_VALUES, "--nccl-gib-per-communicator": _GIB_VALUES,
              "--fragmentation-percent": _GIB_VALUES + ["1000"],
              "--png": ["{tmp}/plot.png", "/nonexistent/dir/plot.png", "", "{tmp}"]}
OWN_SWITCHES = ["--exit-code", "--search", "--json"]


class CaseTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise CaseTimeout()


# --- checking an outcome ----------------------------------------------------------------------------------------

def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def check_outcome(rc, out: str, err: str, json_mode: bool, search: bool = False, exit_code: bool = False) -> str | None:
    """None when the outcome keeps the promise, else what is wrong."""
    if rc == 2:
        if out:
            return "exit 2 with output on stdout"
        if not (err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1):
            return f"exit 2 without exactly one 'error:' line: {err[:300]!r}"
        return None
    if rc != 0 and not (rc == 1 and exit_code):   # --exit-code: 1 = does not fit (or no layout fits)
        return f"exit {rc}: {err[-300:]!r}"
    if "Traceback" in err:
        return f"traceback on stderr: {err[-300:]!r}"
    if not json_mode:
        numbers = out.split("\nIgnored")[0].split()   # the Ignored line echoes the user's own tokens
        bad = {"nan", "inf", "-inf"} & {w.lower().strip(",()") for w in numbers}
        head = "Layout search:" if search else "megatron-memtrace estimate"
        return None if out.startswith(head) and not bad else f"text report incomplete or with {bad}"
    try:
        doc = json.loads(out, parse_constant=_reject_constant)
    except ValueError as exc:
        return f"exit {rc} but not strict JSON: {exc}"
    return check_search(doc) if search else check_report(doc)


def check_search(doc: dict) -> str | None:
    """--search --json: counts that add up, and each listed layout's bytes nonnegative, its total over its peak."""
    if not 0 <= doc["fits"] <= doc["accepted"] <= doc["enumerated"] or len(doc["layouts"]) > doc["fits"]:
        return f"search counts {doc['enumerated']}, {doc['accepted']}, {doc['fits']}, {len(doc['layouts'])}"
    for lay in doc["layouts"]:
        if not 0 <= lay["peak_bytes"] <= lay["total_bytes"] <= doc["gpu_bytes"] or lay["comm_bytes_per_rank_per_iteration"] < 0:
            return f"search layout with impossible bytes {lay}"
    return None


def check_report(doc: dict) -> str | None:
    """The estimate's numbers: integers, nonnegative, categories summing to each peak (JSON rounds each)."""
    if doc.get("format") != "megatron-memtrace-estimate":
        return "exit 0 but not an estimate"
    peak = doc["max_peak_bytes"]
    if not isinstance(peak, int) or peak < 0:
        return f"max_peak_bytes {peak!r}"
    for where in doc["stages"] + doc["ranks"][:64]:
        cats = where["bytes"]
        if any(not isinstance(v, int) or v < 0 for v in cats.values()):
            return f"negative or non-integer bytes {cats}"
        # each category is rounded to whole bytes; past 2**53 the float sums themselves round (as the report's own
        # check allows: 1 byte plus 1e-9 relative)
        if abs(sum(cats.values()) - where["peak_bytes"]) > len(cats) + 1e-9 * where["peak_bytes"]:
            return f"categories {cats} do not sum to the peak {where['peak_bytes']}"
    # a fitted (program) set's `saved` rows are net: an op's own code frees what earlier ops handed it
    # (estimator.invariants._signed), so they may be negative there
    net_saved = doc.get("formula_set", {}).get("kind") == "fitted"
    for st in doc["stages"]:
        for op in st["ops"]:
            signed = op["op"] in SIGNED_OPS   # the estimator's own signed corrections (fp8's saved inputs)
            if any(k.endswith("_bytes") and v < 0 and not signed and not (net_saved and k == "saved_bytes")
                   for k, v in op.items()) or op["params"] < 0:
                return f"negative op row {op}"
    if max(r["peak_bytes"] for r in doc["stages"]) != peak:
        return "max_peak_bytes is not the largest stage peak"
    return None


def run_estimator(argv: list, time_limit: float) -> tuple:
    """(failure or None, seconds, exit code) of the CLI in this process."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    except CaseTimeout:
        return f"over the {time_limit:g} s limit", time.perf_counter() - t0, None
    except BaseException as exc:  # noqa: BLE001 -- anything escaping main is what the fuzz looks for
        return f"{type(exc).__name__} escaped: {str(exc)[:200]}", time.perf_counter() - t0, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    dt = time.perf_counter() - t0
    return check_outcome(rc, out.getvalue(), err.getvalue(), "--json" in argv, "--search" in argv,
                         "--exit-code" in argv), dt, rc


# --- generators -------------------------------------------------------------------------------------------------

def _numeric_flags():
    return sorted(f for f, (_, kind) in A._FLAGS.items() if kind in ("int", "float", "nproc", "nnodes", "layer_freq"))


def random_command_line(rng: random.Random, tmp: str = ".") -> list:
    argv = rng.choice(BASES).split()
    if rng.random() < 0.3:   # a verdict, which --exit-code and --search need
        argv += ["--gpu-memory", rng.choice(["80", "H100-80GB", "h200", "24"])]
    numeric = _numeric_flags()
    switches = sorted(f for f, (_, kind) in A._FLAGS.items() if kind in ("true", "false"))
    choices = sorted(f for f, (dest, _) in A._FLAGS.items() if dest in A._CHOICES)
    for _ in range(rng.randint(0, 4)):
        what = rng.random()
        if what < 0.45:
            flag = rng.choice(numeric)
            value = rng.choice(WORLD_VALUES if flag in WORLD_FLAGS else EDGE_VALUES)
            argv += [flag + "=" + value] if rng.random() < 0.2 else [flag, value]
        elif what < 0.6:
            argv.append(rng.choice(switches))
        elif what < 0.7:
            flag = rng.choice(choices)
            argv += [flag, rng.choice(A._CHOICES[A._FLAGS[flag][0]] + ["junk", ""])]
        elif what < 0.77:
            flag = rng.choice(sorted(OWN_VALUES))
            argv += [flag, rng.choice(OWN_VALUES[flag]).replace("{tmp}", tmp)]
        elif what < 0.8:
            argv.append(rng.choice(OWN_SWITCHES))
        elif what < 0.87 and argv:
            del argv[rng.randrange(len(argv))]
        elif what < 0.93:
            argv.append(rng.choice(numeric + sorted(OWN_VALUES)))   # a flag without its value
        else:
            argv += [rng.choice(["--unknown-flag", "--lr", "--save", "pretrain_gpt.py", "--batch-size"]),
                     rng.choice(EDGE_VALUES)]
    if rng.random() < 0.85:
        argv.append("--json")
    return argv


_JUNK = [None, True, False, -1, 0, 2 ** 64, 10 ** 400, -10 ** 12, 1e308, -1e308, math.nan, math.inf, "x", "1/0",
         "inf", "", [], {}, [1, 2], {"a": 1}, 1.5, "3/4", 10 ** 30]


def damage_formula_set(rng: random.Random, doc: dict) -> tuple:
    """(text, description) of a randomly damaged formula set."""
    doc = copy.deepcopy(doc)
    kind = rng.randrange(9)
    terms = [t for fo in doc["formulas"] for q in F.QUANTITIES for t in (fo.get(q) or [])]
    t = rng.choice(terms)
    if kind == 0:
        t["coef"] = rng.choice(_JUNK)
    elif kind == 1:
        t.setdefault("vars", {})[rng.choice(F.VARIABLES + ("zz",))] = rng.choice(_JUNK + [1000, -1, -2, 2])
    elif kind == 2:
        fo = rng.choice(doc["formulas"])
        fo[rng.choice(["op", "per", "when", "saved", "extra"])] = rng.choice(_JUNK)
    elif kind == 3:
        doc[rng.choice(["format", "version", "kind", "name", "formulas", "provenance"])] = rng.choice(_JUNK)
    elif kind == 4:
        for fo in doc["formulas"]:   # every coefficient negative: negative bytes if nothing stops them
            for q in F.QUANTITIES:
                for term in fo.get(q) or []:
                    term["coef"] = -abs(term["coef"]) if isinstance(term["coef"], int) else "-1"
    elif kind == 5:
        fo = rng.choice(doc["formulas"])
        fo["when"] = {rng.choice(sorted(F.SWITCHES) + ["nope"]): rng.choice(_JUNK + ["flash", "bf16"])}
    text = json.dumps(doc, allow_nan=True, indent=None if rng.random() < 0.5 else 1)
    if kind == 6:
        text = text[:rng.randrange(len(text))]
    elif kind == 7:
        i = rng.randrange(len(text))
        text = text[:i] + chr(rng.randrange(32, 127)) + text[i + 1:]
    elif kind == 8:
        depth = rng.choice([10, 1000, 100000])
        text = "[" * depth + text + "]" * depth
    return text, f"formula damage {kind}"


HF_BASES = [
    {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
     "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024, "vocab_size": 32000,
     "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0},
    {"model_type": "mixtral", "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256,
     "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512, "vocab_size": 1000,
     "num_local_experts": 4, "num_experts_per_tok": 2},
    {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 512, "vocab_size": 1000,
     "activation_function": "gelu_new", "resid_pdrop": 0.1, "attn_pdrop": 0.1},
]


def damage_hf_config(rng: random.Random) -> tuple:
    """(bytes, description) of a randomly damaged HF config.json."""
    hf = copy.deepcopy(rng.choice(HF_BASES))
    kind = rng.randrange(7)
    key = rng.choice(sorted(hf))
    if kind == 0:
        hf[key] = rng.choice(_JUNK + ["false", "true", "64", ["llama"]])
    elif kind == 1:
        del hf[key]
    elif kind == 2:
        hf[key] = -abs(hf[key]) if isinstance(hf[key], int) and not isinstance(hf[key], bool) else hf[key]
    text = json.dumps(hf, allow_nan=True)
    if kind == 3:
        text = text[:rng.randrange(len(text))]
    raw = text.encode(rng.choice(["utf-8", "utf-16", "utf-32", "utf-8-sig"]) if kind == 4 else "utf-8")
    if kind == 5:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    elif kind == 6:
        raw = b"[" * 100000 + raw
    return raw, f"hf damage {kind} on {key!r}"


# --- runners per kind -------------------------------------------------------------------------------------------

def fuzz_cli(rng, cases, time_limit, tmp):
    for i in range(cases):
        argv = random_command_line(rng, tmp)
        yield argv, run_estimator(argv, time_limit)


def fuzz_formulas(rng, cases, time_limit, tmp):
    with open(os.path.join(F.SHIPPED_DIR, "modelled.json")) as fh:
        doc = json.load(fh)
    for i in range(cases):
        text, what = damage_formula_set(rng, doc)
        path = os.path.join(tmp, f"set{i}.json")
        with open(path, "w") as fh:
            fh.write(text)
        # a valid command line: the damage is in the file
        argv = rng.choice(BASES).split() + ["--formulas", path] + (["--json"] if rng.random() < 0.85 else [])
        yield [what] + argv, run_estimator(argv, time_limit)


def fuzz_hf(rng, cases, time_limit, tmp):
    for i in range(cases):
        raw, what = damage_hf_config(rng)
        path = os.path.join(tmp, f"config{i}.json")
        with open(path, "wb") as fh:
            fh.write(raw)
        argv = ["--hf-config", path, "--seq-length", "256", "--micro-batch-size", "1", "--json"]
        if rng.random() < 0.3:
            flag = rng.choice([f for f in _numeric_flags() if f not in WORLD_FLAGS])
            argv += [flag, rng.choice(EDGE_VALUES)]
        yield [what] + argv, run_estimator(argv, time_limit)


TRACE_RUN = os.path.join(ROOT, "fit", "traces", "cpu_local", "base")


def fuzz_traces(rng, cases, time_limit, tmp):
    """Damage the record file of a real CPU trace (a byte flipped, or cut short; compressed or raw) and read it with
    the public `python -m tracer.report --json`. Only the record file: the other files of a run directory have
    their own checks (issue 13 item 3)."""
    import lzma
    src = [f for f in os.listdir(TRACE_RUN) if ".trace" in f]
    for i in range(cases):
        run = os.path.join(tmp, f"trace{i}")
        shutil.copytree(TRACE_RUN, run)
        name = rng.choice(src)
        path = os.path.join(run, name)
        with open(path, "rb") as fh:
            raw = fh.read()
        if name.endswith(".xz") and rng.random() < 0.6:   # the raw record stream, which no xz check covers
            raw = lzma.decompress(raw)
            os.remove(path)
            path = path[:-3]
        cut = rng.random() < 0.4
        if cut:
            raw = raw[:rng.randrange(len(raw))]
        else:
            for _ in range(rng.randint(1, 3)):
                j = rng.randrange(len(raw))
                raw = raw[:j] + bytes([raw[j] ^ (1 << rng.randrange(8))]) + raw[j + 1:]
        with open(path, "wb") as fh:
            fh.write(raw)
        argv = [sys.executable, "-m", "tracer.report", run, "--json"]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=time_limit + 5)
        except subprocess.TimeoutExpired:
            yield [os.path.basename(path), "cut" if cut else "flip"], (f"over the {time_limit:g} s limit",
                                                                       time.perf_counter() - t0, None)
            continue
        dt = time.perf_counter() - t0
        yield [os.path.basename(path), "cut" if cut else "flip"], (_check_trace(res), dt, res.returncode)


def _check_trace(res) -> str | None:
    if res.returncode == 2:
        lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("warning:")]
        return None if len(lines) == 1 and "error" in lines[0] and not res.stdout else \
            f"exit 2 without exactly one error line: {res.stderr[-300:]!r}"
    if res.returncode != 0 or "Traceback" in res.stderr:
        return f"exit {res.returncode}: {res.stderr[-300:]!r}"
    try:
        doc = json.loads(res.stdout, parse_constant=_reject_constant)
    except ValueError as exc:
        return f"exit 0 but not strict JSON: {exc}"
    if any(not isinstance(r.get("peak_bytes"), int) or r["peak_bytes"] < 0 for r in doc.get("ranks", [None])):
        return "exit 0 but a rank without a nonnegative peak"
    return None


KINDS = {"cli": fuzz_cli, "formulas": fuzz_formulas, "hf": fuzz_hf, "traces": fuzz_traces}


def run(seed: int, cases: dict, time_limit: float) -> dict:
    """{kind: {cases, exit0, exit2, failures: [...], slowest_s, seconds}} for one seeded run."""
    signal.signal(signal.SIGALRM, _on_alarm)
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, n in cases.items():
            rng = random.Random(f"{seed}:{kind}")
            s = summary[kind] = {"cases": 0, "exit0": 0, "exit2": 0, "failures": [], "slowest_s": 0.0}
            t0 = time.perf_counter()
            for what, (failure, dt, rc) in KINDS[kind](rng, n, time_limit, tmp):
                s["cases"] += 1
                s["slowest_s"] = max(s["slowest_s"], dt)
                if failure:
                    s["failures"].append({"input": what, "failure": failure})
                elif rc == 0:
                    s["exit0"] += 1
                else:
                    s["exit2"] += 1
            s["seconds"] = time.perf_counter() - t0
    return summary


def _limit_memory(gib: float) -> None:
    """An address-space cap, so a case that would allocate without bound fails as MemoryError here instead of
    taking the machine down."""
    import resource
    limit = int(gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=2000, help="cases per kind (traces: a tenth, one process each)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--memory-limit-gib", type=float, default=4.0)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    _limit_memory(a.memory_limit_gib)
    kinds = [k for k in a.kinds.split(",") if k]
    cases = {k: max(1, a.cases // 10) if k == "traces" else a.cases for k in kinds}
    t0 = time.perf_counter()
    summary = run(a.seed, cases, a.time_limit)
    failed = sum(len(s["failures"]) for s in summary.values())
    if a.json:
        print(json.dumps({"seed": a.seed, "seconds": time.perf_counter() - t0, "kinds": summary}, indent=1))
    else:
        for kind, s in summary.items():
            print(f"{kind:9s} {s['cases']:6d} cases: {s['exit0']:6d} exit 0 (valid report), {s['exit2']:6d} exit 2 "
                  f"(one line), {len(s['failures'])} failed; slowest {s['slowest_s']:.2f} s, {s['seconds']:.1f} s")
            for f in s["failures"]:
                print(f"  FAIL {f['failure']}\n       input: {f['input']}")
        print(f"seed {a.seed}: {failed} failures in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
