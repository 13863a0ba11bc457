"""A torchrun command line, split as torchrun splits it: its own flags, the training script, the script's arguments.

`get-training-info` and `profile-training-info` take the line that followed the word `torchrun` (or
`python -m torch.distributed.run`) in a launch script, so replacing that word is the only edit. The flag table is
torch.distributed.run's (torch 2.13; tests/test_torchrun_line.py compares it with torch's own parser). No torch here.
"""
from __future__ import annotations

from typing import Optional

from estimator._record import dataclass, field

# Options for get-training-info / profile-training-info from the environment (a launch script needs no other edit).
ENV_ARGS = "MEMTRACE_ARGS"

# torchrun's options that take a value, each spelling (argparse accepts both dash and underscore forms).
_WITH_VALUE = ("nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "max-restarts",
               "monitor-interval", "start-method", "event-log-handler", "role", "log-dir", "redirects", "tee",
               "local-ranks-filter", "duplicate-stdout-filters", "duplicate-stderr-filters", "node-rank",
               "master-addr", "master-port", "local-addr", "logs-specs", "numa-binding", "signals-to-handle",
               "shutdown-timeout")
_SWITCHES = ("standalone", "module", "no-python", "run-path", "virtual-local-rank")


def _spellings(names) -> set:
    return {f"--{n}" for n in names} | {f"--{n.replace('-', '_')}" for n in names}


VALUE_FLAGS = _spellings(_WITH_VALUE) | {"-r", "-t"}
SWITCH_FLAGS = _spellings(_SWITCHES) | {"-m"}
# The ones that say how many processes run: passed on to the estimator's parser (the others change nothing).
WORLD_FLAGS = _spellings(("nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port"))


@dataclass
class TorchrunLine:
    launcher: list = field(default_factory=list)   # torchrun's own flags, as given
    script: Optional[str] = None                   # the training script (or module with -m); None: flags only
    script_args: list = field(default_factory=list)

    def world_flags(self) -> list:
        """The launcher flags that give the world size and node placement, in the order given."""
        out, i = [], 0
        while i < len(self.launcher):
            name = self.launcher[i].partition("=")[0]
            width = 1 if ("=" in self.launcher[i] or name not in VALUE_FLAGS) else 2
            if name in WORLD_FLAGS:
                out += self.launcher[i:i + width]
            i += width
        return out

    def has_switch(self, *names: str) -> bool:
        return any(tok in names for tok in self.launcher)


def split(argv: list) -> TorchrunLine:
    """torchrun's flags up to the first positional (the script); everything after the script is the script's.
    A line without a script (`get-training-info $DISTRIBUTED_ARGS --num-layers ...`, the older form) ends the
    launcher part at the first flag torchrun does not know: the rest are the training flags."""
    line = TorchrunLine()
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, _ = tok.partition("=")
        if name in VALUE_FLAGS:
            width = 1 if eq else 2
            line.launcher += argv[i:i + width]
            i += width
        elif tok in SWITCH_FLAGS:
            line.launcher.append(tok)
            i += 1
        elif tok.startswith("-"):
            line.script_args = list(argv[i:])
            return line
        else:
            line.script, line.script_args = tok, list(argv[i + 1:])
            return line
    return line
