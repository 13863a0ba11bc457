"""--pipeline-model-parallel-layout: which layers each (pipeline rank, virtual stage) builds.

The string lists the PP x VPP stages in model order, separated by '|': E the embedding, t a transformer layer,
L the loss, m an MTP layer; `X*n` repeats one character, `(...)*n` a group (which may span stages); commas are
cosmetic. Stage i belongs to pipeline rank i % PP, virtual stage i // PP (megatron-core's
PipelineParallelLayerLayout); the layout fixes the virtual-pipeline size (stages / PP).
"""
from __future__ import annotations

import re
from functools import lru_cache

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_CHAR = re.compile(r"(.)\*(\d+)")
SYMBOLS = "ELtm"


class LayoutError(ValueError):
    pass


@lru_cache(maxsize=64)
def stages(layout: str) -> tuple:
    """The stages of a layout string, each the string of its layer characters, in model order."""
    text = layout.replace(",", "")
    while True:  # groups first (innermost first), then single characters
        expanded = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            break
        text = expanded
    text = _CHAR.sub(lambda m: m.group(1) * int(m.group(2)), text)
    out = tuple(text.split("|"))
    for stage in out:
        for ch in stage:
            if ch not in SYMBOLS:
                raise LayoutError(f"Invalid layer character: {ch} (stage={stage!r}, layout_str={text!r}), known "
                                  f"layer characters: {list(SYMBOLS)}")
    return out


def validate(cfg, parsed: list[str]) -> None:
    """megatron-core's checks (TransformerConfig, PipelineParallelLayerLayout), in its words."""
    flat = "".join(parsed)
    if not flat or flat[0] != "E":
        raise LayoutError(f"The first layer must be embedding, but got {flat[:1] or 'nothing'}")
    if flat[-1] != "L":
        raise LayoutError(f"The last layer must be loss, but got {flat[-1]}")
    if flat.count("E") != 1:
        raise LayoutError("Embedding must be specified exactly once")
    if flat.count("L") != 1:
        raise LayoutError("Loss must be specified exactly once")
    if flat.count("t") != cfg.num_layers:
        raise LayoutError(f"Number of decoder layers {flat.count('t')}must match num_layers {cfg.num_layers}")
    if flat.count("m") != (cfg.mtp_num_layers or 0):
        raise LayoutError("Number of mtp layers in layout must match mtp_num_layers")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise LayoutError("decoder layers must be placed before MTP layers")
    if parsed[-1].count("m") != flat.count("m"):
        # megatron-core's mtp_standalone: the stage sends 1 + D hidden states on
        raise LayoutError("MTP layers on a stage other than the loss's are not modelled: put every 'm' of "
                          "--pipeline-model-parallel-layout in its last stage")


def decoder_layers(parsed: list[str], pp: int, pp_rank: int, vp: int) -> int:
    """Transformer layers built on (pp_rank, virtual stage vp)."""
    return parsed[vp * pp + pp_rank].count("t")
