#!/usr/bin/env python3
"""Layout search speed: how many layouts `get_training_info.py --search` estimates per second.

Runs the search in process on two real-sized models (Mixtral 8x7B on 64 GPUs, Llama-3 70B on 128; each has more than
10,000 candidate layouts), once in this process alone and once spread over the CPUs this process may use (what the
CLI does), and prints layouts tried, accepted by Megatron's validation, fitting in 80 GiB, wall seconds, rate,
and for the single process its CPU seconds (on a shared machine the wall time includes waiting for other work;
CPU time does not). Target: 10,000 layouts in a few seconds.

    python benchmarks/search_speed.py
"""
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimator import formulas as F  # noqa: E402
from estimator import search as S  # noqa: E402
from estimator.cli import split_own_options  # noqa: E402

CASES = {
    "mixtral_8x7b, 64 GPUs, s 4096": "--preset mixtral_8x7b --nproc_per_node 8 --nnodes 8 --global-batch-size 512 "
                                     "--bf16 --seq-length 4096 --max-position-embeddings 4096",
    "llama3_70b, 128 GPUs, s 8192": "--preset llama3_70b --nproc_per_node 8 --nnodes 16 --global-batch-size 512 --bf16",
}


def main():
    fset = F.load(F.DEFAULT_SET)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{'case':<32} {'workers':>7} {'tried':>7} {'accepted':>8} {'fit':>6} {'seconds':>8} {'layouts/s':>9} "
          f"{'CPU s':>6} {'per CPU s':>9}")
    for name, line in CASES.items():
        argv, _ = split_own_options(shlex.split(line))
        for workers in (1, cpus):
            t0, c0 = time.perf_counter(), time.process_time()
            r = S.search(argv, 80 * (1 << 30), fset, progress=False, workers=workers)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            own = f"{cpu:>6.2f} {r.enumerated / cpu:>9.0f}" if workers == 1 else ""
            print(f"{name:<32} {workers:>7} {r.enumerated:>7} {r.accepted:>8} {len(r.fits):>6} {dt:>8.2f} "
                  f"{r.enumerated / dt:>9.0f} {own}")
    best = min(_timeit() for _ in range(20))
    print(f"machine: {cpus} CPUs for this process, load average {os.getloadavg()[0]:.1f}, yardstick "
          f"{best * 1e6:.1f} us for sum(range(1000))")


def _timeit() -> float:
    t0 = time.perf_counter()
    sum(range(1000))
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
