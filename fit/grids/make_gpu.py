"""Writes fit/grids/gpu_h100.json and gpu_validate.json: the GPU campaign (python -m fit.gpu_campaign) and the
held-out configs its fitted set is checked on (python -m fit.gpu_validate). One GPU, so world size 1 only.

Campaign: the two bases of cpu_compose (GPT-style: gelu, LayerNorm, learned positions, MHA, biases, tied; Llama-style:
swiglu, RMSNorm, rope, GQA, no biases, untied), here in bf16 with Megatron-LM's default Transformer Engine spec, each
switch toggled alone (also fp32, full recompute, the local spec with and without the softmax in fp32, the fusions
off, the cross-entropy fusion on), plus the pairs whose ops interact, at GPU-sized shapes that still train in
milliseconds (2 layers). Configs are ordered shape round by shape round (every combination's first shape, then
every second shape, ...), so a campaign cut short by its time budget still covers every combination.
Run: python fit/grids/make_gpu.py
"""
from make_cpu_compose import LLAMA, TOGGLES, shape_flags  # noqa: E402 (run as a script from this directory)

from fit.campaign import write_grid  # make_cpu_compose put the repository on the path

COMMON = ["--num-layers", "2", "--max-position-embeddings", "4096", "--make-vocab-size-divisible-by", "128",
          "--transformer-impl", "transformer_engine", "--bf16", "--seed", "1234", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--manual-gc"]
BASES = (("gpt", {}), ("llama", LLAMA))
# (seq, micro batch, hidden, heads, kv-channels or None, ffn or None, vocab): every variable moves on its own, and
# heads x kv-channels differs from the hidden size in half of them (else h and a*d terms cannot be told apart: the
# first H100 campaign left the local spec's attention formulas ambiguous for that reason).
SHAPES = [
    (1024, 2, 1024, 16, None, None, 32000),
    (2048, 1, 768, 12, None, 3072, 50257),
    (512, 4, 1536, 12, 96, None, 16384),
    (1536, 1, 1024, 8, 64, 2816, 49152),
    (768, 3, 512, 8, None, 2048, 24000),
    (1280, 2, 1280, 10, 96, 3584, 32768),
]
_CPU = {name: (add, drop) for name, add, drop in TOGGLES}
_SWITCH_TOGGLES = ["swiglu", "gelu", "rms", "ln", "rope", "learned", "nobias", "bias", "gqa", "mha", "untied", "tied",
                   "dropout", "selective"]
GPU_TOGGLES = [(name, *_CPU[name]) for name in _SWITCH_TOGGLES] + [
    ("fp32", {}, ("--bf16",)),
    ("full", {"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": 1}, ()),
    ("local", {"--transformer-impl": "local"}, ()),
    ("local_sm32", {"--transformer-impl": "local", "--attention-softmax-in-fp32": True}, ()),
    ("nofusion", {"--no-bias-gelu-fusion": True, "--no-bias-swiglu-fusion": True, "--no-bias-dropout-fusion": True,
                  "--no-masked-softmax-fusion": True, "--no-rope-fusion": True}, ()),
    ("cefusion", {"--cross-entropy-loss-fusion": True}, ()),
]
PAIRS = [("dropout", "selective"), ("dropout", "local"), ("selective", "local")]
# Shapes per combination: the base 5; the switches that change most segments 3; the others and pairs 2. The grid's
# size is bounded by the device time (fit/gpu_campaign.py).
SHAPES_PER = {"base": 5, "dropout": 3, "selective": 3, "full": 3, "local": 3}
# Held out: shapes the campaign never traced (and one more layer), one config per base and a few switches.
VALIDATE_SHAPES = [(1792, 1, 896, 14, None, 3584, 40000), (640, 3, 1152, 16, 96, None, 28000)]
VALIDATE = ["base", "dropout", "selective", "full", "local", "fp32"]


def _groups(heads: int) -> int:
    """Query groups that divide the heads and vary with them (a fixed count would be confounded with a constant)."""
    return heads // 4 if heads % 4 == 0 else 2 if heads % 2 == 0 else 1


def _apply(base: dict, names: list) -> dict | None:
    """The base's flags with the named toggles applied; None when one of them is already the base's value."""
    flags = dict(base)
    for name in names:
        add, drop = next((a, d) for n, a, d in GPU_TOGGLES if n == name) if name != "base" else ({}, ())
        if drop and not any(k in base or k in COMMON for k in drop):
            return None
        if add and all(base.get(k) == v for k, v in add.items()):
            return None
        for k in drop:
            flags.pop(k, None)
        flags.update(add)
        flags.update({k: None for k in drop if k in COMMON})   # a COMMON flag removed: null in the grid's `set`
    return flags


def _entry(prefix: str, flags: dict, shape) -> dict:
    f = dict(flags)
    f.update(shape_flags(shape))
    if "--num-query-groups" in f:
        f["--num-query-groups"] = _groups(f["--num-attention-heads"])
    s, b, h = f["--seq-length"], f["--micro-batch-size"], f["--hidden-size"]
    return {"name": f"{prefix}_s{s}_b{b}_h{h}_a{f['--num-attention-heads']}",
            "set": {k: v for k, v in f.items() if v is not True and v is not None},
            "unset": [k for k, v in f.items() if v is None],
            "flags": [k for k, v in f.items() if v is True]}


def configs() -> list:
    rounds: list = []   # rounds[j]: every combination's j-th shape
    k = 0
    combos = [[name] for name, _, _ in [("base", 0, 0)] + GPU_TOGGLES] + [list(p) for p in PAIRS]
    for base_name, base in BASES:
        for names in combos:
            flags = _apply(base, names)
            if flags is None:
                continue
            n = SHAPES_PER.get(names[0], 2) if len(names) == 1 else 2
            for j in range(n):
                while len(rounds) <= j:
                    rounds.append([])
                rounds[j].append(_entry(f"{base_name}_{'_'.join(names)}", flags, SHAPES[(k + j) % len(SHAPES)]))
            k += 1
    return [c for r in rounds for c in r]


def validate_configs() -> list:
    out = []
    for base_name, base in BASES:
        for i, name in enumerate(VALIDATE):
            entry = _entry(f"{base_name}_{name}", _apply(base, [name]), VALIDATE_SHAPES[i % len(VALIDATE_SHAPES)])
            entry["set"]["--num-layers"] = 3
            out.append(entry)
    return out


def _write(name: str, description: str, cfgs: list, iterations: int) -> None:
    names = [c["name"] for c in cfgs]
    assert len(set(names)) == len(names), "duplicate config names"
    for c in cfgs:   # keep the file short: drop empty lists
        for key in ("unset", "flags"):
            if not c[key]:
                del c[key]
    write_grid(name, description, "cuda", iterations, COMMON, cfgs, __file__)


def main():
    _write("gpu_h100", "one-GPU campaign: GPT- and Llama-style bases in bf16 (Transformer Engine spec by default), "
           "each switch toggled alone and interacting pairs, GPU-sized shapes with 2 layers", configs(), 3)
    _write("gpu_validate", "held-out GPU configs (3 layers, unseen shapes) for python -m fit.gpu_validate",
           validate_configs(), 5)


if __name__ == "__main__":
    main()
