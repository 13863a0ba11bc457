"""Profiling launcher: run a few real Megatron iterations with the tracing allocator, one trace per rank.

    python -m tracer.profile [--cpu] [--nproc N] [--out DIR] [--iterations N] [--balanced-routing] [--crosscheck]
                             [--fake-world N [--ranks R,R...]] [--target harness|PATH/TO/pretrain_gpt.py]
                             [--] <Megatron-LM flags>

GPU: run it under torchrun (`torchrun $DISTRIBUTED_ARGS -m tracer.profile ...`); started without torchrun it
re-launches itself through torch.distributed.run with the torchrun flags found on its command line.
`profile-training-info` (tracer/launch.py) builds that torchrun command from a launch script's torchrun line.
`--cpu`: spawns N gloo processes itself (N = --nproc, else --nproc_per_node, else 1).
`--balanced-routing`: MoE routers send every expert the same number of tokens (tracer/moe_routing.py), so MoE
buffers depend on the config's shapes only; the fit campaign profiles MoE configs this way.
`--crosscheck` (with --cpu): also measure every rank's peak independently of the tracer, from torch.profiler's
memory events with c10's process-wide CPU memory accounting on (see `Crosscheck`); the header gets
`crosscheck_peak_bytes` next to `allocator_peak_bytes`.
`--fake-world N`: trace ranks of a world of N one at a time, each alone in its own process on torch's fake process
group (tracer/fake_world.py: collectives move no data; what a real backend holds beyond their outputs is not
traced): one CPU, or one GPU, serves any layout. `--ranks R,R...` picks the ranks (default: the first, a middle
and the last pipeline stage of the first pipeline group).
Each rank writes `<out>/rank<R>.trace`, `.names` and `.json` (docs/FORMATS.md 2.4).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

USAGE = ("usage: python -m tracer.profile [--cpu] [--nproc N] [--out DIR] [--iterations N] [--balanced-routing] "
         "[--crosscheck] [--fake-world N [--ranks R,R...]] [--target harness|PATH/TO/pretrain_gpt.py] [--] "
         "<Megatron-LM flags>")
_TORCHRUN = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
             "--master_addr", "--master-addr", "--master_port", "--master-port"}
_WORKER_ENV = "MEMTRACE_WORKER"


class UsageError(ValueError):
    """Bad launcher options; printed as one line, exit code 2."""


class _Help(Exception):
    pass


@dataclass
class Options:
    cpu: bool = False
    balanced_routing: bool = False
    gpu_kernels: bool = False      # CPU: GPU kernel stand-ins (tracer.standins); a GPU run always has its kernels
    crosscheck: bool = False
    nproc: int | None = None
    out: str = "memtrace_out"
    iterations: int = 3
    target: str = "harness"
    fake_world: int | None = None   # trace ranks of a world this size on torch's fake process group
    ranks: list | None = None       # which ranks (--ranks); None: tracer.fake_world.pipeline_ranks
    flags: list = field(default_factory=list)   # the Megatron-LM (and torchrun) flags

    @property
    def is_harness(self) -> bool:
        return self.target == "harness"


def parse_options(argv: list[str]) -> Options:
    """Launcher options anywhere before `--`; everything else (and all after `--`) is Megatron's."""
    opts = Options()
    rest: list[str] = []
    i, argv = 0, list(argv)
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--":
            rest.extend(argv[i:])
            break
        name, eq, inline = tok.partition("=")
        if name == "--cpu":
            opts.cpu = True
            continue
        if name == "--balanced-routing":
            opts.balanced_routing = True
            continue
        if name == "--crosscheck":
            opts.crosscheck = True
            continue
        if name == "--gpu-kernels":
            opts.gpu_kernels = True
            continue
        if name in ("--nproc", "--out", "--iterations", "--target", "--fake-world", "--ranks"):
            if eq:
                val = inline
            elif i < len(argv):
                val, i = argv[i], i + 1
            else:
                raise UsageError(f"argument {name}: expected one argument")
            if name == "--ranks":
                try:
                    opts.ranks = sorted({int(r) for r in val.split(",")})
                except ValueError:
                    raise UsageError(f"argument --ranks: expected ranks separated by commas, got {val!r}") from None
                if opts.ranks[0] < 0:
                    raise UsageError(f"argument --ranks: a rank is >= 0, got {opts.ranks[0]}")
            elif name in ("--nproc", "--iterations", "--fake-world"):
                try:
                    num = int(val)
                except ValueError:
                    raise UsageError(f"argument {name}: invalid int value: {val!r}") from None
                if num < 1:
                    raise UsageError(f"argument {name}: must be >= 1, got {num}")
                setattr(opts, name[2:].replace("-", "_"), num)
            else:
                setattr(opts, name[2:], val)
            continue
        if name in ("-h", "--help"):
            raise _Help()
        rest.append(tok)
    if opts.crosscheck and not opts.cpu:
        raise UsageError("--crosscheck needs --cpu (it reads c10's CPU allocator accounting)")
    if opts.ranks is not None and opts.fake_world is None:
        raise UsageError("--ranks needs --fake-world N (the ranks of which world?)")
    if opts.fake_world is not None and opts.ranks and opts.ranks[-1] >= opts.fake_world:
        raise UsageError(f"--ranks: rank {opts.ranks[-1]} is outside a world of {opts.fake_world}")
    if opts.fake_world is not None and not opts.is_harness:
        raise UsageError("--fake-world runs the built-in harness (--target harness)")
    if not opts.is_harness and not os.path.isfile(opts.target):
        raise UsageError(f"--target {opts.target}: no such file (give 'harness' or a path to pretrain_gpt.py)")
    opts.flags = rest
    return opts


def _flag_value(flags: list[str], names) -> str | None:
    for i, tok in enumerate(flags):
        name, eq, inline = tok.partition("=")
        if name in names:
            return inline if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return None


def strip_flags(flags: list[str], names, with_value: bool = True) -> list[str]:
    """`flags` without the given flags (and their values)."""
    out, i = [], 0
    while i < len(flags):
        name, eq, _ = flags[i].partition("=")
        if name in names:
            i += 1 if (eq or not with_value) else 2
            continue
        out.append(flags[i])
        i += 1
    return out


def world_size(opts: Options) -> int:
    """Processes to run: --fake-world, --nproc, else torchrun's --nproc_per_node x --nnodes, else $WORLD_SIZE,
    else 1."""
    if opts.fake_world:
        return opts.fake_world
    if opts.nproc:
        return opts.nproc
    per = _flag_value(opts.flags, {"--nproc_per_node", "--nproc-per-node"})
    nodes = _flag_value(opts.flags, {"--nnodes"})
    if per is not None:
        try:
            return int(per) * (max(int(p) for p in nodes.split(":")) if nodes else 1)
        except ValueError:
            raise UsageError(f"argument --nproc_per_node: invalid int value: {per!r}") from None
    return int(os.environ.get("WORLD_SIZE", "1"))


def config_argv(opts: Options, world: int) -> list[str]:
    """The flags the estimator's parser sees: the user's, with the actual world size as torchrun's flags (and, in a
    fake world, no gloo copies of the data-parallel groups: tracer.fake_world)."""
    flags = strip_flags(opts.flags, _TORCHRUN)
    if opts.fake_world and "--disable-gloo-process-groups" not in flags:
        flags = flags + ["--disable-gloo-process-groups"]
    return ["--nproc_per_node", str(world), "--nnodes", "1"] + flags


def load_config(opts: Options, world: int):
    from estimator.args import ConfigError, parse_args
    try:
        cfg = parse_args(config_argv(opts, world))
        if opts.is_harness:
            from tracer.harness import extra_flags
            extra_flags(cfg.ignored_args)   # --lr, --seed, ... that only the harness reads
        return cfg
    except (ConfigError, ValueError) as e:
        if opts.is_harness:
            raise UsageError(str(e)) from None
        print(f"tracer.profile: warning: the estimator cannot describe this config ({e}); "
              "its header will carry no config", file=sys.stderr)
        return None


def pretrain_argv(script: str, flags: list[str], iterations: int) -> list[str]:
    """sys.argv for a user's pretrain_gpt.py: torchrun flags dropped, --train-iters forced to `iterations`,
    no checkpoint saving and no evaluation (they would pollute the trace and write to the user's disk)."""
    flags = strip_flags(flags, _TORCHRUN)
    flags = strip_flags(flags, {"--train-iters", "--save", "--save-interval", "--eval-iters", "--eval-interval",
                                "--exit-interval", "--train-samples"})
    flags = strip_flags(flags, {"--use-pytorch-profiler", "--profile"}, with_value=False)
    return [script, *flags, "--train-iters", str(iterations), "--eval-iters", "0",
            "--eval-interval", str(10 ** 9)]


# ---- header ------------------------------------------------------------------------------------------------

def versions() -> dict:
    import torch
    try:
        from megatron.core import package_info
        mc = package_info.__version__
    except ImportError:
        mc = None
    return {"torch": torch.__version__, "megatron_core": mc, "python": platform.python_version()}


def write_header(path: str, header: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(header, f, indent=1, default=str)
    os.replace(tmp, path)   # atomic: a reader never sees half a header


def _coords_or_none():
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            from tracer.harness import coords
            return coords()
    except Exception:   # a user's script may not initialise megatron-core's parallel_state at all
        pass
    return None


# ---- memory reporting under the pluggable allocator ---------------------------------------------------------

def patch_memory_reporting() -> None:
    """torch.cuda.memory_allocated & co. raise under CUDAPluggableAllocator: answer from the tracer's counters.
    (There is no cache, so reserved == allocated.) cudnn.benchmark needs cacheInfo: keep it off."""
    import torch
    from tracer import allocator

    def stats(device=None):
        live, peak = allocator.live_bytes(), allocator.peak_bytes()
        return {"allocated_bytes.all.current": live, "allocated_bytes.all.peak": peak,
                "reserved_bytes.all.current": live, "reserved_bytes.all.peak": peak,
                "active_bytes.all.current": live, "active_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    fns = {"memory_allocated": lambda device=None: allocator.live_bytes(),
           "max_memory_allocated": lambda device=None: allocator.peak_bytes(),
           "memory_reserved": lambda device=None: allocator.live_bytes(),
           "max_memory_reserved": lambda device=None: allocator.peak_bytes(),
           "memory_stats": stats,
           "reset_peak_memory_stats": lambda device=None: allocator.reset_peak(),
           "reset_max_memory_allocated": lambda device=None: allocator.reset_peak()}
    for mod in (torch.cuda, torch.cuda.memory):
        for name, fn in fns.items():
            setattr(mod, name, fn)
    torch.backends.cudnn.benchmark = False


# ---- independent cross-check of the peak (CPU) -------------------------------------------------------------

class Crosscheck:
    """Every CPU rank's peak measured a second way, independently of the tracer: torch.profiler's memory events
    with c10's process-wide CPU memory accounting on.

    c10's DefaultCPUAllocator (the allocator the tracer's hook wraps and delegates to) reports each allocation and
    free to its ProfiledCPUMemoryReporter. With the c10 flag `caffe2_report_cpu_memory_usage` set, that reporter
    keeps a size map and a running total of live bytes for every thread (autograd, gloo workers), counting the
    blocks allocated after the flag was set. torch has no Python setter for c10 flags: the flag is the exported
    global `FLAGS_caffe2_report_cpu_memory_usage` of libc10.so (a C++ bool), set here through ctypes. With
    `profile_memory=True` the profiler records one event per allocation and free made on a thread it profiles
    (the main thread, and autograd threads, which inherit its state), carrying the size delta and c10's
    process-wide total right after it; a free on a thread it does not profile (gloo's workers) makes no event but
    shows in the next event's total.

    Window: the flag is set right after the tracer's hook is installed, with no allocation in between, so c10's
    total counts exactly the blocks the tracer counts; the profiler starts right after that and stops right
    before the trace is closed. Peak: the largest process-wide total over the events (live bytes rise only at
    allocations, so the peak follows an allocation; if that allocation ran on a thread the profiler does not see,
    the cross-check reads low). Also reported: the peak of a plain replay of the events' deltas from the first
    event's level (what the profiler alone would say), and the net bytes that changed on unprofiled threads.
    Measured (megatron-core 0.16.1, torch 2.13.0 CPU, the 55 ranks of benchmarks/accuracy_random.py): the peak
    equals the tracer's to the byte on every rank; the plain replay reads high on 42 of them, by up to 4.0 MB
    (10.6%: gloo frees collective buffers on its own threads); without the flag the profiler's totals read high
    the same way (a TP-2 + SP run: +5.8% and +1.9%).
    """

    FLAG = "FLAGS_caffe2_report_cpu_memory_usage"
    METHOD = ("torch.profiler memory events (profile_memory=True, CPU) with c10 caffe2_report_cpu_memory_usage on: "
              "max of c10's process-wide live total over the events")

    def __init__(self):
        self.prof = None

    @classmethod
    def set_c10_flag(cls, value: bool = True) -> None:
        import ctypes

        import torch
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, cls.FLAG).value = value

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()

    def events(self) -> list[tuple[int, int, int, int]]:
        """(time ns, bytes delta, c10 process-wide total after it, thread id) per CPU memory event, by time."""
        from torch._C._profiler import _EventType
        out, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                x = e.extra_fields
                out.append((e.start_time_ns, int(x.alloc_size), int(x.total_allocated), int(e.start_tid)))
        out.sort()
        return out

    def header(self) -> dict:
        ev = self.events()
        if not ev:
            return {"crosscheck_method": self.METHOD, "crosscheck_events": 0}
        level = ev[0][2] - ev[0][1]
        replay_peak = level
        for _, delta, _, _ in ev:
            level += delta
            replay_peak = max(replay_peak, level)
        return {"crosscheck_peak_bytes": max(e[2] for e in ev), "crosscheck_method": self.METHOD,
                "crosscheck_events": len(ev), "crosscheck_threads": len({e[3] for e in ev}),
                "crosscheck_replay_peak_bytes": replay_peak,
                "crosscheck_unprofiled_net_bytes": ev[-1][2] - level}


# ---- one rank ----------------------------------------------------------------------------------------------

def _install_tracing(prefix: str, cpu: bool, crosscheck: Crosscheck | None = None, fake: bool = False) -> str:
    """Open the trace and route allocations into it before anything else allocates. Returns the backend.
    With a Crosscheck (CPU), c10's accounting starts right after the hook and the profiler right after that."""
    from tracer import allocator
    if fake:    # before megatron-core binds the collectives, and before the gloo compat layer wraps them
        from tracer import fake_world
        fake_world.install()
    if cpu:
        from tracer import cpu_hook, megatron_compat
        cpu_hook.install(prefix)
        if crosscheck is not None:
            Crosscheck.set_c10_flag(True)   # same window as the tracer: nothing allocated since the hook
            crosscheck.start()
        megatron_compat.install()
        return "cpu-hook"
    allocator.open_trace(prefix, "cuda")
    allocator.install_cuda_allocator()   # before the first CUDA allocation of the process
    patch_memory_reporting()
    import torch
    # This rank's GPU before the first mark: its cudaMemGetInfo reading would otherwise create a context on GPU 0.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return "cuda"


def _init_distributed(cpu: bool, rank: int, world: int, fake: bool = False) -> None:
    import datetime

    import torch
    if torch.distributed.is_initialized():
        return
    if fake:
        from tracer import fake_world
        if not cpu:
            torch.cuda.set_device(0)
        fake_world.init(rank, world)
        return
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
    torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(minutes=10))


def _run_pretrain(opts: Options, on_setup, on_iteration_end) -> None:
    """runpy a user's pretrain_gpt.py with iteration/optimizer scopes attached to megatron.training."""
    import runpy

    from tracer import scopes
    script = os.path.abspath(opts.target)
    if os.path.dirname(script) not in sys.path:
        sys.path.insert(0, os.path.dirname(script))
    try:
        from megatron.training import training
    except ImportError as e:
        raise RuntimeError(f"--target {opts.target}: cannot import megatron.training next to it ({e}); "
                           "point --target at pretrain_gpt.py inside a Megatron-LM checkout") from e

    orig_setup, orig_step = training.setup_model_and_optimizer, training.train_step
    counter = [0]

    def setup_model_and_optimizer(*args, **kwargs):
        out = orig_setup(*args, **kwargs)
        scopes.wrap_optimizer(out[1])
        scopes.mark("setup_done")
        on_setup()
        return out

    def train_step(*args, **kwargs):
        i = counter[0]
        scopes.new_iteration()
        with scopes.scope(f"iter:{i}"):
            out = orig_step(*args, **kwargs)
        scopes.mark(f"iter_end:{i}")
        counter[0] += 1
        on_iteration_end(i)
        return out

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    saved_argv = sys.argv
    sys.argv = pretrain_argv(script, opts.flags, opts.iterations)
    if opts.cpu and "--distributed-backend" not in sys.argv:
        sys.argv += ["--distributed-backend", "gloo"]   # experimental: Megatron-LM's training loop wants CUDA
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:   # Megatron exits on its own after the last iteration in some versions
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = saved_argv


def worker(opts: Options) -> int:
    """One rank: trace, compat layer (CPU), distributed init, the target, the header."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.makedirs(opts.out, exist_ok=True)
    prefix = os.path.join(opts.out, f"rank{rank}")
    cpu = opts.cpu
    if not opts.is_harness:
        # The checkout's `megatron` package must win over an installed megatron-core: put it first, before
        # anything here imports megatron.
        sys.path.insert(0, os.path.dirname(os.path.abspath(opts.target)))
    xc = Crosscheck() if (opts.crosscheck and cpu) else None
    fake = opts.fake_world is not None
    backend = _install_tracing(prefix, cpu, xc, fake)

    import torch
    from tracer import allocator, scopes
    cfg = load_config(opts, world)
    header = {"format": "megatron-memtrace", "version": 1, "rank": rank, "world_size": world, "coords": None,
              "config": cfg.to_dict() if cfg is not None else None, "argv": list(opts.flags),
              "device": "cpu" if cpu else torch.cuda.get_device_name(),
              **({"cpu_capability": torch.backends.cpu.get_cpu_capability()} if cpu else {}),
              "backend": backend, "versions": versions(), "iterations": opts.iterations,
              "target": "harness" if opts.is_harness else "pretrain_gpt",
              "routing": "balanced" if opts.balanced_routing else "model",
              "process_group": "fake" if fake else ("gloo" if cpu else "nccl")}
    hpath = prefix + ".json"
    write_header(hpath, header)
    scopes.enable()
    allocator.mark("start")
    status = 0
    try:
        if opts.is_harness:
            _init_distributed(cpu, rank, world, fake)   # a pretrain_gpt.py initialises its own (Megatron's options)
        scopes.attach_module_hooks()
        scopes.patch_megatron()
        if opts.balanced_routing:
            from tracer import moe_routing
            moe_routing.install()

        def on_setup(result=None):
            header["coords"] = _coords_or_none()
            write_header(hpath, header)

        if opts.is_harness:
            from tracer import harness
            res = harness.run(cfg, opts.iterations, on_setup=on_setup,
                              gpu_kernels=opts.gpu_kernels or not cpu)
            header.update(losses=res.losses, iteration_seconds=res.iteration_seconds,
                          skipped_iterations=res.skipped_iterations, kernels=res.kernels)
        else:
            _run_pretrain(opts, on_setup, lambda i: allocator.flush())
    except BaseException as e:
        status = 1
        header["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
    finally:
        scopes.enable(False)
        header["coords"] = header["coords"] or _coords_or_none()
        if xc is not None:
            xc.stop()   # the last thing before the trace closes: both windows end here
        # Close first: gloo threads can still allocate until tracing stops, and the header's counters must describe
        # the same events as the file (the counters stop with the trace and reset only at the next open).
        allocator.close()
        header["allocator_peak_bytes"] = allocator.peak_bytes()
        header["allocator_live_bytes"] = allocator.live_bytes()
        if xc is not None:
            try:
                header.update(xc.header())
            except Exception as e:   # the trace itself is fine: say why the cross-check is missing
                header["crosscheck_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        write_header(hpath, header)
    if status == 0 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return status


# ---- launchers ---------------------------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port for the rendezvous. Drawn at random below the kernel's ephemeral range: launchers started at
    the same moment that each ask the kernel for port 0 can be handed the same just-released port (seen: three
    profiles started together all got one port, and two failed with EADDRINUSE)."""
    import random
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(one_thread: bool, **rank_vars) -> dict:
    """A worker process's environment: its rank variables, this package on the path, and on CPU one thread (N
    ranks share the cores; a fake world's rank runs as its gloo twin does, whose kernels' per-thread buffers, a
    CPU layer norm's backward, then have the same size)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **{k: str(v) for k, v in rank_vars.items()}, **{_WORKER_ENV: "1"})
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    if one_thread:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn_cpu(opts: Options, argv: list[str], world: int) -> int:
    """Start `world` gloo worker processes of this module and wait; if one fails, stop the rest."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = _worker_env(True, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "tracer.profile", *argv], env=env))
    rc = 0
    while procs:
        for p in list(procs):
            code = p.poll()
            if code is None:
                continue
            procs.remove(p)
            if code != 0 and rc == 0:
                rc = code
                for q in procs:   # a dead peer would leave the others blocked in a collective
                    q.terminate()
        time.sleep(0.05)
    return rc


def relaunch_torchrun(opts: Options, argv: list[str]) -> int:
    """Not under torchrun on a GPU machine: re-run this module through torch.distributed.run."""
    tr = []
    for names, flag in ((("--nproc_per_node", "--nproc-per-node"), "--nproc_per_node"), (("--nnodes",), "--nnodes"),
                        (("--node_rank", "--node-rank"), "--node_rank"),
                        (("--master_addr", "--master-addr"), "--master_addr"),
                        (("--master_port", "--master-port"), "--master_port")):
        val = _flag_value(opts.flags, set(names))
        if val is not None:
            tr += [flag, val]
    if opts.nproc and "--nproc_per_node" not in tr:
        tr += ["--nproc_per_node", str(opts.nproc)]
    rest = strip_flags(argv, _TORCHRUN)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *tr, "-m", "tracer.profile", *rest])


def spawn_fake(opts: Options, argv: list[str], world: int, ranks: list) -> int:
    """Each rank of the fake world in its own worker process, one after another (each alone: a fresh trace)."""
    rc = 0
    for rank in ranks:
        env = _worker_env(opts.cpu, RANK=rank, LOCAL_RANK=0, WORLD_SIZE=world, LOCAL_WORLD_SIZE=1)
        code = subprocess.call([sys.executable, "-m", "tracer.profile", *argv], env=env)
        rc = rc or code
    return rc


def summarize(out: str, world: int, ranks: list | None = None) -> None:
    for r in (range(world) if ranks is None else ranks):
        path = os.path.join(out, f"rank{r}.json")
        try:
            with open(path) as f:
                h = json.load(f)
        except (OSError, ValueError):
            print(f"rank {r}: no header at {path}")
            continue
        peak, losses = h.get("allocator_peak_bytes"), h.get("losses") or []
        line = f"rank {r} coords={h.get('coords')}"
        line += f" peak={peak / 2**20:.2f} MiB" if peak is not None else " (no peak: the run did not finish)"
        xpeak = h.get("crosscheck_peak_bytes")
        if xpeak is not None and peak:
            line += f" crosscheck={xpeak / 2**20:.2f} MiB ({100.0 * (xpeak - peak) / peak:+.4f}%)"
        elif h.get("crosscheck_error"):
            line += f" crosscheck failed: {h['crosscheck_error']}"
        if any(x is not None for x in losses):
            line += f" losses={[round(x, 4) for x in losses if x is not None]}"
        if h.get("error"):
            line += f" FAILED: {h['error']}"
        print(line)
    print(f"traces in {out}/rank<R>.trace/.names/.json")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts = parse_options(argv)
        if os.environ.get(_WORKER_ENV) == "1" or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
            return worker(opts)
        world = world_size(opts)
        if opts.fake_world:
            cfg = load_config(opts, world)     # fail fast, with the estimator's message
            from tracer import fake_world
            ranks = opts.ranks or fake_world.pipeline_ranks(cfg)
            if not opts.cpu:
                import torch
                if not torch.cuda.is_available():
                    raise UsageError("no CUDA device here: pass --cpu to profile on CPU")
            rc = spawn_fake(opts, argv, world, ranks)
            summarize(opts.out, world, ranks)
            return rc
        if opts.cpu:
            load_config(opts, world)     # fail fast, with the estimator's message, before spawning anything
            rc = spawn_cpu(opts, argv, world)
            summarize(opts.out, world)
            return rc
        import torch
        if not torch.cuda.is_available():
            raise UsageError("no CUDA device here: pass --cpu to profile on CPU with gloo")
        if world == 1:
            # One GPU: be the rank ourselves instead of starting torchrun and a worker (two more interpreter and
            # torch starts, seconds per config of a GPU campaign). is_available() created no CUDA context, so
            # the tracing allocator can still be installed first.
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            rc = worker(opts)
            summarize(opts.out, 1)
            return rc
        return relaunch_torchrun(opts, argv)
    except _Help:
        print(USAGE + "\n" + (__doc__ or "").split("\n\n", 2)[-1].strip())
        return 0
    except UsageError as e:
        print(f"tracer.profile: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
