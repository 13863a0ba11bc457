"""Balanced MoE routing for profiling (`python -m tracer.profile --balanced-routing`).

A dropless MoE layer's buffers are sized by how many tokens the router sends to each expert, which depends on the
weights and the data: two runs of one config allocate different bytes, and no formula of the config's shapes fits
them. With this switch every router's logits are overwritten, in place, with a fixed round-robin pattern: in each
block of E consecutive tokens, token r prefers experts r, r+1, ..., r+k-1 (mod E) in that order. Every expert then
receives exactly tokens*k/E tokens (when E divides the rank's token count), the layout the estimator predicts.
Like megatron-core's own `moe_router_force_load_balancing` (random logits, for benchmarking), gradients still reach
the router weights unchanged (the pattern replaces values, not the autograd graph), and everything after the gate
(softmax/top-k, aux losses, token dispatch, experts) is megatron-core's own code. The pattern is written through
views (zero_/fill_ on diagonals), so it allocates nothing that real training would not.
"""
from __future__ import annotations

_installed = False


def balance_(logits, num_experts: int, topk: int) -> None:
    """Overwrite `logits` ([..., E], contiguous) in place with the round-robin top-k pattern."""
    E, k = int(num_experts), int(topk)
    flat = logits.data.view(-1, E)        # a view: .view refuses (rather than copies) a non-contiguous tensor
    n = flat.shape[0]
    flat.zero_()
    whole = n - n % E
    if whole:
        blocks = flat[:whole].view(whole // E, E, E)   # [block, token r, expert]
        for j in range(k):                             # expert (r + j) mod E gets score k - j
            blocks.diagonal(offset=j, dim1=1, dim2=2).fill_(k - j)
            if j:
                blocks.diagonal(offset=j - E, dim1=1, dim2=2).fill_(k - j)
    for r in range(n - whole):                         # a last partial block
        row = flat[whole + r]
        for j in range(k):
            row[(r + j) % E].fill_(k - j)


def install() -> None:
    """Patch megatron-core's TopKRouter so its gate's logits are balanced (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    orig = getattr(TopKRouter, "gating", None)
    if orig is None:
        raise RuntimeError("--balanced-routing: this megatron-core's TopKRouter has no gating() to patch")

    def gating(self, input, *args, **kwargs):
        logits = orig(self, input, *args, **kwargs)
        balance_(logits, self.config.num_moe_experts, self.topk)
        return logits

    TopKRouter.gating = gating
    _installed = True


def installed() -> bool:
    return _installed
