"""Reserved memory per pipeline stage for the report: the allocator settings in force, and each stage's predicted
allocation stream (estimator.alloc_stream) replayed through the caching-allocator model
(estimator.caching_allocator). `max_memory_reserved` is what runs out first; the verdict's fragmentation
allowance is the modelled reserved minus allocated unless --fragmentation-percent overrides it.

Settings: --cuda-alloc-conf, else PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF from the environment the
estimator runs in (a launch line `env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun ...` keeps its
environment when `torchrun` is replaced), else torch's defaults (torch reads the two variables in that order).
"""
from __future__ import annotations

from typing import Optional

import os

from estimator._record import dataclass, field

LABEL = "modelled (the predicted stream through a caching-allocator model; docs/ACCURACY.md)"
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass
class StageReserved:
    pp_rank: int
    reserved_bytes: float        # the estimate's allocated peak + the replay's reserved minus allocated
    fragmentation_bytes: float   # the replay's peak reserved minus its peak allocated (>= 0)
    replay_reserved_bytes: int   # the replayed stream's own peaks
    replay_allocated_bytes: int
    segments: int                # segments at the replay's peak (cudaMalloc'd, or expandable)
    events: int


@dataclass
class ReservedModel:
    conf: object                 # caching_allocator.AllocatorConfig
    source: str                  # where the settings came from
    stages: list = field(default_factory=list)

    def by_stage(self) -> dict:
        return {s.pp_rank: s for s in self.stages}

    def settings(self) -> dict:
        return dict(self.conf.to_dict(), source=self.source)

    def to_dict(self) -> dict:
        return {"label": LABEL, "allocator_settings": self.settings(),
                "stages": [{"pp_rank": s.pp_rank, "reserved_bytes": int(round(s.reserved_bytes)),
                            "fragmentation_bytes": int(round(s.fragmentation_bytes)),
                            "replay_reserved_bytes": s.replay_reserved_bytes,
                            "replay_allocated_bytes": s.replay_allocated_bytes, "segments": s.segments,
                            "events": s.events} for s in self.stages]}


def allocator_settings(option: Optional[str], environ=None) -> tuple:
    """(AllocatorConfig, source) from --cuda-alloc-conf or the environment; a bad value is a ConfigError."""
    from estimator.args import ConfigError
    from estimator.caching_allocator import AllocConfError, parse_alloc_conf
    environ = os.environ if environ is None else environ
    text, source = option, "--cuda-alloc-conf"
    if text is None:
        for var in ENV_VARS:
            if environ.get(var):
                text, source = environ[var], var
                break
    if text is None:
        text, source = "", "defaults"
    try:
        return parse_alloc_conf(text), source
    except AllocConfError as exc:
        raise ConfigError(f"{source}: {exc}".replace("PYTORCH_CUDA_ALLOC_CONF: ", "")) from None


def model(cfg, formula_set, est, option: Optional[str] = None, environ=None) -> ReservedModel:
    """Every stage of `est` replayed under the settings in force."""
    from estimator.alloc_stream import modelled_reserved
    conf, source = allocator_settings(option, environ)
    out = ReservedModel(conf, source)
    peaks = {r.pp_rank: r.peak_bytes for r in est.ranks}
    for d in modelled_reserved(cfg, formula_set, est, conf):
        frag = max(0, d["reserved_bytes"] - d["allocated_peak_bytes"])
        out.stages.append(StageReserved(d["pp_rank"], peaks[d["pp_rank"]] + frag, frag, d["reserved_bytes"],
                                        d["allocated_peak_bytes"], d["segments"], d["events"]))
    return out
