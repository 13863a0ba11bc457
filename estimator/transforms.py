"""Memory-changing features no traced run measured, registered once and applied by the activation engine to the
values of whatever set supplies them (the modelled set's per-op rows, a program set's replays), as torch's
flop_counter registers one small function per op and walks the graph once.

Two kinds:
- a layer transform adds a row (op, saved, forward peak, backward peak) to every transformer layer of a chunk,
  inside the layer, so a full-recompute checkpoint recomputes it with the layer (fp8's saved inputs, the router's
  logits in fp32, the fp32 residual stream, torch's fp32 softmax fallback);
- a chunk transform takes bytes off a chunk's saved level given each layer's saved bytes (activation CPU
  offloading).
Each takes the config, and returns None (or 0) where the config does not use its feature. The feature modules
register on import (estimator.activations imports them all); the engines call layer_rows and relieved only,
so a new feature is one registered function, whatever set is loaded.
"""
from __future__ import annotations

from typing import Callable

# name -> fn(cfg, env, moe: bool, modelled: bool) -> (op, saved, fwd peak, bwd peak) | None. `modelled`: the set
# is the hand-modelled one (a fitted set measured some of these on its own runs).
LAYER: dict[str, Callable] = {}
# name -> fn(cfg, layer_kept: list[float]) -> bytes that leave the device per microbatch
CHUNK: dict[str, Callable] = {}
LAYER_LABELS: set = set()   # the op labels of the rows layer transforms add
# name -> (switch, value): a transform that models a switch value a set may also have measured; a set whose runs
# had that value answers from its programs, and the transform adds nothing there
STANDS_FOR: dict[str, tuple] = {}


def layer_transform(name: str, label: str, stands_for: tuple | None = None):
    """Register fn as the layer transform `name`; `label`: the op label of the rows it adds; `stands_for`: the
    (switch, value) it models where a set did not measure it."""
    def register(fn):
        LAYER[name] = fn
        LAYER_LABELS.add(label)
        if stands_for is not None:
            STANDS_FOR[name] = stands_for
        return fn
    return register


def modelled_switch_values() -> set:
    """The (switch, value) pairs a transform models where a set's runs never had them: such a value is not
    missing from the set's measurements, its bytes come from the transform (said in the report)."""
    return set(STANDS_FOR.values())


def chunk_transform(name: str):
    def register(fn):
        CHUNK[name] = fn
        return fn
    return register


class _Fields:
    """A config given as a dict (TrainingConfig.to_dict(), as trace headers and the fitter hold it) read as
    attributes, as the transforms read a TrainingConfig; a field the dict lacks is None (off)."""
    __slots__ = ("_d",)

    def __init__(self, d: dict):
        self._d = d

    def __getattr__(self, name):
        return self._d.get(name)


def _fields(cfg):
    return _Fields(cfg) if isinstance(cfg, dict) else cfg


def layer_rows(cfg, env: dict, moe: bool, modelled: bool, measured=None) -> list:
    """The rows every registered layer transform adds to a layer of this kind (dense or MoE). measured(switch,
    value): whether the set's runs had that value (a transform STANDS_FOR then adds nothing); None: never."""
    cfg = _fields(cfg)
    rows = []
    for name, fn in LAYER.items():
        if measured is not None and name in STANDS_FOR and measured(*STANDS_FOR[name]):
            continue
        row = fn(cfg, env, moe, modelled)
        if row is not None:
            rows.append(row)
    return rows


def relieved(cfg, layer_kept: list, saved: float, fwd: float) -> tuple:
    """A chunk's (saved, forward peak) after the chunk transforms: bytes that leave the device during the forward
    lower the saved level and the forward peak (reached at its end); the backward's transient above the level is
    unchanged."""
    cfg = _fields(cfg)
    relief = sum(fn(cfg, layer_kept) or 0.0 for fn in CHUNK.values())
    if not relief:
        return saved, fwd
    return saved - relief, max(fwd - relief, saved - relief)

