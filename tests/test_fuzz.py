"""A short seeded pass of benchmarks/fuzz.py (the longer run: `make fuzz`): random command lines, damaged formula
sets, HF configs and traces all end in exit 0 with a valid report or exit 2 with one line, each within 10 s."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_seeded_fuzz_pass_keeps_the_promise():
    res = subprocess.run([sys.executable, "benchmarks/fuzz.py", "--seed", "13", "--cases", "120", "--time-limit",
                          "10", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    doc = json.loads(res.stdout)
    failures = {k: s["failures"] for k, s in doc["kinds"].items() if s["failures"]}
    assert res.returncode == 0 and not failures, json.dumps(failures, indent=1)[:4000]
    for kind, s in doc["kinds"].items():
        assert s["exit0"] + s["exit2"] == s["cases"] > 0, kind
        # both outcomes occur: the inputs are neither all valid nor all refused
        assert s["exit0"] > 0 and (s["exit2"] > 0 or kind == "traces"), (kind, s)
    assert set(doc["kinds"]) == {"cli", "formulas", "hf", "traces"}
