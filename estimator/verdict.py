"""Fits or not: each pipeline stage's predicted peak plus what PyTorch's allocator does not see, against a GPU.

The estimate proper is what torch's allocator allocates (`allocated_bytes.all.peak`). A GPU also holds memory no
PyTorch allocator reports, and the caching allocator reserves more than it hands out. Those are *modelled
allowances*, each shown and each overridable:
- CUDA context and libraries: what a GPU process holds outside PyTorch's allocator, measured (MEASURED_OUTSIDE);
- NCCL: 0.5 GiB per communicator the rank uses (about 0.5 GB per communicator, Fujii et al. 2411.06465), one
  communicator per process-group kind its collectives run in, plus the world group Megatron initialises with;
- fragmentation: the caching allocator's reserved minus allocated. From the modelled reserved memory when the
  report has it (estimator.reserved: the stage's predicted stream replayed through a model of the caching
  allocator; its accuracy on H100 runs: docs/ACCURACY.md), else 5% of the allocated peak; --fragmentation-percent
  overrides both.
"""
from __future__ import annotations

from typing import Optional

from bisect import bisect_left

from estimator._record import dataclass, field

GiB = float(1 << 30)

# memory.total as nvidia-smi reports it (MiB), per GPU model; the usual spellings of one model share a value.
GPUS = {
    "H100-80GB": 81559, "H100": 81559, "H100-SXM": 81559, "H100-PCIE": 81559,
    "H100-NVL": 95830, "H100-94GB": 95830,
    "H200": 143771, "H200-141GB": 143771,
    "A100-40GB": 40960, "A100-80GB": 81920,
    "B200": 183359,
    "V100-16GB": 16384, "V100-32GB": 32768,
    "L40S": 46068,
}

# Device memory outside PyTorch's allocator (cudaMemGetInfo used - memory_reserved) at the end of training, the
# largest of the 12 committed H100 validation runs (fit/validation/h100/*/measured.json `outside_allocator_end`;
# torch 2.11.0+cu130, one process, NCCL world of one): the CUDA context, libraries' handles and loaded kernels.
# All 12 read 2.42 GiB (within 2 MiB); a published CUDA-context figure (0.3-0.5 GB) misses most of it.
MEASURED_OUTSIDE = 2603417600

DEFAULTS = {"cuda_context_gib": MEASURED_OUTSIDE / GiB, "nccl_gib_per_communicator": 0.5,
            "fragmentation_percent": 5.0}


class GPUMemoryError(ValueError):
    pass


@dataclass
class GPU:
    name: str
    bytes: int


def parse_gpu(text: str) -> GPU:
    """`80`, `79.5` (GiB) or a GPU name (case-insensitive, `H100-80GB`, `h200`, ...)."""
    try:
        gib = float(text)
    except ValueError:
        key = text.upper().replace("_", "-")
        mib = GPUS.get(key)
        if mib is None:
            raise GPUMemoryError(f"--gpu-memory: '{text}' is neither a number of GiB nor a known GPU "
                                 f"({', '.join(GPUS)})") from None
        return GPU(key, mib * (1 << 20))
    if not gib > 0 or gib == float("inf"):
        raise GPUMemoryError(f"--gpu-memory: must be a positive number of GiB, got {text}")
    return GPU(f"{gib:g} GiB", int(gib * GiB))


@dataclass
class StageBudget:
    pp_rank: int
    allocated: float            # the estimate: PyTorch allocator's peak
    cuda_context: float
    nccl: float
    nccl_communicators: list    # group kinds
    fragmentation: float
    total: float = 0.0
    headroom: Optional[float] = None   # GPU bytes minus total; None without a GPU

    @property
    def fits(self) -> Optional[bool]:
        return None if self.headroom is None else self.headroom >= 0

    def to_dict(self) -> dict:
        d = {"pp_rank": self.pp_rank, "allocated_peak_bytes": int(round(self.allocated)),
             "cuda_context_bytes": int(round(self.cuda_context)), "nccl_bytes": int(round(self.nccl)),
             "nccl_communicators": list(self.nccl_communicators),
             "fragmentation_bytes": int(round(self.fragmentation)), "total_bytes": int(round(self.total))}
        if self.headroom is not None:
            d.update(headroom_bytes=int(round(self.headroom)), fits=self.fits)
        return d


@dataclass
class Budget:
    stages: list
    gpu: Optional[GPU] = None
    allowances: dict = field(default_factory=dict)

    @property
    def worst(self) -> StageBudget:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu is None else all(s.fits for s in self.stages)

    def to_dict(self) -> dict:
        d = {"allowances": dict(self.allowances, modelled=True), "stages": [s.to_dict() for s in self.stages],
             "max_total_bytes": int(round(self.worst.total)), "worst_pp_rank": self.worst.pp_rank}
        if self.gpu is not None:
            d.update(gpu={"name": self.gpu.name, "bytes": self.gpu.bytes}, fits=self.fits,
                     min_headroom_bytes=int(round(min(s.headroom for s in self.stages))))
        return d


def _stage_communicators(report) -> dict:
    """pp stage -> sorted group kinds its ranks communicate in (communication rows with a group of 2 or more)."""
    return stage_communicators(report.cfg, report.layout, report.comm)


def stage_communicators(cfg, layout, comm) -> dict:
    """pp stage -> sorted group kinds its ranks communicate in, from a communication report (estimator.comm)."""
    pp = cfg.pipeline_model_parallel_size
    # One rank per stage (the first pp group holds one of each): a row is a rank class, all of a stage or none.
    reps = dict(enumerate(layout.groups["pp"][0]))
    kinds: dict = {p: set() for p in range(pp)}
    for c in comm.collectives:
        if c.group_size < 2:
            continue
        ranks = c.ranks   # sorted (estimator.comm builds every row from sorted stage ranks)
        for p, r in reps.items():
            i = bisect_left(ranks, r)
            if i < len(ranks) and ranks[i] == r:
                kinds[p].add(c.group)
    world = layout.world_size > 1
    return {p: sorted(k | ({"world"} if world else set())) for p, k in kinds.items()}


def allowances(**overrides) -> dict:
    """DEFAULTS with the overrides that are not None."""
    allow = dict(DEFAULTS)
    allow.update({k: v for k, v in overrides.items() if v is not None})
    return allow


def stage_budget(pp_rank: int, peak_bytes: float, communicators: list, allow: dict,
                 gpu: Optional[GPU] = None, fragmentation: Optional[float] = None) -> StageBudget:
    """One stage: allocated peak + CUDA context + NCCL per communicator + fragmentation (and the headroom).
    fragmentation: modelled bytes, in place of the allowance's percent of the peak."""
    if fragmentation is None:
        fragmentation = peak_bytes * allow["fragmentation_percent"] / 100.0
    sb = StageBudget(pp_rank, peak_bytes, allow["cuda_context_gib"] * GiB,
                     len(communicators) * allow["nccl_gib_per_communicator"] * GiB, communicators, fragmentation)
    sb.total = sb.allocated + sb.cuda_context + sb.nccl + sb.fragmentation
    if gpu is not None:
        sb.headroom = gpu.bytes - sb.total
    return sb


def budget(report, gpu: Optional[GPU] = None, **overrides) -> Budget:
    """Per stage: allocated peak + CUDA context + NCCL + fragmentation, and the headroom on `gpu`."""
    allow = allowances(**overrides)
    comms = _stage_communicators(report)
    modelled = _modelled_fragmentation(report, overrides)
    if modelled:
        allow.update(fragmentation_percent=None, fragmentation="modelled reserved minus allocated")
    stages = [stage_budget(r.pp_rank, r.peak_bytes, comms.get(r.pp_rank, []), allow, gpu,
                           modelled.get(r.pp_rank) if modelled else None)
              for r in report.estimate.ranks]
    return Budget(stages, gpu, allow)


def _modelled_fragmentation(report, overrides: dict) -> Optional[dict]:
    """pp stage -> the modelled reserved minus allocated (estimator.reserved), unless --fragmentation-percent was
    given or the report has no reserved model."""
    res = getattr(report, "reserved", None)
    if res is None or overrides.get("fragmentation_percent") is not None:
        return None
    return {s.pp_rank: s.fragmentation_bytes for s in res.stages}
