#!/usr/bin/env python3
"""How many of Megatron-LM's own functional-test training configs the estimator estimates, and why it refuses the rest.

    python benchmarks/megatron_configs.py MEGATRON_LM [--kinds gpt moe mixtral nemotron] [--list]

MEGATRON_LM: a Megatron-LM checkout (its tests/functional_tests/test_cases/<kind>/<case>/model_config.yaml), or a
bare git directory with --rev REV. Each training config's MODEL_ARGS become a command line: `true` a flag, `false`
or empty dropped, values whose text names an environment variable (`${DATA_PATH}/...`: data, checkpoint and tokenizer
files) dropped; --vocab-size 50257 where the config gives none (the GPT-2 BPE files most of them read; the
tokenizer files are not read offline); inference configs are left out. The world is the smallest multiple of 8 GPUs
that the config's TP x PP x CP and expert TP x EP x PP divide (the recipes' node counts are not read). Printed: how
many estimate, and each refusal's message with its count (numbers in messages folded), worst first.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CASES = "tests/functional_tests/test_cases"


def model_args(text: str) -> dict:
    """The MODEL_ARGS mapping of a model_config.yaml: one `  --flag: value` per line (the subset these files use)."""
    out, inside = {}, False
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            inside = line.split("#")[0].strip() == "MODEL_ARGS:"
            continue
        if inside:
            m = re.match(r"\s+(--[\w-]+)\s*:\s*(.*)$", line)
            if m:
                value = m.group(2)
                if not value.startswith(("'", '"')):
                    value = value.split(" #")[0]
                out[m.group(1)] = value.strip().strip("'\"")
    return out


def argv_of(args: dict) -> list | None:
    """The estimator's command line for a config's MODEL_ARGS; None for an inference config."""
    if any(k.startswith(("--inference", "--temperature")) for k in args):
        return None
    argv: list = []
    for flag, value in args.items():
        low = value.lower()
        if low in ("false", "", "null", "none") or "$" in value:
            continue
        argv += [flag] if low == "true" else [flag, *value.split()]
    if "--vocab-size" not in argv:
        argv += ["--vocab-size", "50257"]
    return argv


def world_of(args: dict) -> int:
    g = lambda flag, default=1: int(args.get(flag, default) or default)  # noqa: E731
    tp, pp, cp = g("--tensor-model-parallel-size"), g("--pipeline-model-parallel-size"), g("--context-parallel-size")
    ep = g("--expert-model-parallel-size")
    etp = g("--expert-tensor-parallel-size", tp)
    return math.lcm(8, tp * pp * cp, etp * ep * pp)


def configs(root: str, rev: str | None, kinds: list) -> list:
    """(name, model_config.yaml text) of every case of those kinds."""
    out = []
    if rev:
        names = subprocess.run(["git", "--git-dir", root, "ls-tree", "-r", "--name-only", rev, CASES], check=True,
                               capture_output=True, text=True).stdout.split()
        for path in sorted(n for n in names if n.endswith("/model_config.yaml") and n.split("/")[3] in kinds):
            text = subprocess.run(["git", "--git-dir", root, "show", f"{rev}:{path}"], check=True,
                                  capture_output=True, text=True).stdout
            out.append(("/".join(path.split("/")[3:5]), text))
        return out
    for kind in kinds:
        base = os.path.join(root, CASES, kind)
        for case in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            path = os.path.join(base, case, "model_config.yaml")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as fh:
                    out.append((f"{kind}/{case}", fh.read()))
    return out


def main(argv=None) -> int:
    from estimator.cli import build_report
    from estimator.args import ConfigError
    from estimator.formulas import FormulaError
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("megatron_lm", help="a Megatron-LM checkout, or its git directory with --rev")
    ap.add_argument("--rev", help="a revision of the git directory MEGATRON_LM")
    ap.add_argument("--kinds", nargs="+", default=["gpt", "moe", "mixtral", "nemotron"])
    ap.add_argument("--list", action="store_true", help="print every config with its result")
    opts = ap.parse_args(argv)
    found = configs(opts.megatron_lm, opts.rev, opts.kinds)
    if not found:
        print(f"error: no {CASES}/<kind>/*/model_config.yaml under {opts.megatron_lm}", file=sys.stderr)
        return 2
    reasons: Counter = Counter()
    done = inference = 0
    for name, text in found:
        args = model_args(text)
        cmd = argv_of(args)
        if cmd is None:
            inference += 1
            continue
        try:
            build_report(["--nproc_per_node", "8", "--nnodes", str(world_of(args) // 8), *cmd], reserved=False)
            done += 1
            result = "estimated"
        except (ConfigError, FormulaError) as exc:
            result = str(exc).splitlines()[0]
            reasons[re.sub(r"\d+", "N", result)[:150]] += 1
        if opts.list:
            print(f"{name:90s} {result[:160]}")
    total = len(found) - inference
    print(f"{done} of {total} training configs estimated ({100.0 * done / total:.0f}%; {inference} inference "
          f"configs left out); refused:")
    for reason, n in reasons.most_common():
        print(f"  {n:3d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
