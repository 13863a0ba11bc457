"""`profile-training-info`: torchrun with the tracing allocator installed, for the line that followed `torchrun`.

    profile-training-info [torchrun flags] pretrain_gpt.py [Megatron-LM flags]

runs `python -m torch.distributed.run [torchrun flags] -m tracer.profile --target pretrain_gpt.py -- [flags]`: the
same processes torchrun would start, each tracing its allocations (tracer/profile.py) for a few iterations.
Profiler options come from $MEMTRACE_ARGS or from the line itself (before the script): --out DIR (memtrace_out),
--iterations N (3), --cpu (gloo on CPU), --balanced-routing, --target harness (the built-in megatron-core harness
with the same flags instead of the script), --dry-run (print the command, run nothing).

--campaign DIR profiles the job instead of running it (fit.job_campaign): a plan of small runs of the same model
(few layers, four shapes, its own layout and a few others, one rank per rank class on torch's fake process group),
traced, fitted into DIR/formulas.json, and checked on a config no run had; then
`get-training-info <the same line> --formulas DIR/formulas.json` predicts the job. --jobs N runs N at once.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

from estimator import torchrun as TR

ENV_ARGS = TR.ENV_ARGS
_OWN_VALUE = ("--out", "--iterations", "--target", "--campaign", "--jobs")
_OWN_SWITCH = ("--cpu", "--balanced-routing", "--crosscheck", "--dry-run")


class UsageError(ValueError):
    pass


def _own_options(tokens: list) -> tuple[dict, list]:
    """This launcher's options out of `tokens`; the rest stays in order."""
    own: dict = {}
    rest, i = [], 0
    while i < len(tokens):
        name, eq, val = tokens[i].partition("=")
        if name in _OWN_SWITCH and not eq:
            own[name] = True
        elif name in _OWN_VALUE:
            if not eq:
                if i + 1 >= len(tokens):
                    raise UsageError(f"{name} needs a value")
                i += 1
                val = tokens[i]
            own[name] = val
        else:
            rest.append(tokens[i])
        i += 1
    return own, rest


def command(argv: list, env: dict) -> tuple[list, bool]:
    """The torchrun command that profiles this line, and whether --dry-run was asked for."""
    try:
        extra = shlex.split(env.get(ENV_ARGS, ""))
    except ValueError as exc:
        raise UsageError(f"{ENV_ARGS}: {exc}") from None
    own_env, leftover = _own_options(extra)
    if leftover:
        raise UsageError(f"{ENV_ARGS}: not a profiler option: {' '.join(leftover)}")
    # Launcher options may sit before the script (after it, every flag is the training script's).
    line = TR.split(argv)
    own_line, launcher = _own_options(line.launcher)
    if own_line and line.script is None:
        line = TR.split(launcher + line.script_args)
    elif own_line:
        line.launcher = launcher
    own = {**own_line, **own_env}
    if line.has_switch("--no-python", "--no_python", "-m", "--module"):
        raise UsageError("the training script must be a Python file (torchrun's -m / --no-python are not "
                         "supported here)")
    target = own.get("--target")
    if own.get("--campaign"):
        return campaign_command(own, line), bool(own.get("--dry-run"))
    if target is None:
        if line.script is None:
            raise UsageError("no training script on the line (expected: [torchrun flags] pretrain_gpt.py [flags]); "
                             f"set {ENV_ARGS}='--target harness' to profile the built-in harness")
        target = line.script
    if target != "harness" and not os.path.isfile(target):
        raise UsageError(f"{target}: no such file (run from your Megatron-LM checkout, or set "
                         f"{ENV_ARGS}='--target harness' to profile the built-in megatron-core harness with the "
                         "same flags)")
    prof = ["--out", own.get("--out", "memtrace_out"), "--iterations", own.get("--iterations", "3"),
            "--target", target]
    prof += [flag for flag in _OWN_SWITCH[:3] if own.get(flag)]
    return [sys.executable, "-m", "torch.distributed.run", *line.launcher, "-m", "tracer.profile", *prof, "--",
            *line.script_args], bool(own.get("--dry-run"))


def campaign_command(own: dict, line) -> list:
    """The fit.job_campaign command for --campaign DIR: the job's world flags and training flags."""
    target = own.get("--target", "harness" if line.script is None else line.script)
    cmd = [sys.executable, "-m", "fit.job_campaign", "--out", own["--campaign"], "--target", target,
           "--iterations", own.get("--iterations", "3")]
    cmd += ["--cpu"] if own.get("--cpu") else []
    cmd += ["--jobs", own["--jobs"]] if own.get("--jobs") else []
    return cmd + ["--", *line.world_flags(), *line.script_args]


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        try:
            print("usage: profile-training-info [torchrun flags] TRAINING_SCRIPT [Megatron-LM flags]\n\n"
                  + __doc__.strip())
        except BrokenPipeError:   # e.g. `| head`
            pass
        return 0
    try:
        cmd, dry_run = command(argv, dict(os.environ))
    except UsageError as exc:
        print(f"profile-training-info: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
