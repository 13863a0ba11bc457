"""benchmarks/gpu_reference.py on the development subset of Megatron-LM's published H100 peaks: one row per case,
and every predicted number it prints is the estimator's own JSON (`get_training_info.py --json`, run here as a
separate process with the case's environment)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = os.path.join(ROOT, "benchmarks", "megatron_ci_dev.json")
GiB, MiB = float(1 << 30), float(1 << 20)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_reference") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_reference.py"), DEV,
                          "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    with open(out) as fh:
        return res.stdout, json.load(fh)


def cli_json(case):
    world = case["world_size"]
    flags = ["--nproc_per_node", str(min(world, 8))] + (["--nnodes", str(world // 8)] if world > 8 else [])
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env.update({k: str(v) for k, v in case["env"].items() if k == "CUBLAS_WORKSPACE_CONFIG"})
    res = subprocess.run([sys.executable, os.path.join(ROOT, "get_training_info.py"), *flags,
                          *case["megatron_flags"], "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_row_for_every_case_with_the_estimators_numbers(bench):
    stdout, rows = bench
    with open(DEV) as fh:
        cases = json.load(fh)["cases"]
    assert len(cases) == 9 and [r["case"] for r in rows] == [c["test_case"] for c in cases]
    table = {line.split()[0]: line.split() for line in stdout.splitlines() if line.split()
             and line.split()[0] in {c["test_case"] for c in cases}}
    assert set(table) == {c["test_case"] for c in cases}
    for case, row in zip(cases, rows):
        doc = cli_json(case)
        world = case["world_size"]
        rank = doc["ranks"][world - 1]
        stage = next(s for s in doc["stages"] if s["pp_rank"] == rank["coords"]["pp"])
        assert row["predicted_peak_bytes"] == rank["peak_bytes"]
        assert row["predicted_after_step_bytes"] == stage["after_step_bytes"]
        assert row["gpu_runtime_bytes"] == stage["bytes"]["gpu_runtime"] == rank["bytes"]["gpu_runtime"]
        assert row["formula_set"] == f"{doc['formula_set']['name']} ({doc['formula_set']['kind']})"
        meas = case["measured_GiB"]["max_allocated"] * GiB
        cells = table[case["test_case"]]
        # case, world, rank, "(ppP", "epE)", measured, predicted, err, measured after, predicted after, err, ...
        assert cells[1:5] == [str(world), str(world - 1), f"(pp{rank['coords']['pp']}", f"ep{rank['coords']['ep']})"]
        assert cells[6] == f"{rank['peak_bytes'] / GiB:.3f}"
        assert cells[7] == f"{100 * (rank['peak_bytes'] / meas - 1):+.2f}"
        assert cells[9] == f"{stage['after_step_bytes'] / GiB:.3f}"
        assert cells[-1] == f"{stage['bytes']['gpu_runtime'] / MiB:.1f}"
    assert "cases within target" in stdout.splitlines()[-1]


def test_the_second_subset_is_read_and_refusals_are_listed(tmp_path):
    """The second development subset (its own record format) is estimated case by case; a case whose flags the
    estimator refuses is a row with that one-line refusal, never a crash, and is left out of the errors."""
    more = os.path.join(ROOT, "benchmarks", "megatron_ci_dev_more.json")
    with open(more, encoding="utf-8") as fh:
        cases = json.load(fh)["cases"]
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_reference.py"), more,
                          "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [c["test_case"] for c in cases]
    refused = [r for r in rows if "refused" in r]
    assert refused and all("\n" not in r["refused"] and r["refused"] for r in refused)
    assert f"refused ({len(refused)} of {len(rows)} cases" in res.stdout
    for r, c in zip(rows, cases):
        if "refused" not in r:
            assert r["measured_peak_bytes"] == int(round(c["measured"]["max_allocated_GiB"] * GiB))
