"""The input batch as its own op (`data.tokens`, `data.labels`, `data.mask`; FORMATS 2.3): what the parser measures
from a traced real megatron-core run equals what autograd itself saves of the batch tensors.

The oracle runs the same harness untraced, with torch.autograd.graph.saved_tensors_hooks recording the storage of
every tensor saved for backward (custom Functions' save_for_backward included, so megatron's CheckpointFunction
too), and sums the batch tensors found among them per op. TP 2 (the embedding saves a masked copy, not the tokens),
RoPE (no position ids read) and full recompute (the checkpoint saves the mask) change which tensors are kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tracer.parse import parse_run

pytestmark = pytest.mark.megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "24",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "64",
        "--make-vocab-size-divisible-by", "16", "--transformer-impl", "local", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--global-batch-size", "4"]
CASES = {
    "learned": (1, []),
    "rope_full": (1, ["--position-embedding-type", "rope", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
}
GROUPS = {"data.tokens": ("tokens", "position_ids"), "data.labels": ("labels", "loss_mask"),
          "data.mask": ("attention_mask",)}

# Runs one untraced iteration of the harness on every rank and prints, per microbatch, the bytes of each op's batch
# tensors that autograd saved for backward.
ORACLE = r"""
import json, os, sys
import torch
import torch.distributed as dist
from tracer import megatron_compat, harness, profile
megatron_compat.install()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
opts = profile.parse_options(["--cpu", "--"] + sys.argv[1:])
cfg = profile.load_config(opts, world)
groups = json.loads(os.environ["GROUPS"])
batches, saved = [], []   # per microbatch: its batch, the storages saved from its forward step on
orig = harness.get_batch
def spy(it, with_data):
    batch = orig(it, with_data)
    batches.append(batch)   # also keeps the batch alive, so its storage addresses stay unique
    saved.append(set())
    return batch
harness.get_batch = spy
def pack(t):
    if saved:
        saved[-1].add(t.untyped_storage().data_ptr())
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    harness.run(cfg, 1)
per_mb = [{op: sum(batch[k].untyped_storage().nbytes() for k in keys
                   if batch[k] is not None and batch[k].untyped_storage().data_ptr() in keep)
           for op, keys in groups.items()} for batch, keep in zip(batches, saved)]
if rank == 0:
    print("ORACLE " + json.dumps(per_mb))
dist.destroy_process_group()
"""


def _oracle(nproc, flags):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(nproc), "GROUPS": json.dumps(GROUPS)}
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", ORACLE, *BASE, *flags], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(nproc)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("ORACLE "))
    return json.loads(line[len("ORACLE "):])


def _traced(tmp_path, nproc, flags):
    out = tmp_path / "trace"
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--nproc", str(nproc), "--out", str(out),
           "--iterations", "1", "--", *BASE, *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return parse_run(str(out))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_parser_measures_what_autograd_saves_of_the_batch(tmp_path, name):
    nproc, flags = CASES[name]
    oracle = _oracle(nproc, flags)
    rank0 = _traced(tmp_path, nproc, flags)
    measured = {}
    for row in rank0.op_stats:
        if row["op"] in GROUPS:
            measured.setdefault(row["microbatch"], {})[row["op"]] = row["saved_bytes"]
    assert len(oracle) == len(measured) == 2                         # two microbatches of one iteration
    for mb, expect in enumerate(oracle):
        assert measured[mb] == expect, (mb, measured[mb], expect)
    # Every case keeps the attention mask (unfused attention reads it in each layer's softmax) and the loss mask.
    assert all(m["data.mask"] > 0 and m["data.labels"] > 0 for m in oracle)
    if name == "learned":
        assert oracle[0]["data.tokens"] > 0       # the embedding saves the token ids, the position embedding its ids
