"""The CPU compatibility layer's settled collectives (tracer/megatron_compat.py): once a gloo collective has been
waited for, gloo's worker thread holds no reference to its tensors any more, and neither does the layer, so a
buffer is freed where the caller drops it (in program order, the same on every rank), not later on gloo's thread.

Two real gloo processes run each collective megatron-core uses many times, sync and async, and check the storage
use count of every tensor right after the op: it must be back to what the caller alone holds. gloo's own buffers
(the flat copy a reduce-scatter works on) are freed before the op returns too: the allocator's live bytes are back
where they were."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import os, torch
import torch.distributed as dist
from tracer import megatron_compat
megatron_compat.install()
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)

def count(t):
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

def check(name, tensors, run):
    before = [count(t) for t in tensors]
    work = run()
    if work is not None:
        assert type(work).__name__ == "_SettledWork", type(work)
        work.wait()
    after = [count(t) for t in tensors]
    assert after == before, (name, before, after)

for i in range(200):
    x = torch.ones(4096)
    out = torch.empty(8192)
    half = torch.empty(2048)
    for async_op in (False, True):
        check("all_reduce", [x], lambda: dist.all_reduce(x, async_op=async_op))
        check("all_gather_into_tensor", [out, x],
              lambda: dist.all_gather_into_tensor(out, x, async_op=async_op))
        check("reduce_scatter_tensor", [half, x],
              lambda: dist.reduce_scatter_tensor(half, x, async_op=async_op))
        check("all_to_all_single", [out],
              lambda: dist.all_to_all_single(out, x.repeat(2), async_op=async_op))
print("OK", rank)
dist.destroy_process_group()
"""


def test_collectives_release_their_tensors_by_the_time_they_are_waited_for():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", WORKER], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert all(f"OK {r}" in o for r, o in enumerate(outs))


GLOO_BUFFERS = r"""
import json, os, sys, torch
import torch.distributed as dist
from tracer import allocator, cpu_hook, megatron_compat
megatron_compat.install()
rank = int(os.environ["RANK"])
cpu_hook.install(os.path.join(os.environ["OUT"], f"rank{rank}"))
dist.init_process_group("gloo", rank=rank, world_size=2)
late, n = 0, 200
for i in range(n):
    x, y = torch.ones(6144), torch.ones(3072)
    splits = [2048, 4096]                       # uneven, as the all-to-all MoE dispatcher's over expert TP
    out = torch.empty(splits[rank])
    gathered = list(torch.split(torch.empty(6144), [3072, 3072]))
    before = allocator.live_bytes()
    dist.reduce_scatter(out, list(torch.split(x, splits)))
    dist.all_gather(gathered, y)
    dist.reduce_scatter_tensor(torch.empty(3072), x)   # an output the caller drops at once
    late += allocator.live_bytes() != before
print(json.dumps({"late": late, "n": n}))
dist.destroy_process_group()
"""


def test_gloo_frees_its_own_buffers_before_the_collective_returns(tmp_path):
    """Without the settle (list forms unpatched, no pause for gloo's worker), 6-23 of 200 rounds per rank left a
    gloo buffer alive past the op on a loaded 2-core machine, to be freed on gloo's thread in some later segment."""
    import json
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OUT": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", GLOO_BUFFERS], cwd=ROOT,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    for o in outs:
        got = json.loads(o.strip().splitlines()[-1])
        # a core the scheduler keeps from gloo's worker for over 1 ms, rarely: up to 4 of 200 seen with the suite's
        # two workers beside the test's two ranks on a 2-core machine
        assert got["late"] <= 5, got
