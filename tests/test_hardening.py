"""Issue 13, items 1 and 2: every case a hostile user found gives one line and exit 2 (or a valid report), never a
traceback, a hang, a MemoryError, NaN in JSON or a negative number. The CLI runs in process (estimator.cli.main)
except where the process itself matters (a closed pipe, the console entry point)."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest

from estimator import cli
from estimator import formulas as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--vocab-size", "1000"]


def run(args, capsys):
    """(exit code, stdout, stderr) of the CLI on BASE + args."""
    rc = cli.main(BASE + list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def refused(args, capsys, *words):
    rc, out, err = run(args, capsys)
    assert rc == 2 and out == "", (rc, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("args,words", [
    ("--num-virtual-stages-per-pipeline-rank 0", ["--num-virtual-stages-per-pipeline-rank must be positive"]),
    ("--group-query-attention --num-query-groups 0", ["--num-query-groups must be positive, got 0"]),
    ("--num-experts 4 --expert-tensor-parallel-size 0", ["--expert-tensor-parallel-size must be positive"]),
    ("--num-experts 4 --expert-tensor-parallel-size -1", ["--expert-tensor-parallel-size must be positive"]),
    ("--num-experts 4 --moe-layer-freq [1]+1", ["invalid int or list pattern value"]),
    ("--num-experts 4 --moe-layer-freq [1]*100000000000", ["invalid int or list pattern value"]),
    ("--num-layers 9223372036854775808", ["beyond any model or machine"]),
    ("--num-experts 1000000000000", ["beyond any model or machine"]),
    ("--global-batch-size 1000000000000", ["microbatches per iteration", "beyond any training run"]),
    ("--nproc_per_node 1000000 --nnodes 1000", ["world size 1,000,000,000 GPUs"]),
    ("--num-layers 200000", ["--num-layers 200000 is beyond any model or machine (at most 20,000)"]),
    ("--num-layers 100 --num-experts 10000 --moe-router-topk 2 --disable-bias-linear",
     ["100 layers x 10,000 local experts", "use pipeline or expert parallelism"]),
    ("--ffn-hidden-size -1", ["--ffn-hidden-size must be positive, got -1"]),
    ("--kv-channels -1", ["--kv-channels must be positive"]),
    ("--num-experts 4 --moe-ffn-hidden-size -1", ["--moe-ffn-hidden-size must be positive"]),
    ("--num-experts 4 --moe-router-topk -1", ["--moe-router-topk must be positive"]),
    ("--num-experts 0", ["num_moe_experts must be non-negative."]),   # megatron-core's words
    ("--vocab-size 0", ["--vocab-size must be positive"]),
    ("--hidden-dropout nan", ["dropout probability has to be between 0 and 1, but got nan"]),   # torch's words
    ("--attention-dropout 1.5", ["dropout probability has to be between 0 and 1"]),
    ("--norm-epsilon inf", ["--norm-epsilon must be a finite number"]),
    ("--rotary-percent 0", ["--rotary-percent must be a finite number in (0.0, 1.0]"]),
    ("--hidden-size 1e3", ["invalid int value"]),
    ("--master_port 70000", ["--master_port 70000 is beyond"]),
    ("--nproc_per_node cpu", ["invalid int, gpu or auto value: 'cpu'"]),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 0",
     ["uniform recompute loop never advances"]),
    ("--formulas=", ["--formulas needs a value"]),
    ("--preset=", ["--preset needs a value"]),
    ("--preset ../presets/llama2_7b", ["unknown preset '../presets/llama2_7b'"]),
    ("--preset /etc/passwd", ["unknown preset"]),
])
def test_named_cases_are_one_line_and_exit_2(args, words, capsys):
    refused(args.split(), capsys, *words)


@pytest.mark.parametrize("args", [
    # megatron-core accepts these (recompute_num_layers 0 with the block method recomputes no layer)
    "--recompute-granularity full --recompute-method block --recompute-num-layers 0",
    "--num-experts 4 --disable-bias-linear --tensor-model-parallel-size 2 --nproc_per_node 2 --sequence-parallel",
    "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --nproc_per_node 2 "
    "--sequence-parallel",
    "--moe-router-topk 0",   # MoE settings without experts are never read
])
def test_edge_values_megatron_accepts_give_a_valid_report(args, capsys):
    rc, out, err = run(args.split() + ["--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert doc["max_peak_bytes"] > 0


@pytest.mark.parametrize("value", ["gpu", "auto"])
def test_torchrun_nproc_gpu_and_auto_assume_an_8_gpu_node_and_say_so(value, capsys):
    rc, out, err = run(["--nproc_per_node", value, "--nnodes", "2", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["config"]["world_size"] == 16 and len(doc["ranks"]) == 16
    assert any(f"--nproc_per_node {value}" in w and "assumes 8" in w for w in doc["config"]["warnings"])
    rc, out, err = run(["--nproc_per_node", value, "--nnodes", "2", "--detail", "0"], capsys)
    assert rc == 0 and f"warning: --nproc_per_node {value}" in out, out   # the summary says it too


def test_megatron_core_rejections_the_estimator_now_shares(capsys):
    refused("--num-experts 4 --tensor-model-parallel-size 2 --nproc_per_node 2 --sequence-parallel".split(), capsys,
            "Bias in Moe is only supported when ETP==1")
    refused("--distribute-saved-activations --sequence-parallel --tensor-model-parallel-size 2 --nproc_per_node 2 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(), capsys,
            "distribute_saved_activations: True must be false when sequence parallel is enabled: True")


def test_closed_pipe_ends_quietly():
    """`... --json | head -1`: the reader goes away after one line; no BrokenPipeError, nothing on stderr."""
    args = " ".join(BASE + ["--nproc_per_node", "8", "--nnodes", "64", "--json"])
    for exe in (f"{sys.executable} get_training_info.py", os.path.join(os.path.dirname(sys.executable),
                                                                       "get-training-info")):
        if not os.path.exists(exe.split()[0]):
            continue
        res = subprocess.run(["bash", "-c", f"set -o pipefail; {exe} {args} | head -1"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert res.stdout == "{\n" and res.stderr == "", res.stderr
        assert res.returncode == 0


def test_console_entry_point_runs(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "get-training-info")
    if not os.path.exists(exe):
        pytest.skip("package not installed in this environment")
    res = subprocess.run([exe, *BASE, "--json"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["format"] == "megatron-memtrace-estimate"


# --- HF config -------------------------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128, "vocab_size": 1000,
         "tie_word_embeddings": False}
HF_TAIL = ["--seq-length", "128", "--micro-batch-size", "1"]


def hf_run(tmp_path, capsys, content, name="config.json"):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    rc = cli.main(["--hf-config", str(path), *HF_TAIL, "--json"])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("change,words", [
    ({"hidden_size": "64"}, ["'hidden_size': expected an integer, got '64'"]),
    ({"num_hidden_layers": 2.0}, ["'num_hidden_layers': expected an integer"]),
    ({"hidden_size": True}, ["'hidden_size': expected an integer, got True"]),
    ({"model_type": ["llama"]}, ["'model_type' must be a string"]),
    ({"tie_word_embeddings": "false"}, ["'tie_word_embeddings' must be true or false, got 'false'"]),
    ({"intermediate_size": -176}, ["'intermediate_size' must be positive, got -176"]),
    ({"attention_dropout": "0.1"}, ["'attention_dropout': expected a number"]),
    ({"num_local_experts": 8, "num_experts_per_tok": "2"}, ["'num_experts_per_tok': expected an integer"]),
    ({"hidden_act": 3}, ["'hidden_act' must be a string"]),
    ({"vocab_size": 10 ** 12}, ["'vocab_size' 1000000000000 is beyond"]),
    ({"attention_dropout": 10 ** 400}, ["'attention_dropout' must be a finite number"]),
])
def test_hf_config_bad_fields_are_one_line(tmp_path, capsys, change, words):
    rc, out, err = hf_run(tmp_path, capsys, {**LLAMA, **change})
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--hf-config" in err and all(w in err for w in words), err


def test_hf_config_nan_is_refused_and_encodings_read(tmp_path, capsys):
    rc, _, err = hf_run(tmp_path, capsys, json.dumps(LLAMA).replace('"vocab_size": 1000', '"vocab_size": NaN'))
    assert rc == 2 and "expected an integer, got nan" in err
    plain = hf_run(tmp_path, capsys, LLAMA)
    assert plain[0] == 0, plain[2]
    for enc in ("utf-16", "utf-8-sig", "utf-32"):   # json reads every Unicode encoding of a JSON text
        got = hf_run(tmp_path, capsys, json.dumps(LLAMA).encode(enc))
        assert got[0] == 0 and got[1] == plain[1], got[2]
    rc, _, err = hf_run(tmp_path, capsys, b'{"model_type": "ll\xe9ama"}')
    assert rc == 2 and "not UTF-8, UTF-16 or UTF-32 text" in err
    rc, _, err = hf_run(tmp_path, capsys, "[" * 100000 + "]" * 100000)
    assert rc == 2 and "nested too deeply" in err


def test_hf_config_read_is_capped(capsys):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    rc = cli.main(["--hf-config", "/dev/zero", *HF_TAIL])
    err = capsys.readouterr().err
    assert rc == 2 and "larger than 16 MiB" in err and err.count("\n") == 1


# --- formula sets and the report's own check (item 2) -----------------------------------------------------------

def _modelled():
    with open(os.path.join(F.SHIPPED_DIR, "modelled.json")) as fh:
        return json.load(fh)


def _selected_term(doc):
    """The first term of a formula this config selects (an op the report prints)."""
    for fo in doc["formulas"]:
        if fo["op"] == "layers.*.mlp.linear_fc1" and not fo.get("when") and fo.get("saved"):
            return fo["saved"][0]
    for fo in doc["formulas"]:
        if fo["op"] == "layers.*.mlp.linear_fc1" and fo.get("saved"):
            return fo["saved"][0]
    raise AssertionError("no linear_fc1 formula in the modelled set")


def formula_run(tmp_path, capsys, doc_or_text):
    path = tmp_path / "set.json"
    path.write_text(doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text))
    return run(["--formulas", str(path), "--json"], capsys)


@pytest.mark.parametrize("term,words", [
    ({"coef": 1e308}, ["coef 1e+308 is beyond any formula"]),
    ({"coef": 10 ** 300}, ["is beyond any formula"]),
    ({"coef": "inf"}, ["coef must be a number"]),
    ({"coef": 1, "vars": {"s": 1000}}, ["exponent of 's' must be an integer in [-8, 8], got 1000"]),
    ({"coef": 1, "vars": {"s": 10 ** 30}}, ["exponent of 's' must be an integer in [-8, 8]"]),
    ({"coef": -10 ** 12, "vars": {"s": 1}}, ["'layers.*.mlp.linear_fc1' gives saved", "a negative formula"]),
    ({"coef": 1, "vars": {"E": -1}}, ["cannot be evaluated for this config"]),
])
def test_damaged_formula_sets_are_one_line(tmp_path, capsys, term, words):
    doc = _modelled()
    for fo in doc["formulas"]:   # every linear_fc1 formula, whichever this config selects
        if fo["op"] == "layers.*.mlp.linear_fc1" and fo.get("saved"):
            fo["saved"][0] = copy.deepcopy(term)
    rc, out, err = formula_run(tmp_path, capsys, doc)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert all(w in err for w in words), err


def test_deeply_nested_formula_file_is_one_line(tmp_path, capsys):
    rc, _, err = formula_run(tmp_path, capsys, "[" * 5000 + "]" * 5000)
    assert rc == 2 and "nested too deeply" in err and err.count("\n") == 1


def test_report_check_catches_an_impossible_total(capsys):
    """The check itself: a report whose categories do not add up to its peak, or with a negative count, is an
    error naming the formula set, not a printed number."""
    from estimator import invariants

    report = cli.build_report(BASE)
    invariants.check(report)   # the real report passes
    for mutate, words in ((lambda r: r.bytes.__setitem__("other", r.bytes["other"] - 4096), "sum to"),
                          (lambda r: setattr(r, "params", -1), "params on pipeline stage 0 is -1"),
                          (lambda r: r.bytes.__setitem__("activations", math.nan), "activations bytes")):
        bad = cli.build_report(BASE)
        mutate(bad.estimate.ranks[0])
        with pytest.raises(invariants.EstimateError, match=words):
            invariants.check(bad)
