"""The fit's inputs: damaged or truncated traces are refused (one line, exit 2) unless accepted, and the shipped
campaign grids are valid Megatron configs.

Traces are written in the real file format (tracer.trace_reader.write_trace) with allocation sizes computed from
known formulas on a config grid, then damaged, and given to the real fit command (python -m fit.programs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction as F

import numpy as np
import pytest

from estimator.formulas import kernels

from estimator.args import parse_args
from estimator.formulas import variables
from fit import basis
from tracer.trace_reader import RECORD_DTYPE, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

mono = basis.parse_monomial


def _e(m: str, c) -> tuple:
    return (F(c), mono(m))


# Known per-op formulas (bytes). Mixed e-scaled and fixed-size terms, a rational coefficient, an s*s term.
LAYER_SAVED = [_e("s*b*h*e/st", 34), _e("s*s*b*a*e/t", 5)]
TMP = [_e("s*b*f*e/t", 2)]
FC1_SAVED = [_e("s*b*f*e/t", 1)]
BWD = [_e("s*b*h*e/st", F(1, 2)), _e("h*h/t", 4)]
OPTIM = [_e("Pstep", 4), (F(12), ())]   # CPU torch AdamW: fp32 temporaries of consecutive parameters, + 3 scalars


def value(terms, cfg) -> int:
    pt = {k: F(v) for k, v in variables(cfg).complete().items()}
    out = sum((c * basis.evaluate(m, pt) for c, m in terms), F(0))
    assert out.denominator == 1
    return int(out)


BASE = ("--num-layers 2 --hidden-size {h} --num-attention-heads {a} --seq-length {s} --max-position-embeddings {s} "
        "--micro-batch-size {b} --ffn-hidden-size {f} --vocab-size 128 --transformer-impl local "
        "--tensor-model-parallel-size {t} --nproc_per_node {t}")


def config(h=64, a=4, s=32, b=2, f=256, t=1, extra=""):
    argv = BASE.format(h=h, a=a, s=s, b=b, f=f, t=t).split() + extra.split()
    return parse_args(argv).to_dict(), argv


GRID = [dict(), dict(s=64), dict(b=1), dict(h=96), dict(a=8), dict(extra="--kv-channels 32"), dict(f=192),
        dict(t=2), dict(t=2, extra="--sequence-parallel"), dict(extra="--bf16"),
        dict(t=2, s=64, extra="--sequence-parallel --bf16")]


class _TraceWriter:
    """Builds a FORMATS 2.1 event stream: scopes, mallocs and frees, in file order."""

    def __init__(self):
        self.names, self.recs, self.stack, self.next_id, self.next_ptr = [""], [], [], 1, 4096

    def _tag(self, name):
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def _rec(self, kind, ptr=0, size=0, tag=0):
        self.recs.append((len(self.recs), ptr, size, 0, self.stack[-1] if self.stack else 0, tag, 0, -1, kind, 0))

    def push(self, name):
        self._rec(4, size=self.next_id, tag=self._tag(name))
        self.stack.append(self.next_id)
        self.next_id += 1

    def pop(self):
        self._rec(5)
        self.stack.pop()

    def malloc(self, size) -> int:
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + size + 64
        self._rec(1, ptr=ptr, size=size)
        return ptr

    def free(self, ptr, size):
        self._rec(2, ptr=ptr, size=size)

    def records(self):
        return np.array(self.recs, dtype=RECORD_DTYPE)


def write_run(path, cfg, argv, recompute_extra=0):
    """Two iterations x two microbatches x two layers; iteration 0 carries warm-up garbage the fit must skip."""
    w = _TraceWriter()
    saved, tmp, fc1 = value(LAYER_SAVED, cfg) + recompute_extra, value(TMP, cfg), value(FC1_SAVED, cfg)
    for it in range(2):
        w.push(f"iter:{it}")
        held = {}
        for mb in range(2):
            w.push(f"fwd:{mb}")
            for layer in range(2):
                w.push(f"mod:decoder.layers.{layer}")
                held[mb, layer] = [(w.malloc(saved + (1000 if it == 0 else 0)), saved + (1000 if it == 0 else 0))]
                p = w.malloc(tmp)
                w.free(p, tmp)
                w.push(f"mod:decoder.layers.{layer}.mlp.linear_fc1")
                held[mb, layer].append((w.malloc(fc1), fc1))
                w.pop()
                w.pop()
            w.pop()
            w.push(f"bwd:{mb}")
            for layer in (1, 0):
                w.push(f"bwdlayer:decoder.layers.{layer}")
                g = value(BWD, cfg)
                p = w.malloc(g)
                w.free(p, g)
                for ptr, size in held.pop((mb, layer)):
                    w.free(ptr, size)
                w.pop()
            w.pop()
        w.push("optim")
        o = value(OPTIM, cfg)
        p = w.malloc(o)
        w.free(p, o)
        w.pop()
        w.pop()
    path.mkdir(parents=True, exist_ok=True)
    header = {"format": "megatron-memtrace", "version": 1, "rank": 0, "world_size": 1, "config": cfg,
              "argv": argv, "device": "synthetic", "backend": "host",
              "versions": {"torch": "n/a", "megatron_core": "n/a"}, "iterations": 2, "target": "harness",
              "kernels": kernels(cfg),  # as a GPU run of these flags records them
              "allocator_peak_bytes": 0}  # present: the run ended (its value is not what the fit reads)
    write_trace(str(path / "rank0"), w.records(), w.names, header=header)


@pytest.fixture(scope="module")
def grid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    dirs = []
    for i, kw in enumerate(GRID):
        cfg, argv = config(**kw)
        write_run(root / f"c{i:02d}", cfg, argv)
        dirs.append(str(root / f"c{i:02d}"))
    return root, dirs


@pytest.mark.parametrize("damage", ["cut", "flip", "killed"])
def test_damaged_or_truncated_traces_are_refused(grid_dirs, tmp_path, damage):
    import shutil
    _, dirs = grid_dirs
    run = tmp_path / "run"
    shutil.copytree(dirs[0], run)
    trace = run / "rank0.trace"
    data = bytearray(trace.read_bytes())
    if damage == "cut":
        data = data[:-100]
    elif damage == "flip":
        data[64 + 48 * 5 + 3] ^= 1
    else:  # the rank's header was written at the start and never completed
        hdr = json.loads((run / "rank0.json").read_text())
        del hdr["allocator_peak_bytes"]
        (run / "rank0.json").write_text(json.dumps(hdr))
    trace.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "fit.programs", str(run), "-o", str(tmp_path / "x.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--accept-damaged" in r.stderr
    assert {"cut": "truncated", "flip": "damaged", "killed": "cut short"}[damage] in r.stderr


@pytest.mark.parametrize("grid", ["ci_tiny", "cpu_local"])
def test_shipped_grids_are_valid_megatron_configs(grid):
    from fit.campaign import load_grid
    spec, configs = load_grid(f"fit/grids/{grid}.json")
    assert spec["name"] == grid and len({c.name for c in configs}) == len(configs)
    for c in configs:
        cfg = parse_args(c.argv + ["--nproc_per_node", str(c.nproc)])   # Megatron's validation, our parser
        assert c.nproc % (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size) == 0
    if grid == "cpu_local":  # the design varies every dense shape variable and every switch the set covers
        pts = [variables(parse_args(c.argv + ["--nproc_per_node", str(c.nproc)]).to_dict()) for c in configs]
        for v in ("s", "b", "h", "f", "a", "g", "d", "v", "t", "st", "e", "E", "k", "ep"):
            assert len({p[v] for p in pts}) > 1, v


def test_campaign_refuses_to_mix_into_an_existing_run_without_resume(tmp_path):
    from fit.campaign import GridError, run_campaign
    (tmp_path / "base").mkdir()
    with pytest.raises(GridError, match="pass --resume"):
        run_campaign("fit/grids/ci_tiny.json", str(tmp_path), resume=False)
    with pytest.raises(GridError, match="incomplete"):
        run_campaign("fit/grids/ci_tiny.json", str(tmp_path), resume=True)
