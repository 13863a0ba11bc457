"""The offline CLI as a user runs it: a subprocess, the example launch script, exit codes and JSON."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from test_sed_workflow import SED_ESTIMATE, SED_PROFILE  # noqa: E402  (the README's lines)
SMALL = ("--nproc_per_node 4 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --vocab-size 1000 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")


def run_cli(args, **kw):
    return subprocess.run([sys.executable, "get_training_info.py", *args], cwd=ROOT, capture_output=True,
                          text=True, **kw)


@pytest.mark.parametrize("sed, twin", [(SED_ESTIMATE, "estimate_llama2_7b.sh"),
                                       (SED_PROFILE, "profile_llama2_7b.sh")])
def test_sed_twins_are_exactly_the_sed_output(sed, twin):
    src = os.path.join(ROOT, "examples", "pretrain_llama2_7b.sh")
    made = subprocess.run(shlex.split(sed) + [src], capture_output=True, text=True, check=True).stdout
    assert made == open(os.path.join(ROOT, "examples", twin)).read()
    assert made.splitlines()[-8].startswith(("get-training-info ", "profile-training-info "))  # the launch line


def test_example_script_runs_and_reports_every_section():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("MEMTRACE_ARGS", None)
    # Extra arguments reach the estimator through the script's "$@".
    res = subprocess.run(["bash", "examples/estimate_llama2_7b.sh", "--detail", "2"], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for section in ("Verdict", "Peak per pipeline stage", "Model tree", "Per-GPU memory demand", "Per-rank table",
                    "Communication per iteration", "Detail (one row per collective", "Process groups", "Ignored"):
        assert section in out, section
    # the default set is measured, for every op of this config, and the summary says so and from what
    formulas = out.split("Formulas  ")[1].split("\n\n")[0]
    assert formulas.startswith("cpu_compose (default): 100.0% of saved activation bytes measured"), formulas
    assert "the GPU's kernels on CPU stand-ins" in formulas
    # The world of the script: 2 nodes x 8 GPUs; names of the last node appear in the groups.
    assert "n1_g7" in out
    # Flags that do not affect memory are listed once, by name.
    ignored = out.split("Ignored (no effect on memory or communication):")[1]
    assert ignored.count("--lr ") == 1 and "--save-interval" in ignored


def test_json_has_every_rank_with_coordinates_and_bytes():
    res = run_cli(shlex.split(SMALL) + ["--json"])
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["format"] == "megatron-memtrace-estimate" and doc["version"] == 1
    assert len(doc["ranks"]) == 4
    for r in doc["ranks"]:
        assert set(r["coords"]) >= {"tp", "cp", "ep", "dp", "pp"}
        assert set(r["bytes"]) == {"parameters", "gradients", "optimizer_states", "activations", "gpu_runtime",
                                   "other"}
        assert all(isinstance(v, int) for v in r["bytes"].values())
        assert r["peak_bytes"] >= sum(r["bytes"][c] for c in ("parameters", "gradients", "optimizer_states"))
    assert doc["max_peak_bytes"] == max(r["peak_bytes"] for r in doc["ranks"])
    assert doc["ranks"][doc["max_peak_rank"]]["peak_bytes"] == doc["max_peak_bytes"]
    # Groups are lists of global ranks covering the world once per dimension.
    for dim in ("tp", "pp", "dp", "cp"):
        members = sorted(r for g in doc["groups"][dim] for r in g)
        assert members == list(range(4)), dim
    assert (doc["formula_set"]["name"], doc["formula_set"]["kind"]) == ("cpu_compose", "fitted")   # the default


@pytest.mark.parametrize("args, message", [
    ("--num-attention-heads 5 --kv-channels 32", r"attention.heads.*5.*tensor"),
    ("--nproc_per_node 6", r"world.?size.*6"),
    ("--global-batch-size 7", r"global batch"),
    ("--num-layers 5", r"layers"),
    ("--hidden-size abc", r"hidden-size"),
    ("--formulas /nonexistent/set.json", r"set.json"),
    ("--preset no-such-model", r"unknown preset"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    res = run_cli(shlex.split(SMALL) + shlex.split(args))
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err, re.IGNORECASE), err


def test_cli_imports_no_torch_or_megatron():
    # -X importtime names every module the interpreter imports (the script ends with os._exit, so nothing can be
    # asked of sys.modules afterwards).
    res = subprocess.run([sys.executable, "-X", "importtime", "get_training_info.py", *shlex.split(SMALL), "--json"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["max_peak_bytes"] > 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")]
    assert "estimator.cli" in imported and "estimator.memory" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "megatron", "numpy")]


def test_presets_all_run():
    from estimator.cli import presets
    names = presets()
    assert {"gpt3_175b", "llama2_7b", "llama2_70b", "llama3_8b", "llama3_70b", "mixtral_8x7b",
            "qwen2.5_72b", "qwen3_30b_a3b", "qwen3_235b_a22b", "nemotron4_15b", "deepseek_v3",
            "gpt_oss_120b"} <= set(names)
    for name in names:
        with open(os.path.join(ROOT, "estimator", "presets", f"{name}.json"), encoding="utf-8") as fh:
            args = json.load(fh)["args"]
        value = lambda flag, default: int(args[args.index(flag) + 1]) if flag in args else default  # noqa: E731
        # TP 8 where the KV heads divide among 8 ranks, else as many as there are; PP 4 or 2 where the layers divide
        tp = min(8, value("--num-query-groups", 8))
        layers = value("--num-layers", 4)
        pp = 4 if layers % 4 == 0 else 2 if layers % 2 == 0 else 1
        res = run_cli(["--preset", name, "--nproc_per_node", "8", "--nnodes", "8", "--tensor-model-parallel-size",
                       str(tp), "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "1",
                       "--global-batch-size", "16", "--bf16", "--sequence-parallel", "--json"])
        assert res.returncode == 0, (name, res.stderr)
        doc = json.loads(res.stdout)
        # The preset is a pure model description: nothing in it is ignored, and its parameters are all placed.
        assert doc["ignored_args"] == [], (name, doc["ignored_args"])
        assert doc["max_peak_bytes"] > 0


def test_help_lists_presets_and_formula_sets():
    res = run_cli(["--help"])
    assert res.returncode == 0 and res.stderr == ""
    assert "llama2_7b" in res.stdout and "modelled" in res.stdout and "--formulas" in res.stdout


def test_misspelt_own_options_get_a_suggestion():
    from estimator import flag_policy
    from estimator.cli import OWN_OPTIONS
    assert set(flag_policy.TOOL_OPTIONS) == set(OWN_OPTIONS)
    for wrong, right in (("--gpu-memroy", "--gpu-memory"), ("--serach", "--search"), ("--detial", "--detail")):
        res = run_cli(shlex.split(SMALL) + [wrong, "1"] if wrong != "--serach" else shlex.split(SMALL) + [wrong])
        assert res.returncode == 2 and f"did you mean {right}" in res.stderr, res.stderr
