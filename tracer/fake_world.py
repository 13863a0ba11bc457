"""One rank of a world of any size in one process: torch's fake process group (the backend Megatron-LM's
`--fake-process-group` uses), so a layout of N ranks is traced one rank at a time, with real kernels on a GPU and
stand-ins on CPU, at the cost of one rank.

The fake group's collectives return at once and move no data; what they allocate is what the caller allocates
for them (outputs, staging buffers of megatron-core's own), exactly as with a real backend. What a real backend
holds beyond that is not in such a trace: gloo's flat copy of a reduce-scatter's or all-gather's input, freed
when the collective ends (one bucket of the distributed optimizer's grad or param buffer), NCCL's internal
buffers (outside PyTorch's allocator on a GPU, the verdict's allowance).

So that the run is deterministic and its data-dependent sizes are the ones a balanced run has, the collectives
fill their outputs as if every rank held this rank's data, without allocating (views and in-place copies only;
even a scalar multiply would allocate its wrapped number): an all-gather repeats the input, an all-reduce leaves
the rank's own values, a reduce-scatter keeps the rank's shard of its input, an all-to-all returns its input (the exchange is symmetric under
balanced routing, `--balanced-routing`, whose token counts every rank then agrees on), a broadcast keeps the
local tensor, a receive zero-fills (a pipeline stage's received activations and gradients: losses are then those
of zeros, not of the model's data). Megatron-LM's gloo copies of the data-parallel groups cannot live on a fake
group: the profiler passes --disable-gloo-process-groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

def init(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    install()


def _fill_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    flat, k = out.view(-1), inp.numel()
    for i in range(flat.numel() // max(k, 1)):
        flat.narrow(0, i * k, k).view(inp.shape).copy_(inp)    # views and an in-place copy: nothing allocated


def install() -> None:
    """Wrap the collectives megatron-core calls (bound by name at its import: call before importing it). The
    all-reduce needs no wrapper: the fake group's leaves the rank's own values."""
    if getattr(dist.all_gather_into_tensor, "_memtrace_fake", False):
        return
    orig = {name: getattr(dist, name) for name in (
        "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
        "all_gather", "all_to_all_single", "batch_isend_irecv")}
    from torch.distributed import distributed_c10d as c10d

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        work = orig["all_gather_into_tensor"](output_tensor, input_tensor, group=group, async_op=async_op)
        _fill_gather(output_tensor, input_tensor)
        return work

    def _all_gather_base(output_tensor, input_tensor, group=None, async_op=False):
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = orig["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)
        k = output.numel()
        output.view(-1).copy_(input.view(-1).narrow(0, dist.get_rank(group) * k, k))
        return work

    def _reduce_scatter_base(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        work = orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        for t in tensor_list:
            t.copy_(tensor)
        return work

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        work = orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group,
                                         async_op=async_op)
        k = min(output.numel(), input.numel())
        if k:
            output.view(-1).narrow(0, 0, k).copy_(input.reshape(-1).narrow(0, 0, k))
        return work

    def batch_isend_irecv(p2p_op_list):
        # megatron-core's pipeline exchange (batched p2p, its default): received tensors zero-filled. (torch's
        # P2POp accepts only c10d's own irecv, so the single recv / irecv are left as they are: what they receive
        # is uninitialized, which changes values, not sizes.)
        works = orig["batch_isend_irecv"](p2p_op_list)
        with torch.no_grad():   # megatron-core receives into leaves that require grad
            for op in p2p_op_list:
                if op.op is c10d.irecv:
                    op.tensor.zero_()
        return works

    for fn in (all_gather_into_tensor, _all_gather_base, reduce_scatter_tensor, _reduce_scatter_base,
               all_gather, all_to_all_single, batch_isend_irecv):
        fn._memtrace_fake = True
        setattr(dist, fn.__name__, fn)


def pipeline_ranks(cfg) -> list:
    """The ranks worth tracing, one per rank class that can differ: the first, a middle and the last pipeline
    stage of the first pipeline group (every other rank of a stage runs the same program in a balanced run)."""
    from estimator import parallel as PAR
    stages = PAR.layout_from_config(cfg).groups["pp"][0]
    picks = {stages[0], stages[len(stages) // 2], stages[-1]}
    return sorted(picks)




def _canonical(events: list, skip: set) -> list:
    """Events without worker pairs and without the allocations in `skip` (indices among the calling thread's
    allocations) and their frees; local references renumbered, other phases' reduced to their label."""
    out, index = [], {}
    n = kept = 0
    for op, size, ref in events:
        if op in ("+~", "-~"):
            continue
        if op == "+":
            if n not in skip:
                index[n] = kept
                kept += 1
                out.append(("+", size, ""))
            n += 1
        elif ref.startswith("#"):
            k = int(ref[1:])
            if k not in skip:
                out.append(("-", size, f"#{index.get(k, '?')}"))
        else:
            out.append(("-", size, ref.rsplit("#", 1)[0]))
    return out


def twin_difference(real: list, fake: list):
    """Compare one label phase's program from a real-backend run (events (op, size, ref) as the program fitter
    extracts them: fit.programs.extract) with its fake-group twin's, event by event. The real one may have more:
    the backend's own buffers, each allocated and freed within the phase (gloo's worker-thread pairs, and the
    calling thread's staging copies of a collective). Returns the sizes of those extra allocations, or None where
    no such reading makes the two equal (an event out of order, a size or a free that differs)."""
    real_allocs = [size for op, size, _ in real if op == "+"]
    fake_allocs = [size for op, size, _ in fake if op == "+"]
    freed_here = {int(ref[1:]) for op, _, ref in real if op == "-" and ref.startswith("#")}
    target = _canonical(fake, set())
    workers = [size for op, size, _ in real if op == "+~"]

    def search(gi: int, fi: int, skip: frozenset):
        if fi == len(fake_allocs):
            rest = skip | frozenset(range(gi, len(real_allocs)))
            if rest <= freed_here and _canonical(real, set(rest)) == target:
                return rest
            return None
        for gj in range(gi, len(real_allocs)):
            if gj > gi and (gj - 1) not in freed_here:
                break                          # an allocation the twin lacks must be freed in the phase
            if real_allocs[gj] == fake_allocs[fi]:
                hit = search(gj + 1, fi + 1, skip | frozenset(range(gi, gj)))
                if hit is not None:
                    return hit
        return None

    skipped = search(0, 0, frozenset())
    if skipped is None:
        return None
    return sorted(workers + [real_allocs[k] for k in skipped])
