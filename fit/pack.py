"""python -m fit.pack CAMPAIGN_DIR OUT_DIR [--only CONFIG...]: pack a finished campaign's traces for committing.

Each complete config directory CAMPAIGN_DIR/<config>/ becomes OUT_DIR/<config>/ holding rank<R>.trace.xz (the
record file, xz-compressed), rank<R>.names, rank<R>.json and campaign.json, unchanged otherwise. The trace reader
reads the .xz files transparently, so `python -m fit.programs OUT_DIR` and the report/parse tools work on the packed copy
directly. Incomplete configs (no final allocator counters, `.partial` runs) are refused, not packed. Packing is
idempotent: an existing packed config whose files decompress to the same bytes is left as it is.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import sys

from .campaign import RUN_INFO

XZ_PRESET = 9 | lzma.PRESET_EXTREME


class PackError(ValueError):
    pass


def _ranks(run_dir: str) -> list[int]:
    out = []
    for f in os.listdir(run_dir):
        if f.startswith("rank") and f.endswith(".trace") and f[4:-6].isdigit():
            out.append(int(f[4:-6]))
    return sorted(out)


def _complete(run_dir: str, ranks: list[int]) -> bool:
    for r in ranks:
        try:
            with open(os.path.join(run_dir, f"rank{r}.json"), encoding="utf-8") as fh:
                if "allocator_peak_bytes" not in json.load(fh):
                    return False
        except (OSError, json.JSONDecodeError):
            return False
    return bool(ranks) and os.path.isfile(os.path.join(run_dir, RUN_INFO))


def pack_run(run_dir: str, out_dir: str) -> int:
    """Pack one config directory; returns the bytes written."""
    ranks = _ranks(run_dir)
    if not _complete(run_dir, ranks):
        raise PackError(f"{run_dir}: not a complete campaign run (rank headers without final counters, "
                        f"or no {RUN_INFO})")
    tmp = out_dir.rstrip("/") + ".packing"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    for r in ranks:
        with open(os.path.join(run_dir, f"rank{r}.trace"), "rb") as fh:
            raw = fh.read()
        with open(os.path.join(tmp, f"rank{r}.trace.xz"), "wb") as fh:
            fh.write(lzma.compress(raw, preset=XZ_PRESET))
        for ext in (".names", ".json"):
            src = os.path.join(run_dir, f"rank{r}{ext}")
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(tmp, f"rank{r}{ext}"))
    shutil.copyfile(os.path.join(run_dir, RUN_INFO), os.path.join(tmp, RUN_INFO))
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))


def pack(campaign_dir: str, out: str, only: list | None = None) -> list[tuple[str, int]]:
    if not os.path.isdir(campaign_dir):
        raise PackError(f"{campaign_dir}: not a directory")
    names = sorted(d for d in os.listdir(campaign_dir)
                   if os.path.isdir(os.path.join(campaign_dir, d)) and not d.endswith(".partial"))
    if only:
        missing = set(only) - set(names)
        if missing:
            raise PackError(f"{campaign_dir}: no such config(s): {', '.join(sorted(missing))}")
        names = [n for n in names if n in set(only)]
    os.makedirs(out, exist_ok=True)
    return [(n, pack_run(os.path.join(campaign_dir, n), os.path.join(out, n))) for n in names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fit.pack", description=__doc__.split("\n")[0])
    ap.add_argument("campaign", help="campaign output directory (one subdirectory per config)")
    ap.add_argument("out", help="directory to write the packed configs to (e.g. fit/traces/cpu_local)")
    ap.add_argument("--only", nargs="+", metavar="CONFIG")
    args = ap.parse_args(argv)
    try:
        done = pack(args.campaign, args.out, args.only)
    except (PackError, OSError) as exc:
        print(f"python -m fit.pack: error: {exc}", file=sys.stderr)
        return 2
    total = sum(n for _, n in done)
    print(f"packed {len(done)} config(s) into {args.out}: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
