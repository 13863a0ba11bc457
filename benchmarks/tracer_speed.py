"""Tracer speed: cost per event of the C++ core (host backend) with and without logging, and parse speed.

    python benchmarks/tracer_speed.py [--events N] [--rounds R]

Allocator part: the C bench loop `mt_host_bench` (csrc/tracealloc.cpp) does malloc/free pairs over a window of
64 live blocks, either plainly (baseline) or through the tracing core (lock, hash map, 48-byte record, block
writes to a real trace file). Configurations are interleaved round by round and the median is reported, so
both columns see the same machine load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracer import allocator  # noqa: E402


def bench_allocator(n_events: int, rounds: int, tmp: str) -> str:
    lib = allocator.lib()
    prefix = os.path.join(tmp, "bench")
    allocator.open_trace(prefix, "host")
    configs = [(t, log) for t in (1, 2) for log in (0, 1)]
    lib.mt_host_bench(n_events // 10, 1, 1)  # warm up allocator arenas and the trace buffer
    samples: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for threads, log in configs:
            samples[(threads, log)].append(lib.mt_host_bench(n_events, threads, log))
    allocator.close()
    lines = [f"allocator (host backend), {n_events:,} events per run, median of {rounds} interleaved runs, "
             f"{os.cpu_count()} CPUs",
             f"{'threads':>7} {'malloc/free ns/ev':>18} {'traced ns/ev':>13} {'ratio':>6} {'overhead ns/ev':>15} "
             f"{'traced Mev/s':>13}"]
    for threads in (1, 2):
        base = statistics.median(samples[(threads, 0)])
        traced = statistics.median(samples[(threads, 1)])
        lines.append(f"{threads:>7} {base:>18.1f} {traced:>13.1f} {traced / base:>6.2f} {traced - base:>15.1f} "
                     f"{1e3 / traced:>13.2f}")
    return "\n".join(lines)


# ---- parser part (tracer.trace_reader.read_trace, owned by the parser side) ------------------------------
def bench_parser(tmp: str, n_events: int) -> str:
    try:
        from tracer.trace_reader import read_trace
    except ImportError:
        return "parser: tracer.trace_reader.read_trace not available yet"
    prefix = os.path.join(tmp, "parse")
    allocator.open_trace(prefix, "host")
    allocator.lib().mt_host_bench(n_events, 1, 1)
    allocator.close()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        n = len(read_trace(prefix + ".trace").records)
        best = min(best, time.perf_counter() - t)
    return f"parser: read_trace of {n:,} events: {best * 1e3:.1f} ms, {n / best / 1e6:.1f} M events/s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mt-bench-") as tmp:
        print(bench_allocator(args.events, args.rounds, tmp))
        print(bench_parser(tmp, args.events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
