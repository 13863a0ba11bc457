"""Rank grid and process groups, laid out exactly as megatron-core 0.16.1 lays them out.

Megatron places ranks with `RankGenerator`: the global rank is a mixed-radix number whose digits are the
per-dimension ranks in the order `tp-cp-ep-dp-pp` (first = fastest varying). Megatron-LM's
`--use-tp-pp-dp-mapping` switches to `tp-cp-ep-pp-dp`. Dense groups come from a generator with ep=1; expert
groups from a second generator (tp=expert-TP, ep=EP, dp=expert-DP, cp=1) over the same ranks. Pure Python: the
estimator must not import torch or megatron.
"""

from __future__ import annotations

from typing import Optional

from estimator._record import dataclass, field

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"  # Megatron-LM --use-tp-pp-dp-mapping
_TOKENS = ("tp", "pp", "dp", "ep", "cp")


class ParallelConfigError(ValueError):
    """An impossible parallel layout; the message is Megatron's wording where it has one."""


def _prefix_product(a, init=1):
    out = [init]
    for v in a:
        init *= v
        out.append(init)
    return out


def _decompose(index, shape):
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride)]


def _digit_offsets(shape, stride) -> list[int]:
    """sum(digit_i * stride_i) for every index 0..prod(shape)-1 in mixed-radix order (first digit fastest)."""
    out = [0]
    for s, d in zip(shape, stride):
        if s > 1:
            out = [o + k for k in range(0, s * d, d) for o in out]
    return out


def masked_orthogonal_groups(world_size: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Same result as megatron's `generate_masked_orthogonal_rank_groups` (masked digits vary inside a group),
    by stride arithmetic instead of decomposing every rank."""
    masked_shape = [s for s, m in zip(sizes, mask) if m]
    unmasked_shape = [s for s, m in zip(sizes, mask) if not m]
    stride = _prefix_product(sizes)
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    bases = _digit_offsets(unmasked_shape, unmasked_stride)
    n_groups = world_size // group_size
    if n_groups != len(bases):  # decompose() wraps the group index modulo prod(unmasked_shape)
        bases = [bases[gi % len(bases)] for gi in range(n_groups)]
    if group_size == 1:
        return [[b] for b in bases]
    varying = [(s, d) for s, d in zip(masked_shape, masked_stride) if s > 1]
    if len(varying) == 1:  # one dimension varies inside a group (tp, dp, pp, world, ...): each group is a range
        (s, d), = varying
        return [list(range(b, b + s * d, d)) for b in bases]
    inner = _digit_offsets(masked_shape, masked_stride)  # len == group_size
    return [[b + o for o in inner] for b in bases]


class RankGrid:
    """Pure-Python twin of megatron.core.parallel_state.RankGenerator."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = DEFAULT_ORDER):
        if ep != 1 and cp != 1:
            raise ParallelConfigError("Both EP and CP > 1 in not allow in one rank generator.")
        self.size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        for t in tokens:
            if t not in _TOKENS:
                raise ParallelConfigError(f"unknown parallelism '{t}' in rank order '{order}'")
        for name in _TOKENS:
            if name not in tokens:
                if self.size[name] != 1:
                    raise ParallelConfigError(
                        f"The size of ({name}) is ({self.size[name]}), but you haven't specified the order ({order}).")
                tokens.append(name)
        self.tokens = tokens
        self.order = "-".join(tokens)
        self.ordered_size = [self.size[t] for t in tokens]
        self.world_size = tp * ep * dp * pp * cp

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups in which the dimensions named in `token` (e.g. 'dp-cp') vary, as megatron returns them."""
        wanted = token.split("-")
        mask = [t in wanted for t in self.tokens]
        return masked_orthogonal_groups(self.world_size, self.ordered_size, mask)

    def coords(self, rank: int) -> dict[str, int]:
        """Per-dimension rank of a global rank (its digits in the mixed-radix order)."""
        return dict(zip(self.tokens, _decompose(rank, self.ordered_size)))


def gpu_name(rank: int, nproc_per_node: int) -> str:
    """torchrun fills nodes in order: rank r is GPU r % nproc on node r // nproc."""
    return f"n{rank // nproc_per_node}_g{rank % nproc_per_node}"


@dataclass
class RankCoords:
    rank: int
    name: str  # n{node}_g{gpu}
    node: int
    gpu: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int  # expert-parallel rank (from the expert generator)
    etp: int  # expert-tensor-parallel rank
    edp: int  # expert-data-parallel rank

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# Group names as reported, and where megatron builds each one (generator, token).
DENSE_GROUPS = {"tp": "tp", "cp": "cp", "dp": "dp", "dp-cp": "dp-cp", "pp": "pp", "tp-pp": "tp-pp",
                "tp-cp": "tp-cp", "tp-dp-cp": "tp-dp-cp"}
EXPERT_GROUPS = {"ep": "ep", "expert-tp": "tp", "expert-dp": "dp", "expert-tp-ep": "tp-ep"}
# Several distributed-optimizer instances (--num-distributed-optimizer-instances N > 1): each data-parallel group
# splits into N consecutive parts, the optimizer's shards (intra), and the ranks holding one shard across the
# parts all-reduce it (inter, one group for dense and expert parameters: megatron-core builds it from the expert
# data-parallel groups, create_hierarchical_groups with sizes [EDP / N, N]).
INSTANCE_GROUPS = ("dp-cp-intra", "expert-dp-intra", "dist-opt-inter")


@dataclass
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    order: str
    nproc_per_node: int
    groups: dict[str, list[list[int]]] = field(default_factory=dict)
    # Per-rank coordinates are built on first use (`ranks`): a full estimate does not need them.
    _ranks: Optional[list] = field(default=None, repr=False)
    _grids: Optional[tuple] = field(default=None, repr=False, compare=False)
    _columns: Optional[dict] = field(default=None, repr=False, compare=False)

    @property
    def ranks(self) -> list[RankCoords]:
        if self._ranks is None:
            self._ranks = _rank_coords(self.columns)
        return self._ranks

    @property
    def columns(self) -> dict[str, list]:
        """The fields of `ranks` as one list each (rank_columns), without an object per rank."""
        if self._columns is None:
            self._columns = rank_columns(self.world_size, self.nproc_per_node, *self._grids)
        return self._columns

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """Global ranks of pipeline stage `pp_rank`, ascending (== [r.rank for r in ranks if r.pp == pp_rank])."""
        return sorted(g[pp_rank] for g in self.groups["pp"])

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind `name` that contains `rank` (embedding groups: [] when the rank is in none)."""
        for g in self.groups[name]:
            if rank in g:
                return g
        return []

    def name(self, rank: int) -> str:
        return gpu_name(rank, self.nproc_per_node)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "order": self.order, "nproc_per_node": self.nproc_per_node,
                "sizes": {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "ep": self.ep,
                          "etp": self.etp, "edp": self.edp},
                "groups": {k: [list(g) for g in v] for k, v in self.groups.items()},
                "ranks": [r.to_dict() for r in self.ranks]}


def build_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                 order: str = DEFAULT_ORDER, nproc_per_node: int | None = None,
                 dist_opt_instances: int = 1) -> ParallelLayout:
    """All groups and per-rank coordinates, following megatron-core's initialize_model_parallel."""
    for label, v in (("world size", world_size), ("tensor", tp), ("pipeline", pp), ("context", cp), ("expert", ep)):
        if int(v) < 1:
            raise ParallelConfigError(f"{label} parallel size must be >= 1, got {v}")
    etp = tp if etp is None else etp
    if world_size % (tp * pp * cp) != 0:
        raise ParallelConfigError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})")
    dp = world_size // (tp * pp * cp)
    if world_size % (etp * ep * pp) != 0:
        raise ParallelConfigError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
            f"({etp * ep * pp})")
    edp = world_size // (etp * ep * pp)
    dense = RankGrid(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGrid(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise ParallelConfigError("When not using pp-last rank ordering, the data parallel size of the attention "
                                  "and moe layers must be the same")
    pp_groups = dense.get_ranks("pp")
    # Both generators span the same world: with pp the slowest digit of both, their pp groups are equal by
    # construction (ranks r, r + world/pp, ...), so only other orders need the expert groups built to compare.
    pp_last = dense.tokens[-1] == "pp" and expert.tokens[-1] == "pp"
    if not pp_last and pp_groups != expert.get_ranks("pp"):
        raise ParallelConfigError("Pipeline parallel groups are expected to be the same for Non-Expert and Expert part")

    n = int(dist_opt_instances)
    check_dist_opt_instances(dp * cp, edp, n)
    groups = _LazyGroups(dense, expert, world_size, n)
    dict.__setitem__(groups, "pp", pp_groups)

    nproc = nproc_per_node or world_size
    return ParallelLayout(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, edp=edp,
                          order=dense.order if order == DEFAULT_ORDER else order, nproc_per_node=nproc,
                          groups=groups, _grids=(dense, expert))


def check_dist_opt_instances(dp_cp: int, edp: int, n: int) -> None:
    """N distributed-optimizer instances split the DP x CP and the expert DP groups: megatron-core's
    initialize_model_parallel checks, in its words."""
    if n < 1:
        raise ParallelConfigError(f"the number of distributed-optimizer instances must be >= 1, got {n}")
    if dp_cp % n:
        raise ParallelConfigError("Data parallel size should be divisible by partial DistOpt shard factor")
    if edp % n:
        raise ParallelConfigError("Expert data parallel size should be divisible by partial DistOpt shard factor")


class _LazyGroups(dict):
    """The layout's groups dict, each kind computed on first access (a full estimate asks for a few of them).
    Behaves as the plain dict {kind: groups} in the order DENSE_GROUPS, EXPERT_GROUPS, embedding,
    position-embedding, world; anything but item access materializes every kind first."""
    KINDS = tuple(DENSE_GROUPS) + tuple(EXPERT_GROUPS) + ("embedding", "position-embedding", "world")

    def __init__(self, dense, expert, world_size, instances: int = 1):
        super().__init__()
        self._src = (dense, expert, world_size, instances)
        self._full = False
        if instances > 1:   # the instance groups exist only then (as in megatron-core)
            self.KINDS = self.KINDS + INSTANCE_GROUPS

    def _make(self, name):
        dense, expert, world_size, n = self._src
        if name in DENSE_GROUPS:
            return dense.get_ranks(DENSE_GROUPS[name])
        if name in EXPERT_GROUPS:
            return expert.get_ranks(EXPERT_GROUPS[name])
        if name in INSTANCE_GROUPS and n > 1:
            if name == "dist-opt-inter":
                return [g[j::len(g) // n] for g in self["expert-dp"] for j in range(len(g) // n)]
            whole = self["dp-cp" if name == "dp-cp-intra" else "expert-dp"]
            return [g[i * (len(g) // n):(i + 1) * (len(g) // n)] for g in whole for i in range(n)]
        # default_embedding_ranks / default_position_embedding_ranks: first and last (resp. first) stage of each
        # pp group.
        if name == "embedding":
            return [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in self["pp"]]
        if name == "position-embedding":
            return [[g[0]] for g in self["pp"]]
        if name == "world":
            return [list(range(world_size))]
        raise KeyError(name)

    def _materialize(self):
        if not self._full:
            self._full = True
            done = dict(dict.items(self))
            dict.clear(self)
            for name in self.KINDS:
                v = done.get(name)
                dict.__setitem__(self, name, v if v is not None else self._make(name))
        return self

    def __missing__(self, name):
        if self._full or name not in self.KINDS:
            raise KeyError(name)
        v = self._make(name)
        dict.__setitem__(self, name, v)
        return v

    def get(self, name, default=None):
        return self[name] if name in self else default

    def __contains__(self, name):
        return name in self.KINDS if not self._full else dict.__contains__(self, name)

    def __iter__(self):
        return dict.__iter__(self._materialize())

    def __len__(self):
        return dict.__len__(self._materialize())

    def __eq__(self, other):
        return dict.__eq__(self._materialize(), other)

    def __ne__(self, other):
        return dict.__ne__(self._materialize(), other)

    __hash__ = None

    def __repr__(self):
        return dict.__repr__(self._materialize())

    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def keys(self):
        return dict.keys(self._materialize())

    def values(self):
        return dict.values(self._materialize())

    def items(self):
        return dict.items(self._materialize())

    def copy(self):
        return dict(self.items())

    def __setitem__(self, name, value):
        dict.__setitem__(self._materialize(), name, value)

    def __delitem__(self, name):
        dict.__delitem__(self._materialize(), name)

    def pop(self, *a):
        return dict.pop(self._materialize(), *a)

    def update(self, *a, **k):
        dict.update(self._materialize(), *a, **k)

    def setdefault(self, *a):
        return dict.setdefault(self._materialize(), *a)


def rank_columns(world_size: int, nproc: int, dense: RankGrid, expert: RankGrid) -> dict[str, list]:
    """RankCoords' fields as one list per field, indexed by global rank: each coordinate is one digit of the rank
    in its generator's mixed radix (RankGrid.coords), computed per column rather than per rank."""
    def digit(grid: RankGrid, token: str) -> list[int]:
        stride = _prefix_product(grid.ordered_size)
        i = grid.tokens.index(token)
        s, d = grid.ordered_size[i], stride[i]
        return [0] * world_size if s == 1 else [(r // d) % s for r in range(world_size)]

    rng = range(world_size)
    return {"rank": list(rng), "name": [gpu_name(r, nproc) for r in rng], "node": [r // nproc for r in rng],
            "gpu": [r % nproc for r in rng], "tp": digit(dense, "tp"), "cp": digit(dense, "cp"),
            "dp": digit(dense, "dp"), "pp": digit(dense, "pp"), "ep": digit(expert, "ep"),
            "etp": digit(expert, "tp"), "edp": digit(expert, "dp")}


def _rank_coords(columns: dict[str, list]) -> list[RankCoords]:
    return [RankCoords(*row) for row in zip(*columns.values())]  # rank_columns lists them in field order


def layout_from_config(cfg) -> ParallelLayout:
    """Layout for a TrainingConfig (Megatron dest names; missing attributes take Megatron's defaults)."""
    g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    world = g("world_size") or (g("nproc_per_node", 1) or 1) * (g("nnodes", 1) or 1)
    order = TP_PP_DP_ORDER if g("use_tp_pp_dp_mapping", False) else DEFAULT_ORDER
    return build_layout(world_size=int(world), tp=g("tensor_model_parallel_size", 1) or 1,
                        pp=g("pipeline_model_parallel_size", 1) or 1, cp=g("context_parallel_size", 1) or 1,
                        ep=g("expert_model_parallel_size", 1) or 1, etp=g("expert_tensor_parallel_size"),
                        order=order, nproc_per_node=g("nproc_per_node") or None,
                        dist_opt_instances=g("num_distributed_optimizer_instances", 1) or 1)
