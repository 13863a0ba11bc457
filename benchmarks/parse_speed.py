"""Parser speed: events/s of reading + replaying a trace file (tracer.trace_reader + tracer.parse).

Run alone: `python benchmarks/parse_speed.py [N_EVENTS ...]`; benchmarks/tracer_speed.py imports bench_parse.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracer.parse import bench_parse  # noqa: E402


def main(argv=None) -> None:
    sizes = [int(float(a)) for a in (argv if argv is not None else sys.argv[1:])] or [1_000_000, 4_000_000]
    for n in sizes:
        best = max(bench_parse(n) for _ in range(3))     # best of 3: the machine is shared
        print(f"parse: {n:>12,} events  {best / 1e6:8.2f} M events/s (read + replay + scopes + op stats)")


if __name__ == "__main__":
    main()
