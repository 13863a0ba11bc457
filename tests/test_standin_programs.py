"""benchmarks/standin_programs.py: a stand-in run's programs against the H100-fitted ones, op by op."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.standin_programs import VERDICTS, compare_run, without_grad_casts, without_row_vectors  # noqa: E402


def test_the_fused_bias_dropout_add_is_the_h100_program_in_a_committed_run():
    """A committed one-process run of Megatron's default kernels (GPT-style: biases, dropout): the bias-dropout-add
    segments equal the H100 programs (backward up to DDP's CPU casts); every verdict is one of the four."""
    from estimator import formulas as F
    from fit.programs.build import load_runs
    (run,) = load_runs([os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels", "gpt_w1_s48_b1_h128")])
    verdicts = compare_run(run, F.load("gpu_h100").programs)
    assert {v for v, _ in verdicts.values()} <= set(VERDICTS)
    for label in ("layers.*@self_attention", "layers.*@mlp"):
        assert verdicts[("fwd", label)][0] == "equal"
        assert verdicts[("bwd", label)][0] in ("equal", "equal up to CPU casts")


def test_grad_casts_are_taken_out_and_references_renumbered():
    # a 100-byte gradient, its 200-byte fp32 copy freed at once, then a 50-byte temporary
    cpu = [("+", 100, ""), ("+", 200, ""), ("-", 200, "#1"), ("+", 50, ""), ("-", 50, "#2"), ("-", 100, "#0")]
    assert without_grad_casts(cpu) == [("+", 100, ""), ("+", 50, ""), ("-", 50, "#1"), ("-", 100, "#0")]
    # a transient twice the size of nothing this segment made stays
    assert without_grad_casts([("+", 64, ""), ("-", 64, "#0")]) == [("+", 64, ""), ("-", 64, "#0")]


def test_row_vectors_are_taken_out_past_the_gpu_programs_own():
    # the input's gradient, a weight's 64-byte gradient, then two 64-byte row vectors freed in the op
    cpu = [("+", 4096, ""), ("+", 64, ""), ("+", 64, ""), ("+", 64, ""), ("-", 64, "#2"), ("-", 64, "#3"),
           ("-", 4096, "#0"), ("-", 64, "#1")]
    assert without_row_vectors(cpu, 64, keep=1) == [("+", 4096, ""), ("+", 64, ""), ("-", 4096, "#0"),
                                                     ("-", 64, "#1")]
    # one the op does not free stays
    assert without_row_vectors([("+", 64, "")], 64) == [("+", 64, "")]


def test_cli_prints_the_table_and_refuses_a_missing_run(tmp_path):
    bench = os.path.join(ROOT, "benchmarks", "standin_programs.py")
    run = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels", "llama_w1_s48_b1_h128")
    ok = subprocess.run([sys.executable, bench, run], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "layers.*@self_attention" in ok.stdout and ok.stdout.splitlines()[0].startswith("1 ")
    bad = subprocess.run([sys.executable, bench, str(tmp_path / "nothing")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
