#!/usr/bin/env python3
"""Fatal signals against a many-threaded trace writer: every trace must still parse whole and consistent.

    python benchmarks/signal_stress.py [--rounds N] [--threads T]

Each round starts a child that opens a trace and runs the C bench loop (`mt_host_bench`: T native threads doing
malloc/free pairs through the tracing core, block flushes every 32k events), kills it after a random delay with
each fatal signal the core's handler covers, and checks the file (check_trace). tests/test_allocator.py runs a
few rounds of this in CI; this script runs many and prints the failures.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The signals csrc/tracealloc.cpp handles (kSignals).
SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGTERM, signal.SIGINT, signal.SIGBUS, signal.SIGFPE)

CHILD = """
    import signal, sys
    from tracer import allocator as A
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt: every signal here kills the process
    A.open_trace("rank0", "host")
    print("ready", flush=True)
    A.lib().mt_host_bench(10 ** 10, {threads}, 1)
"""


def check_trace(prefix: str, sig: int) -> list[str]:
    """What is wrong with the trace a child killed by `sig` left; [] when it reads whole, says it was killed by
    that signal, and its records replay consistently (every FREE of a pointer the trace saw allocated, with that
    allocation's size; times monotone)."""
    from tracer.trace_reader import FREE, MALLOC, TraceFormatError, read_trace
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = read_trace(prefix)
    except TraceFormatError as exc:
        return [str(exc)]
    bad = [str(w.message) for w in caught]
    if t.damage or t.cut_short or t.truncated_bytes:
        bad.append(f"damage={t.damage} cut={t.cut_short} torn={t.truncated_bytes}")
    if (t.end_state, t.end_signal) != ("signal", int(sig)):
        bad.append(f"end state {t.end_state} signal {t.end_signal}, want signal {int(sig)}")
    rec = t.records
    kinds = set(rec["kind"].tolist())
    if not kinds <= {MALLOC, FREE}:
        bad.append(f"unexpected record kinds {sorted(kinds - {MALLOC, FREE})}")
    if len(rec) and (rec["t_ns"][1:] < rec["t_ns"][:-1]).any():
        bad.append("timestamps go backwards")
    live: dict = {}
    for i, (k, p, s) in enumerate(zip(rec["kind"].tolist(), rec["ptr"].tolist(), rec["size"].tolist())):
        if k == MALLOC:
            if p in live or not 16 <= s < 16 + 4096:
                bad.append(f"record {i}: MALLOC of a live pointer or of a size the bench never asks for")
                break
            live[p] = s
        elif live.pop(p, None) != s:
            bad.append(f"record {i}: FREE of a pointer not allocated in the trace, or with another size")
            break
    return bad


def kill_round(tmp: str, sig: int, delay: float, threads: int = 8) -> tuple[int, list[str]]:
    """One child killed by `sig` after `delay` s of the bench; (records read, problems)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD.format(threads=threads))], cwd=tmp,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            return 0, [f"child did not start: {proc.communicate(timeout=30)[1].strip()[-300:]}"]
        time.sleep(delay)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != -sig:
        return 0, [f"exit status {proc.returncode}, want {-sig}: {err.strip()[-300:]}"]
    prefix = os.path.join(tmp, "rank0")
    bad = check_trace(prefix, sig)
    from tracer.trace_reader import read_trace
    n = 0 if bad else len(read_trace(prefix).records)
    return n, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="kills per signal (default 20)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    failures, records, t0 = 0, 0, time.time()
    for sig in SIGNALS:
        for r in range(a.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                n, bad = kill_round(tmp, sig, rng.uniform(0.005, 0.1), a.threads)
            records += n
            if bad:
                failures += 1
                print(f"{sig.name} round {r}: {'; '.join(bad)}")
    total = a.rounds * len(SIGNALS)
    print(f"{total - failures}/{total} killed traces whole and consistent ({a.threads} writer threads, "
          f"{records:,} records checked, {time.time() - t0:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
