"""``cpupin exec``: run a command bound to a GPU's NUMA node."""

from __future__ import annotations

import errno
import os
import sys
from types import SimpleNamespace

from cpupin import _native
from cpupin.act.binding import bind_process, device_address, read_mems_allowed
from cpupin.cli import _args
from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt
from cpupin.host._pmqos import MAX_US
from cpupin.host.launcher import CpuOrigin, explain_cpus
from cpupin.host.topology import Host
from cpupin.plan.binding import Binding, decide_binding, gpu_node, parse_cpus
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.limits import PoolLimits, cpu_plan, pool_env
from cpupin.process.mask import ENV_PROCESS_CPUS, process_cpus

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    import argparse

    from cpupin.act.wake import WakeHold


#: ``--memory``'s choices.
MEMORY_POLICIES = ("preferred", "bind", "interleave", "none")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import argparse

    cmd = sub.add_parser(
        "exec",
        help="run a command bound to a GPU's NUMA node: its CPUs within the mask, its memory",
        description="Bind to a GPU's NUMA node (CPUs within the process mask, memory policy "
        "where the kernel allows), set CPUPIN_PROCESS_CPUS, and exec the command: "
        "numactl --cpunodebind=N --preferred=N chosen from the GPU, respecting the launcher's "
        "CPU set. Name one target: --gpu, --device, --local-rank or --node (on a host "
        "without GPUs, --node), or give --cpus a CPU list. Under torchrun, put -- before "
        "cpupin (torchrun -- cpupin exec --node 0 -- CMD): torchrun's own parser would take "
        "--node for its --node-rank. Exits 127 when the command is not found, 126 when it "
        "cannot run.",
    )
    _add_target(cmd)
    cmd.add_argument(
        "--cpus",
        type=_cpus_arg,
        default="node",
        metavar="MODE",
        help="node (the default): the node's CPUs; socket: every node of its package; "
        "exclusive: the node's cores divided among its GPUs; cache: one last-level cache "
        "domain of the node a GPU; keep: move nothing; or a CPU list such as 0-7,64-71. "
        "Always within the process mask",
    )
    cmd.add_argument(
        "--memory",
        choices=MEMORY_POLICIES,
        default="preferred",
        help="the memory policy: preferred (the default) on the node; bind or interleave over "
        "the chosen nodes (the package's under --cpus socket); none",
    )
    cmd.add_argument(
        "--no-pools",
        action="store_true",
        help="leave the pool variables alone (by default OMP_NUM_THREADS, PYTHON_CPU_COUNT and "
        "the others are set to the CPUs the command can use, unless already set)",
    )
    cmd.add_argument(
        "--wake-latency",
        type=_args.whole("--wake-latency", 0, MAX_US),
        metavar="US",
        help="hold every CPU's wake latency at US µs or less exactly while the command runs "
        "(/dev/cpu_dma_latency, held by cpupin, which then waits for the command instead of "
        "becoming it, passes signals on and exits as it exits; what the command leaves running "
        "holds nothing; 0: idle CPUs poll). Root, on a host with cpuidle; cpupin doctor says "
        "whether it pays",
    )
    cmd.add_argument("--dry-run", action="store_true", help="print the binding; run nothing")
    cmd.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    _args.add_host(cmd)
    cmd.add_argument("--mask", metavar="CPULIST", help="with --dry-run: the process mask")
    cmd.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    cmd.set_defaults(handler=run)


def _add_target(cmd: argparse.ArgumentParser) -> None:
    """The one thing to bind to: a GPU, a device index, the local rank or a node."""
    target = cmd.add_mutually_exclusive_group()
    target.add_argument("--gpu", metavar="ADDR", help="the GPU's PCI address")
    target.add_argument(
        "--device",
        type=_args.whole("--device", 0, 65535),
        metavar="I",
        help="a CUDA device index, through CUDA_VISIBLE_DEVICES, in PCI order",
    )
    target.add_argument(
        "--local-rank",
        action="store_true",
        help="the device index from LOCAL_RANK (torchrun), else SLURM_LOCALID (Slurm), "
        "OMPI_COMM_WORLD_LOCAL_RANK (Open MPI) or MV2_COMM_WORLD_LOCAL_RANK (MVAPICH)",
    )
    target.add_argument("--node", type=_args.whole("--node", 0, 65535), metavar="N", help="node N")


#: exec's options that :func:`quick_args` reads, each to its attribute.
_QUICK_VALUES = {
    "--gpu": "gpu",
    "--device": "device",
    "--node": "node",
    "--cpus": "cpus",
    "--memory": "memory",
    "--wake-latency": "wake_latency",
}
_QUICK_FLAGS = {"--local-rank": "local_rank", "--no-pools": "no_pools"}
_TARGETS = ("gpu", "device", "node", "local_rank")


def quick_args(words: list[str]) -> SimpleNamespace | None:
    """exec's usual command line (``--node 0 -- CMD``, ``--local-rank
    --cpus exclusive -- CMD``, ...) read without argparse, which costs a
    worker's start about 6 ms (bench/RESULTS.md); ``None`` for anything
    else, which argparse then reads: help, ``--dry-run`` and the options
    that go with it, an option given twice or abbreviated, a value that
    starts with ``-`` or that argparse would refuse, two targets, no ``--``
    before the command. What it returns is what argparse returns for the
    same words (tests/cli/test_quick_args.py holds the two equal)."""
    got: dict[str, object] = {
        "gpu": None,
        "device": None,
        "local_rank": False,
        "node": None,
        "cpus": "node",
        "memory": "preferred",
        "no_pools": False,
        "wake_latency": None,
    }
    seen: set[str] = set()
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            break
        option, eq, value = word.partition("=")
        if option in _QUICK_FLAGS and not eq:
            name = _QUICK_FLAGS[option]
            got[name] = True
        elif option in _QUICK_VALUES:
            name = _QUICK_VALUES[option]
            if not eq:
                i += 1
                if i >= len(words):
                    return None
                value = words[i]
            parsed = _quick_value(name, value)
            if parsed is None:
                return None
            got[name] = parsed
        else:
            return None
        if name in seen:
            return None
        seen.add(name)
        i += 1
    if i >= len(words) or sum(1 for t in _TARGETS if t in seen) > 1:
        return None
    return SimpleNamespace(
        command="exec",
        handler=run,
        **got,
        dry_run=False,
        json=False,
        root=None,
        host=None,
        mask=None,
        argv=words[i:],
    )


def _quick_value(name: str, value: str) -> object:
    """An option's value as argparse's type makes it, or ``None`` where
    argparse would refuse it or read it otherwise (a leading ``-``)."""
    if not value or value.startswith("-"):
        return None
    if name == "gpu":
        return value
    if name in ("device", "node"):
        return _args.whole_number(value, 0, 65535)
    if name == "wake_latency":
        return _args.whole_number(value, 0, MAX_US)
    if name == "memory":
        return value if value in MEMORY_POLICIES else None
    try:
        parse_cpus(value)
    except ValueError:
        return None
    return value.strip()


#: Where launchers put the local rank, in the order they are read.
LOCAL_RANK_VARS = (
    ("LOCAL_RANK", "torchrun"),
    ("SLURM_LOCALID", "Slurm"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH"),
)


def _cpus_arg(text: str) -> str:
    try:
        parse_cpus(text)
    except ValueError as exc:
        raise _args.type_error(str(exc).replace("cpus=", "--cpus ", 1)) from None
    return text.strip()


def _local_rank() -> int:
    for name, _ in LOCAL_RANK_VARS:
        text = os.environ.get(name)
        if text is not None:
            body = text.strip()
            if not (body.isascii() and body.isdigit() and len(body) <= 6):
                raise ValueError(f"--local-rank: {name}={excerpt(text)} is not a device index")
            return int(body)
    names = ", ".join(f"{name} ({who})" for name, who in LOCAL_RANK_VARS)
    raise ValueError(f"--local-rank: none of {names} is set; name the GPU with --gpu or --device")


def run(args: argparse.Namespace) -> int:
    argv = _command(args)
    elsewhere = bool(args.root or args.host or args.mask is not None)
    if elsewhere and not args.dry_run:
        raise ValueError(
            "--root, --host and --mask describe another host or mask: use them with --dry-run"
        )
    _check_target(args)
    device = _device_of(args)
    if args.dry_run:
        return _dry_run(args, argv, device, elsewhere)
    return _exec(args, argv, device)


def _command(args: argparse.Namespace) -> list[str]:
    """The command to run, without the ``--`` that may open it."""
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("no command to run: cpupin exec --node 0 -- python serve.py")
    return argv


def _check_target(args: argparse.Namespace) -> None:
    """A GPU, a node or a CPU list must be named: the error says which this
    host can take."""
    listed = parse_cpus(args.cpus)[1] is not None
    if listed or args.gpu or args.device is not None or args.local_rank or args.node is not None:
        return
    host = _args.load_host(args)[0]
    example = (
        "cpupin exec --local-rank -- python serve.py"
        if host.gpus
        else "cpupin exec --node 0 -- python serve.py (this host has no GPU)"
    )
    raise ValueError(
        "name the GPU (--gpu, --device or --local-rank) or the node (--node), or give "
        f"--cpus a CPU list: {example}"
    )


def _device_of(args: argparse.Namespace) -> str | int | None:
    if args.gpu is not None:
        return args.gpu  # type: ignore[no-any-return]
    if args.device is not None:
        return args.device  # type: ignore[no-any-return]
    return _local_rank() if args.local_rank else None


def _dry_run(
    args: argparse.Namespace, argv: list[str], device: str | int | None, elsewhere: bool
) -> int:
    """What exec would do, decided and printed; nothing applied, nothing run."""
    host, _, mask = _args.load_host(args)
    mask = _args.mask_arg(args.mask, host, mask)
    address = None if device is None else device_address(host, device)
    binding = decide_binding(
        host,
        mask,
        device=address,
        node=args.node,
        cpus=args.cpus,
        memory=args.memory,
        mems_allowed=None if elsewhere else read_mems_allowed("/"),
    )
    pools = None
    if not args.no_pools:
        plan = CpuPlan.for_host(host, binding.cpus)
        pools = pool_env(plan, os.environ, host_cpus=len(host.cpus))[1]
    origin = explain_cpus(host, mask, _gpu_of(host, binding))
    if args.json:
        _args.print_json(
            {
                **binding.as_dict(),
                "pools": pools and pools.as_dict(),
                "cpus_from": origin.as_dict(),
                "wake_latency_us": args.wake_latency,
                "argv": argv,
            }
        )
        return 0
    _print_dry_run(args, argv, binding, origin, pools)
    return 0


def _print_dry_run(
    args: argparse.Namespace,
    argv: list[str],
    binding: Binding,
    origin: CpuOrigin,
    pools: PoolLimits | None,
) -> None:
    print(f"device {binding.device or '-'}, node {_or_none(binding.node)}")
    print(f"cpus   {format_cpulist(binding.cpus)} ({len(binding.cpus)} CPUs, --cpus {args.cpus})")
    memory = (
        f"{binding.memory_policy} on node {format_cpulist(binding.memory_nodes)}"
        if binding.memory_policy != "none"
        else "no policy"
    )
    print(f"memory {memory}")
    if binding.reason:
        print(f"reason {binding.reason}")
    for line in origin.lines:
        print(f"from   {line}")
    for warning in origin.warnings:
        print(f"warn   {warning}")
    print(f"pools  {pools if pools else 'left alone (--no-pools)'}")
    if args.wake_latency is not None:
        print(
            f"wake   every CPU held at {args.wake_latency} µs or less while it runs "
            "(/dev/cpu_dma_latency)"
        )
    print(f"argv   {' '.join(argv)}  (a dry run: nothing applied, nothing run)")


def _exec(args: argparse.Namespace, argv: list[str], device: str | int | None) -> int:
    """Bind this process, then become the command (exit 126 or 127 where it
    cannot run)."""
    # exec writes no record: the command it becomes is the process, and any
    # record it left would outlive the exec (the command learns its mask
    # from CPUPIN_PROCESS_CPUS instead). With --wake-latency it stays, to
    # hold the wake latency while the command runs, and its record shows
    # the hold (cpupin ps).
    from cpupin.registry import writer as registry

    registry._disabled = args.wake_latency is None
    binding = bind_process(device, node=args.node, cpus=args.cpus, memory=args.memory)
    if binding.reason:  # a GPU whose node the mask misses: what to ask the launcher for
        print(f"cpupin exec: {binding.reason}", file=sys.stderr)
    env = {**os.environ, ENV_PROCESS_CPUS: format_cpulist(process_cpus())}
    hold = None
    if args.wake_latency is not None:
        # Refused (no root, no cpuidle, a container without the device):
        # exit 2 with why, before anything runs.
        from cpupin.act.wake import hold_wake_latency

        hold = hold_wake_latency(None, args.wake_latency, mechanism="dma")
    if not args.no_pools:
        env, limits = pool_env(cpu_plan(pinned=()), env)
        for name in limits.oversubscribed:
            print(f"cpupin exec: {name} {limits.kept[name]}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if hold is None:
        _become(argv, env)
        return 127  # not reached
    return _supervise(argv, env, hold)


def _default_signals() -> None:
    # Python ignores SIGPIPE and SIGXFSZ for itself; exec keeps an ignored
    # signal ignored, so put them back as a shell would have left them
    # (`cpupin exec -- yes | head -1` ends as `yes | head -1` does). In C:
    # the signal module would cost every start 0.6 ms.
    for signum in _native.IGNORED_BY_PYTHON:
        _native.default_signal(signum)


def _become(argv: list[str], env: dict[str, str]) -> None:
    """Become the command; exit 127 (not found) or 126 (cannot run) with why."""
    _default_signals()
    try:
        _execvpe(argv, env)
    except OSError as exc:
        print(f"cpupin exec: {excerpt(argv[0])}: {exc.strerror}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def _execvpe(argv: list[str], env: dict[str, str]) -> None:
    """``os.execvpe(argv[0], argv, env)``, searching the new environment's
    PATH as it does (a name with a slash is run as it is; the first error
    other than not-found wins), without ``os.get_exec_path``, whose import
    of warnings cost every start 0.4 ms."""
    command = argv[0]
    if "/" in command:
        os.execve(command, argv, env)
    first: OSError | None = None
    last: OSError = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
    for folder in env.get("PATH", os.defpath).split(os.pathsep):
        try:
            os.execve(os.path.join(folder, command), argv, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last = exc
        except OSError as exc:
            last = exc
            first = first or exc
    raise first or last


#: The signals a supervising exec passes on to the command (a terminal's
#: SIGINT and SIGQUIT reach both through the process group).
FORWARDED = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGWINCH", "SIGALRM")


def _supervise(argv: list[str], env: dict[str, str], hold: WakeHold) -> int:
    """Run the command as a child and hold the wake latency exactly as long
    as it runs: the request's descriptor stays in this process only
    (close-on-exec, so nothing the command starts inherits it), and closes
    when the command exits, however it exits; a descendant it leaves behind
    (a daemon) holds nothing. Signals sent to this process go to the
    command; its exit status, or the signal that ended it, is this
    process's. Killed with SIGKILL, this process's descriptor closes too:
    the hold ends, and the command runs on without it."""
    import signal

    pid = os.fork()
    if pid == 0:
        _become(argv, env)
    for name in ("SIGINT", "SIGQUIT"):  # the terminal's: the command's to act on
        signal.signal(getattr(signal, name), signal.SIG_IGN)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), forward)
    try:
        _, status = os.waitpid(pid, 0)  # resumed after each forwarded signal (PEP 475)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler a plugin set)
        status = 0
    hold.release()
    if os.WIFSIGNALED(status):
        from cpupin.registry import writer as registry

        registry._remove_at_exit()
        sig = os.WTERMSIG(status)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP keep their default anyway
        os.kill(os.getpid(), sig)  # die of it, as the command did
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _gpu_of(host: Host, binding: Binding) -> list[tuple[str, int | None]]:
    """The binding's GPU and its node, for the launcher's warning."""
    if binding.device is None:
        return []
    return [(binding.device, gpu_node(host, binding.device)[0])]


def _or_none(value: object) -> str:
    return "none" if value is None else str(value)
