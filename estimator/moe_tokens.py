"""How many routed tokens a MoE layer's experts get on one rank: the routing assumption of an estimate.

The fitted and modelled formulas are measured (or written) for balanced routing: every expert gets tokens*k/E of
each source rank's T router tokens (tracer/moe_routing.py). Real routing differs, and megatron-core 0.16.1 sizes
the expert side of a MoE layer (dispatch and permute buffers, the experts' activations, the combine) by the
tokens each expert actually receives:

- dropless (no --moe-expert-capacity-factor): whatever the router picks. The estimate assumes an explicit bound,
  --moe-imbalance F on the excess over balanced routing: an EP rank's local experts together receive at most F
  times their balanced share, and no one of them more than its balanced share plus (F - 1) times the rank's (all
  of the rank's allowed excess). F = 1 is balanced routing, exactly (what `tracer.profile --balanced-routing`
  runs).
- --moe-expert-capacity-factor C: the router keeps at most `capacity` = get_capacity(T*k, E, C) =
  ceil(T*k/E * C) tokens per expert and source rank (moe_utils.apply_router_token_dropping), and never more than
  the T tokens there are. Without padding that is a bound on every expert (ratio ~C), so also on the rank: the rank
  bound is min(F, ~C).
- with --moe-pad-expert-input-to-capacity as well: every expert gets exactly min(capacity, T) rows per source rank
  (padding rows included), whatever the routing: the estimate is exact, F does not apply.

The bound acts on the number of routed token copies, which every expert-side formula has as a factor of k (tokens
* k; per expert tokens * k * ep / E): the estimator scales k, and nothing else, in those ops (compose.ComposedCache,
activations.LayerCache). The router's own tensors ([tokens, E] logits, probabilities and maps) and the shared
experts do not depend on routing and are not scaled. A rank never receives more than each source token can send
there (min(k, local experts) copies): with EP=1 all experts are local and the rank's total is exactly tokens*k
whatever the routing, yet one expert may take up to (F - 1) x E more than its share (bounded too by each token
reaching an expert at most once, E/k times balanced, and by the capacity): its transients grow, which the composed
replay models by running that busiest expert last (on top of the others' saved bytes; first in backward), the other
local experts sharing what is left. A per-op set has one row for all local experts (and its layer transients span
the whole MoE layer): its saved bytes take the rank's factor, its transients the busiest expert's in the per-expert
terms (those with 1/E) and the rank's in the others (`scaled`).
"""
from __future__ import annotations

import math

from estimator._record import dataclass

# --moe-imbalance's default: in every benchmarks/moe_routing.py run a fresh router's natural routing needed at most
# F = 1.16 to cover the measured peak (its token counts: an EP rank at most 1.36x its balanced share on these tiny
# CPU batches), and the one trained router with published GPU memory (Mixtral 8x7B, real data) about 1.29 (README,
# Accuracy). Higher would read every MoE run high: the 8-expert published case is +10% at 1.5.
DEFAULT_IMBALANCE = 1.3

MLP = "layers.*.mlp"
# Subtrees of a MoE layer's MLP whose allocations do not depend on how tokens are routed.
NOT_ROUTED = (MLP + ".router", MLP + ".shared_experts")
PER_EXPERT = MLP + ".experts.local_experts.*"


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity=None) -> int:
    """megatron-core 0.16.1's moe_utils.get_capacity, the same float operations (tests compare the two)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


@dataclass(frozen=True)
class Routing:
    """Token factors relative to balanced routing: `rank` on the rank's expert-side token count (its local experts
    together), `busiest` on one local expert's, `rest` on each other local expert's (so that busiest + (n-1) *
    rest = n * rank)."""
    mode: str                     # "dense", "balanced" (dropless, bound F), "capacity", "padded"
    imbalance: float = 1.0        # F (dropless and capacity without padding)
    capacity_factor: float = 0.0
    capacity: int = 0             # tokens per expert and source rank (megatron-core's get_capacity)
    tokens: int = 0               # router tokens per source rank
    rank: float = 1.0
    busiest: float = 1.0
    rest: float = 1.0
    local_experts: int = 1
    forced: bool = False          # --moe-router-force-load-balancing: random routing, a statistical bound

    @property
    def scales(self) -> bool:
        return self.mode != "dense" and not (self.rank == self.busiest == self.rest == 1.0)

    def describe(self) -> str:
        """One line for the report."""
        if self.mode == "dense":
            return "dense model (no routing)"
        if self.mode == "padded":
            return (f"capacity factor {self.capacity_factor:g}, padded to capacity: every expert gets exactly "
                    f"{min(self.capacity, self.tokens)} tokens per source rank ({self.busiest:.4g}x balanced; exact)")
        tail = (f"; the rank's local experts together at most {self.rank:.4g}x balanced, one of them at most "
                f"{self.busiest:.4g}x" if self.scales else "; every expert gets exactly tokens x k / E")
        if self.mode == "capacity":
            return (f"capacity factor {self.capacity_factor:g} without padding: at most {self.capacity} tokens per "
                    f"expert and source rank, and at most --moe-imbalance {self.imbalance:g}x balanced" + tail)
        if self.forced:
            return (f"dropless, forced load balancing (random routing): the mean plus {FORCED_SIGMAS:g} standard "
                    f"deviations of the token counts" + tail)
        return f"dropless, balanced x --moe-imbalance {self.imbalance:g} (an assumed bound)" + tail

    def short(self) -> str:
        """A few words for the summary's model line."""
        if self.mode == "padded":
            return f"padded, capacity {self.capacity_factor:g}"
        if self.mode == "capacity":
            return f"capacity {self.capacity_factor:g}"
        if self.forced and self.mode == "balanced":
            return f"forced balance, <={self.rank:.3g}x balanced"
        return f"<={self.imbalance:g}x balanced" if self.mode == "balanced" else "dense"

    def to_json(self) -> dict:
        out = {"mode": self.mode, "assumption": self.describe()}
        if self.mode != "dense":
            out.update(imbalance=None if self.mode == "padded" else self.imbalance, tokens_per_source_rank=self.tokens,
                       factor_rank=self.rank, factor_busiest_expert=self.busiest, factor_other_experts=self.rest,
                       local_experts=self.local_experts)
        if self.mode in ("capacity", "padded"):
            out.update(capacity_factor=self.capacity_factor, capacity=self.capacity,
                       padded=self.mode == "padded")
        return out


def _g(cfg, name, default=None):
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def routing(cfg) -> Routing:
    """The routing assumption for a config (TrainingConfig or its dict)."""
    E = int(_g(cfg, "num_experts", 0) or 0)
    if not E:
        return Routing("dense")
    k = int(_g(cfg, "moe_router_topk", 2))
    ep = int(_g(cfg, "expert_model_parallel_size", 1))
    n = max(1, E // ep)
    t = int(_g(cfg, "tensor_model_parallel_size", 1))
    sp = bool(_g(cfg, "sequence_parallel", False)) and t > 1
    # The router's tokens (routing_map.size(0)): the rank's sequence shard times the micro batch.
    T = int(_g(cfg, "seq_length", 0)) // int(_g(cfg, "context_parallel_size", 1)) * int(
        _g(cfg, "micro_batch_size", 1)) // (t if sp else 1)
    balanced = T * k / E
    forced = _g(cfg, "moe_router_force_load_balancing", False) and _g(cfg, "moe_imbalance", None) is None
    if forced:
        F, forced_one = forced_bounds(T, E, k, ep, n)
    else:
        F = float(_g(cfg, "moe_imbalance", DEFAULT_IMBALANCE))
    C = _g(cfg, "moe_expert_capacity_factor", None)
    if C is not None and C < 0:
        C = None          # megatron-core's TransformerConfig: a negative factor means dropless
    # A rank gets at most min(k, n) copies of each source token; one expert at most one copy (E/k x balanced).
    rank = min(F, min(k, n) * E / (k * n))
    cap = 0
    per_expert_cap = E / k
    if C is not None:
        cap = get_capacity(T * k, E, C)
        ratio = min(cap, T) / balanced if balanced else 1.0
        if _g(cfg, "moe_pad_expert_input_to_capacity", False):
            return Routing("padded", F, C, cap, T, ratio, ratio, ratio, n)
        rank, per_expert_cap = min(rank, ratio), min(per_expert_cap, ratio)
    busiest = min(forced_one if forced else 1.0 + (F - 1.0) * n, rank * n, per_expert_cap)
    rest = max(0.0, (rank * n - busiest) / (n - 1)) if n > 1 else rank
    return Routing("capacity" if C is not None else "balanced", F, C or 0.0, cap, T, rank, busiest, rest, n,
                   forced)


# --moe-router-force-load-balancing replaces the router's logits by i.i.d. normal draws (megatron-core's
# moe_utils.RandomSTE), so every token takes k distinct experts uniformly at random: balanced on average, not
# exactly. Token counts are then binomial (one expert) and a sum of hypergeometric draws (a rank's n local experts);
# the bound is their mean plus FORCED_SIGMAS standard deviations.
FORCED_SIGMAS = 4.0


def forced_bounds(T: int, E: int, k: int, ep: int, n: int) -> tuple:
    """(rank factor, busiest-expert factor) relative to balanced for randomly forced routing: the rank's local
    experts together, and one of them, at the mean plus FORCED_SIGMAS standard deviations of their token counts
    over the T * ep tokens of the expert group's source ranks."""
    N = max(T * ep, 1)
    mean_rank = N * k * n / E
    var_rank = N * k * (n / E) * (1 - n / E) * ((E - k) / (E - 1) if E > 1 else 0.0)
    mean_one = N * k / E
    var_one = mean_one * (1 - k / E)
    rank = 1.0 + FORCED_SIGMAS * math.sqrt(var_rank) / mean_rank if mean_rank else 1.0
    one = 1.0 + FORCED_SIGMAS * math.sqrt(var_one) / mean_one if mean_one else 1.0
    return rank, one


def routed(label: str) -> bool:
    """Whether a MoE layer's op or segment label is on the expert side (sized by routed tokens)."""
    if not (label == MLP or label.startswith(MLP + ".") or label.startswith(MLP + "@")):
        return False
    op = label.split("@", 1)[0]
    return not any(op == p or op.startswith(p + ".") for p in NOT_ROUTED)


def per_expert(label: str) -> bool:
    """Whether a label belongs to one local expert's own subtree (run once per local expert)."""
    return label == PER_EXPERT or label.startswith(PER_EXPERT + ".") or label.startswith(PER_EXPERT + "@")


def scaled(terms, env, rank: float, busiest: float) -> float:
    """A quantity's bytes with its routed-token terms (those with k) scaled: by `busiest` where the term is per
    expert (1/E), else by `rank`."""
    total = 0.0
    for t in terms or ():
        v = t.value(env)
        if v:
            powers = dict(t.vars)
            k = powers.get("k", 0)
            if k:
                v *= (busiest if powers.get("E", 0) < 0 else rank) ** k
        total += v
    return total

