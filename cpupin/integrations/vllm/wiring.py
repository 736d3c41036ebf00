"""The vLLM plugin's wiring: what it does in each process vLLM starts (see
:mod:`cpupin.integrations.vllm` for the modes), the wrappers it puts
around vLLM's classes, and the thread that publishes the step figures.
Every decision is :mod:`~cpupin.integrations.vllm.decisions`'; nothing here
ever raises into vLLM."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cpupin.cpulist import format_cpulist, parse_cpulist
from cpupin.integrations.vllm.decisions import (
    ENV_MASK,
    ENV_OMP_PLAN,
    ENV_SERVER,
    VLLM_BIND,
    VLLM_SIZED,
    WIDEN_AFTER,
    Confinement,
    avoid_teams,
    bound_lists,
    cap_lists,
    env_warnings,
    host_pressure,
    mode_from_env,
    model_name_of,
    next_confinement,
    omp_cpus,
    omp_plan,
    quota_cpus,
    role_of,
    threads_to_move,
)

__all__ = ["register"]

#: Under vLLM's own logger, so that each decision is a line of vLLM's log
#: (in its format, with the process's name), which it shows at INFO.
log = logging.getLogger("vllm.cpupin")


_started = False
_state: dict[str, Any] = {}
_notes: list[str] = []


def register() -> None:
    """The entry point vLLM calls in each process; never raises."""
    global _started
    if _started:
        return
    _started = True
    try:
        _register()
    except Exception as exc:  # noqa: BLE001 - a helper never takes vLLM down
        log.warning("cpupin: the vLLM plugin stands aside: %s", exc, exc_info=True)


def _title() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read(256).split(b"\0")[0].decode("utf-8", "replace")
    except OSError:
        return ""


def _main_module() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") or ""


def _register() -> None:
    import multiprocessing

    mode, _ = mode_from_env(os.environ)
    role = role_of(_title(), multiprocessing.current_process().name, _main_module(), sys.argv)
    if mode != "off" and role is not None and _server_of(os.environ) is None:
        # The server's first process says it once; its children inherit
        # the same values (and a helper says nothing).
        _warn_env()
    if mode == "off":
        return
    if role is None:
        return  # a helper process: nothing to record, nothing to time
    _state.update(mode=mode, role=role)
    _note(f"cpupin {mode} in the {role[5:].replace('-', ' ')} (pid {os.getpid()})")
    if role == "vllm-api-server":
        _own_members()
        _fit_quota(act=mode == "auto")
        os.environ.setdefault(ENV_MASK, format_cpulist(_launcher_mask()))
        if mode == "auto":
            _hold_server_cpus()
        _drop_our_pool_vars()
        _export_metrics()
    if role in ("vllm-engine-core", "vllm-worker"):
        _wrap_execute_model()
        if mode == "auto" and _on_gpus():
            if role == "vllm-worker":
                _wrap_init_device()
            else:
                _bind_engine_core()
    if role == "vllm-engine-core":
        _wrap_omp_manager(mode)
    if role == "vllm-worker":
        _start_publisher(mode)
    _publish()


def _warn_env() -> None:
    from cpupin import _native

    for line in env_warnings(os.environ, _native.online_cpus()):
        _say(logging.WARNING, line)


def _reset_after_fork() -> None:
    """A process forked from one of the server's (vLLM's default start
    method on Linux, where no CUDA context exists yet) is a process of its
    own: it forgets the parent's role, notes and state. vLLM would not load
    its plugins there again (its own flag, inherited, says they are loaded),
    so the flag is cleared too, where the parent loaded cpupin: the child's
    ``EngineCore.__init__`` or ``init_worker`` then loads the plugins as in a
    spawned process (vLLM asks every plugin to bear a load in each process),
    and the plugin finds the child's own role from its title or name."""
    global _started
    if not _started:
        return
    _started = False
    _state.clear()
    _notes.clear()
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and getattr(plugins, "plugins_loaded", False) is True:
        setattr(plugins, "plugins_loaded", False)  # noqa: B010 - a module mypy cannot see


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _note(line: str) -> None:
    _say(logging.INFO, line)
    _notes.append(line)
    del _notes[:-16]


# Lines said before vLLM configured its logging (the API server loads the
# plugins while it parses its arguments, and configures logging after):
# said again, in vLLM's format, once it has.
_pending: list[tuple[int, str]] = []


def _say(level: int, line: str) -> None:
    """A line of vLLM's log, now if vLLM's logger has somewhere to write,
    else as soon as vLLM configures it (or at exit)."""
    if _logging_ready():
        log.log(level, "cpupin: %s", line)
        return
    if not _state.get("logging_hooked"):
        _state["logging_hooked"] = True
        _hook_vllm_logging()
    _pending.append((level, line))
    del _pending[:-64]


def _logging_ready() -> bool:
    return bool(logging.getLogger("vllm").handlers or logging.getLogger().handlers)


def _hook_vllm_logging() -> None:
    """Say the pending lines right after vLLM configures its logging, and at
    exit whatever is still pending."""
    import atexit

    atexit.register(_flush_pending, True)
    try:
        import vllm.logger as vllm_logger
    except ImportError:
        return
    original = getattr(vllm_logger, "_configure_vllm_root_logger", None)
    if original is None or getattr(original, "cpupin_wrapper", False):
        return

    def configure(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            _flush_pending(False)

    configure.cpupin_wrapper = True  # type: ignore[attr-defined]
    vllm_logger._configure_vllm_root_logger = configure


def _flush_pending(at_exit: bool) -> None:
    if not (_logging_ready() or at_exit):
        return
    lines, _pending[:] = list(_pending), []
    for level, line in lines:
        log.log(level, "cpupin: %s", line)


def _publish(steps: list[dict[str, Any]] | None = None) -> None:
    from cpupin.registry import writer as registry

    registry.describe_process(
        role=_state["role"],
        notes=_notes,
        steps=steps,
        server=_server_of(os.environ),
        auto=_acts(),
    )


def _acts() -> dict[str, Any] | None:
    """What ``auto`` did in this process, for its record (and so for the
    metrics): the threads it moved, where they are confined (nothing once
    widened), and whether it widened them; ``None`` before it did anything."""
    moved = _state.get("moved_total")
    if moved is None:
        return None
    watch = _state.get("watch")
    widened = bool(watch and watch["state"].widened)
    confined = frozenset() if widened else _state.get("confined", frozenset())
    return {"moved": moved, "confined": confined, "widened": widened}


def _server_of(environ: Mapping[str, str]) -> tuple[int, int] | None:
    pid, _, start = environ.get(ENV_SERVER, "").partition("-")
    if pid.isdigit() and start.isdigit() and len(pid) < 8 and len(start) < 20:
        return int(pid), int(start)
    return None


def _own_members() -> None:
    """Name this API server in its children's records, and remove those
    that vLLM's shutdown leaves behind, at exit."""
    import atexit

    from cpupin.host._proc import own_start
    from cpupin.registry.prune import prune_members

    me = (os.getpid(), own_start())
    os.environ[ENV_SERVER] = f"{me[0]}-{me[1]}"

    def prune() -> None:
        # A group stopped by one signal: its members may end a moment after.
        for path in prune_members(me, wait_s=5.0):
            log.debug("cpupin: removed %s, the record of a process vLLM killed", path)

    atexit.register(prune)


def _launcher_mask() -> frozenset[int]:
    """The CPUs the launcher gave the server: the API server's
    :data:`ENV_MASK`, else this process's mask as cpupin recorded it, else
    the cgroup's cpuset within the online CPUs."""
    from cpupin import _native
    from cpupin.process.mask import process_cpus

    text = os.environ.get(ENV_MASK)
    if text:
        try:
            return parse_cpulist(text)
        except ValueError:
            pass
    if _state.get("role") == "vllm-api-server":
        return process_cpus()
    from cpupin.host.cgroup import read_cgroup_cpuset

    online = _native.online_cpus()
    return (read_cgroup_cpuset("/") or online) & online


def _fit_quota(root: str = "/", *, act: bool = True) -> None:
    """In the API server, before any child starts: where the cgroup's quota
    allows fewer CPUs than the mask holds, confine the server (every thread
    of this process, and so every process it starts) to
    :func:`quota_cpus`, so that vLLM plans its OpenMP CPUs and reserves
    within them; ``act=False`` (observe) only says so. Never raises."""
    from cpupin import _native
    from cpupin.pools.limits import cpu_plan
    from cpupin.process.mask import set_process_cpus, thread_masks

    try:
        launcher = _launcher_mask()
        plan = cpu_plan(root=root, mask=launcher)
        if plan.quota is None or plan.capacity >= len(plan.mask):
            return
        from cpupin.host.topology import read_host

        keep = quota_cpus(plan.mask, plan.capacity, read_host(root))
        quota = plan.quota
        if keep == plan.mask or quota is None:
            return
        if not act:
            _note(
                f"a quota of {quota.quota_us / quota.period_us:g} CPU over CPUs "
                f"{format_cpulist(plan.mask)}: the server's processes run side by side until "
                f"it is spent, then every step stalls; CPUPIN_VLLM=auto confines the server to "
                f"CPU {format_cpulist(keep)}"
            )
            return
        for st, _ in thread_masks(None):
            try:
                _native.set_affinity(keep, st.tid)
            except ProcessLookupError:
                continue
        set_process_cpus(keep)
    except (OSError, ValueError) as exc:
        _note(f"server not confined to its quota: {exc}")
        return
    os.environ[ENV_MASK] = format_cpulist(keep)
    _note(
        f"server confined to CPU {format_cpulist(keep)} of {format_cpulist(plan.mask)}: its "
        f"quota ({quota.quota_us / quota.period_us:g} CPU) would throttle processes that "
        "run side by side; confined, they take turns"
    )


def _hold_server_cpus() -> None:
    """On vLLM-CPU, where ``CPUPIN_WAKE_LATENCY_US`` asks for it: hold the
    wake latency of the CPUs the whole server runs on (the launcher's mask,
    after the quota fit), from the API server, for its lifetime. Every
    handoff between the server's processes and threads then meets a CPU that
    polls instead of one that sleeps. On CUDA hosts the mask may be the
    whole host: there each worker's plan holds its step CPUs instead
    (:func:`_pin_step_on_gpu`). Never raises; a refusal is a note."""
    from cpupin.act.server import ENV_WAKE_LATENCY, wake_latency_from_env
    from cpupin.act.wake import HoldRefused, hold_wake_latency

    try:
        bound = wake_latency_from_env(os.environ)
    except ValueError as exc:
        _note(f"wake latency not held: {exc}")
        return
    if bound is None:
        return
    if _on_gpus():
        _note(f"{ENV_WAKE_LATENCY}: each GPU worker holds its step CPUs (not the whole mask)")
        return
    cpus = _launcher_mask()
    try:
        hold = hold_wake_latency(cpus, bound)
    except (HoldRefused, ValueError) as exc:
        _note(f"wake latency of CPU {format_cpulist(cpus)} not held: {exc}")
        return
    _state["wake_hold"] = hold
    _note(
        f"wake latency of CPU {format_cpulist(cpus)} held at {bound} µs for the server's "
        f"lifetime ({ENV_WAKE_LATENCY}): idle CPUs poll, so no handoff waits for a wake"
    )


def _drop_our_pool_vars() -> None:
    """Remove the library pool variables cpupin set (``CPUPIN_POOL_VARS``),
    which vLLM would take for the user's: its children size those pools
    from the CPUs it binds them to."""
    from cpupin.pools.limits import _ours, _record_ours

    mine = _ours(os.environ)
    ours = sorted(mine & set(VLLM_SIZED))
    for name in ours:
        value = os.environ.pop(name, None)
        if value is not None:
            _note(
                f"{name}={value} (set by cpupin) removed: vLLM sizes that pool from the CPUs "
                "it binds, and would take the value for yours"
            )
    if ours:
        _record_ours(os.environ, mine - set(ours))


# --- timing the steps ---------------------------------------------------------


def _wrap_execute_model() -> None:
    """Time each ``execute_model`` of the worker (in whichever process runs
    it: a worker, or the engine core with a one-process executor)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    original = WorkerWrapperBase.execute_model
    if getattr(original, "cpupin_wrapper", False):
        return
    local = threading.local()

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        marks = getattr(local, "marks", None)
        if marks is None:
            marks = local.marks = _first_step()
        if not marks:
            return original(self, *args, **kwargs)
        begin, end = marks
        begin()
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            _vllms_own(exc, "vLLM's execute_model")
            raise
        finally:
            end()

    execute_model.cpupin_wrapper = True  # type: ignore[attr-defined]
    WorkerWrapperBase.execute_model = execute_model


def _first_step() -> tuple[Callable[[], int], Callable[[], int]] | tuple[()]:
    """The clock of the thread that runs the steps, made on its first step;
    ``()`` when it cannot be (then steps run untimed)."""
    from cpupin.measure.stepclock import StepClock

    try:
        clock = StepClock("execute_model", keep=1024)
    except Exception as exc:  # noqa: BLE001
        _note(f"steps not timed: {exc}")
        return ()
    _state["clock"] = clock
    _note(f"times execute_model on tid {clock.tid} (StepClock 'execute_model')")
    if _state.get("mode") == "auto" and _state.get("role") == "vllm-worker":
        rank = _state.get("gpu_rank")
        if isinstance(rank, int):
            _pin_step_on_gpu(rank)
        else:
            _register_step_pin()
    event = _state.get("wake")
    if isinstance(event, threading.Event):
        event.set()
    # The marks themselves: one C call each, whose errors are the clock's
    # to keep (a figure of a step it could not read is dropped, never raised).
    return clock._begin, clock._end


def _register_step_pin() -> None:
    """Say in the record that the step thread is where vLLM bound it."""
    from cpupin import _native
    from cpupin.threads.pins import pin_current_thread

    try:
        pin_current_thread(_native.get_affinity(), role="step")
    except (OSError, ValueError) as exc:
        _note(f"step thread not registered: {exc}")


def _pin_step_on_gpu(local_rank: int, root: str = "/") -> None:
    """On a GPU worker, pin the step thread (this one) as
    ``CPUPIN_STEP_THREAD_CORE`` says, within the node the worker is bound
    to: ``auto`` places it by cpupin's rules and takes the GPU's lock, a CPU
    number puts it there, ``off`` (the default: pinning costs throughput on
    hosts without deep idle states) leaves it, with a note that
    ``cpupin doctor`` says whether it pays. Never raises."""
    from cpupin.act.server import plan_server
    from cpupin.errors import PlanError
    from cpupin.plan.placement import ENV_SETTING, setting_from_env
    from cpupin.threads.pins import pin_current_thread

    try:
        setting = setting_from_env(os.environ)
        if setting == "off":
            _note(
                f"step thread not pinned: {ENV_SETTING} is off (the default); "
                "`cpupin doctor` says whether pinning pays on this host, and what to set"
            )
            return
        plan = plan_server(setting, [local_rank], root=root)
        if not plan.pinned:
            _note(f"step thread not pinned: {plan.placement.reason}")
            return
        cpus = plan.placement.workers[0].cpus
        pin_current_thread(cpus, role="step")
    except (PlanError, OSError, ValueError) as exc:
        _note(f"step thread not pinned: {exc}")
        return
    _state["server_plan"] = plan  # holds the GPU's lock while the worker lives
    _note(
        f"step thread pinned to CPU {format_cpulist(cpus)} for CUDA device {local_rank} "
        f"({ENV_SETTING}={setting}): {plan.placement.reason}"
    )


def _start_publisher(mode: str) -> None:
    """A thread of cpupin's own, on the launcher's CPUs (never the OpenMP
    pin it would inherit), that puts the clock's figures in the record once
    a second and, in ``auto``, moves new non-OpenMP threads off the OpenMP
    CPUs."""
    from cpupin.threads.thread import Thread

    wake = _state["wake"] = threading.Event()
    Thread(target=_publisher, args=(mode, wake), name="cpupin-vllm", daemon=True).start()


def _publisher(mode: str, wake: threading.Event) -> None:
    from cpupin import _native
    from cpupin.registry.writer import step_figures

    launcher = _launcher_mask()
    where = _omp_split(launcher)
    # Its own thread sleeps: on what vLLM reserves, else off every rank's
    # OpenMP CPUs where any CPU is left, else the launcher's.
    home = launcher
    if where:
        home = where[1] or (launcher - where[0]) or launcher
    try:
        _native.set_affinity(home)
    except (OSError, ValueError):
        pass
    if mode == "auto" and where and not where[1]:
        _note(_NOTHING_MOVED)
        _publish()
    seen = -1
    while True:
        wake.wait(1.0)
        wake.clear()
        try:
            if mode == "auto" and where and where[1]:
                if not _watch_pressure(where[1], launcher):
                    _sweep(where[0], where[1], keep_team=True)
            clock = _state.get("clock")
            if clock is not None and clock.steps != seen:
                seen = clock.steps
                _publish([step_figures(clock)])
        except Exception as exc:  # noqa: BLE001
            log.warning("cpupin: the vLLM plugin's publisher stops: %s", exc)
            return


def _watch_pressure(kept: frozenset[int], launcher: frozenset[int]) -> bool:
    """One sample of the launcher's CPUs (:func:`host_pressure`: the work
    of tasks outside the server on them, and their idle time), and what
    :func:`next_confinement` makes of it: give the threads of this worker,
    its engine core and the API server that ``auto`` confined to ``kept``
    the launcher's CPUs back, or confine exactly those again. Returns
    whether they are widened now (the caller then moves no new thread onto
    ``kept``)."""
    from cpupin.host._proc import descendants
    from cpupin.host.cpu_busy import read_cpu_busy

    watch: dict[str, Any] = _state.setdefault(
        "watch", {"state": Confinement(), "pids": [], "pids_at": None, "last": None}
    )
    now = time.monotonic()
    root = (_server_of(os.environ) or (os.getppid(), 0))[0]
    if watch["pids_at"] is None or now - watch["pids_at"] >= 10:
        # The server's processes: the API server (else the engine core) and
        # every process below it, read again every ten seconds.
        watch["pids"] = [root, *(pid for pid, _ in descendants(root))]
        watch["pids_at"] = now
    busy, ran = read_cpu_busy(), _server_cpu(watch["pids"])
    last, watch["last"] = watch["last"], (now, busy, ran)
    if last is None:
        return bool(watch["state"].widened)
    then, busy_then, ran_then = last
    seen = host_pressure(
        {cpu: s - busy_then[cpu] for cpu, s in busy.items() if cpu in busy_then},
        now - then,
        launcher,
        sum(ns - ran_then[k] for k, ns in ran.items() if k in ran_then) / 1e9,
    )
    watch["state"], action = next_confinement(watch["state"], seen)
    if action is not None:
        mine = [os.getpid(), os.getppid(), root]
        _notes[:] = [n for n in _notes if not n.startswith("confinement ")]
        if action == "widen":
            watch["given_back"] = _move_all(mine, kept, launcher)
            _note(
                f"confinement widened: CPU {format_cpulist(launcher)} full for {WIDEN_AFTER} s, "
                f"{seen.outside:.1f} CPU of it work from outside the server; "
                f"{len(watch['given_back'])} thread(s) off CPU {format_cpulist(kept)}, back on "
                f"CPU {format_cpulist(launcher)} as vLLM alone runs them, until it eases"
            )
        else:
            back = _move_all(mine, launcher, kept, only=watch.pop("given_back", set()))
            _note(
                f"confinement back: outside work on CPU {format_cpulist(launcher)} eased; "
                f"{len(back)} thread(s) on CPU {format_cpulist(kept)} again"
            )
        _publish()
    return bool(watch["state"].widened)


def _server_cpu(pids: list[int]) -> dict[tuple[int, int], int]:
    """Every thread of the server's processes: its CPU time (ns)."""
    from cpupin import _native

    out = {}
    for pid in pids:
        try:
            listed = _native.thread_stats(pid)
        except (OSError, ValueError):
            continue  # exited since it was listed
        for st in listed:
            out[(pid, st.tid)] = st.run_ns
    return out


def _move_all(
    pids: list[int],
    where: frozenset[int],
    to: frozenset[int],
    only: set[tuple[int, int]] | None = None,
) -> set[tuple[int, int]]:
    """Move every thread of ``pids`` whose mask is ``where`` (and, given
    ``only``, that is one of those (pid, tid)) to ``to``; returns those
    moved."""
    from cpupin import _native
    from cpupin.process.mask import thread_masks

    moved = set()
    for pid in dict.fromkeys(pids):
        try:
            listed = thread_masks(pid)
        except (OSError, ValueError):
            continue
        for st, mask in listed:
            if mask == where and (only is None or (pid, st.tid) in only):
                try:
                    _native.set_affinity(to, st.tid)
                    moved.add((pid, st.tid))
                except (OSError, ValueError):
                    continue  # exited meanwhile
    return moved


def _omp_split(launcher: frozenset[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """Every local rank's OpenMP CPUs and the CPUs vLLM reserves
    (:func:`omp_plan`): this process's team, and what the engine core said."""
    found = omp_cpus(os.environ, launcher)
    return omp_plan(os.environ, None if found is None else found[0], launcher)


def _sweep(
    omp: frozenset[int],
    reserved: frozenset[int],
    *,
    keep_team: bool,
    pid: int | None = None,
) -> int:
    """Move the threads of a process (``None``: this one) that
    :func:`threads_to_move` names; returns how many moved."""
    from cpupin import _native
    from cpupin.pools.census import pool_name
    from cpupin.process.mask import thread_masks

    target = os.getpid() if pid is None else pid
    listed = [(st.tid, st.name, mask) for st, mask in thread_masks(pid)]
    moved = []
    for tid, name in threads_to_move(
        listed, main_tid=target, omp=omp, reserved=reserved, keep_team=keep_team
    ):
        try:
            _native.set_affinity(reserved, tid)
            moved.append(name)
        except (OSError, ValueError):
            continue  # exited meanwhile
    if moved:
        _state["moved_total"] = _state.get("moved_total", 0) + len(moved)
        _state["confined"] = reserved
        # One note a process, brought up to date at each sweep that moves
        # threads (the worker's start new ones while vLLM sets up).
        tally: dict[str, int] = _state.setdefault(f"moved {target}", {})
        for name in moved:
            tally[pool_name(name)] = tally.get(pool_name(name), 0) + 1
        head = f"moved {sum(tally.values())} thread(s) of pid {target} ("
        names = ", ".join(f"{k} {v}" for k, v in sorted(tally.items(), key=lambda kv: -kv[1]))
        line = (
            f"{head}{names[:160]}) off the OpenMP CPUs {format_cpulist(omp)} to "
            f"{format_cpulist(reserved)}"
        )
        mine = f" thread(s) of pid {target} ("
        _notes[:] = [n for n in _notes if not (n.startswith("moved ") and mine in n)]
        _note(line)
        _publish()
    return len(moved)


# --- GPU hosts: each worker, and the engine core, on its GPU's node ------------


def _on_gpus() -> bool:
    """Whether vLLM runs on CUDA GPUs here (ROCm's devices are counted by
    another variable than CUDA_VISIBLE_DEVICES: left alone)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    is_cuda = getattr(current_platform, "is_cuda", None)
    return bool(is_cuda()) if callable(is_cuda) else False


def _bind_to_gpu(local_rank: int, who: str, root: str = "/") -> None:
    """Bind this process (every thread, and its memory policy) to the NUMA
    node of the CUDA device ``local_rank``, within the launcher's mask
    (:func:`cpupin.bind_process`), before the worker allocates; a note says
    where, or why not. Never raises.

    The process is widened to the launcher's mask first: vLLM starts the
    workers from the engine core, whose own binding they inherit, and a
    worker whose GPU sits on another node than the engine core's would
    otherwise find none of its node's CPUs in its mask."""
    from cpupin.act.binding import bind_process
    from cpupin.host.topology import read_host

    try:
        _widen_to(_launcher_mask())
        binding = bind_process(local_rank, root=root)
        host = read_host(root)
    except (OSError, ValueError) as exc:
        _note(f"{who} not bound to CUDA device {local_rank}'s node: {exc}")
        return
    home = next((n.cpus for n in host.nodes if n.id == binding.node), frozenset())
    if binding.node is None or not binding.cpus <= home:
        _note(f"{who} not moved: {binding.reason}")
        return
    _note(
        f"{who} bound to CUDA device {local_rank} ({binding.device}), node {binding.node}: "
        f"CPUs {format_cpulist(binding.cpus)}, memory {binding.memory_policy}"
        + (f"; {binding.reason}" if binding.reason else "")
    )


def _widen_to(launcher: frozenset[int]) -> None:
    """Every thread of this process, and the mask cpupin plans within, on
    ``launcher`` where the process has less of it (what it inherited)."""
    from cpupin import _native
    from cpupin.process.mask import process_cpus, set_process_cpus, thread_masks

    if not launcher or process_cpus() == launcher:
        return
    for st, mask in thread_masks(None):
        if mask != launcher:
            try:
                _native.set_affinity(launcher, st.tid)
            except ProcessLookupError:
                continue
    set_process_cpus(launcher)


def _bind_engine_core(root: str = "/") -> None:
    """The engine core on every node of the server's GPUs (within the
    launcher's mask), as vLLM's own --numa-bind does: it drives every rank,
    and its workers start from it. Its memory stays where it is. Never
    raises; a note says where, or why not."""
    from cpupin.act.binding import bind_process
    from cpupin.act.server import parse_visible_devices, resolve_devices
    from cpupin.host.topology import cuda_gpus, read_host

    try:
        host = read_host(root)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = len(parse_visible_devices(visible)) if visible is not None else len(cuda_gpus(host))
        addresses = resolve_devices(list(range(count)), host) if count else ()
        nodes = sorted({g.node for g in host.gpus if g.address in addresses and g.node is not None})
        cpus = frozenset().union(*(n.cpus for n in host.nodes if n.id in nodes)) & (
            _launcher_mask()
        )
        if not cpus:
            _note(
                f"engine core not moved: the launcher's CPUs hold none of its GPUs' node(s) "
                f"{format_cpulist(frozenset(nodes)) or '(none)'}"
            )
            return
        binding = bind_process(cpus=cpus, memory="none", root=root)
    except (OSError, ValueError) as exc:
        _note(f"engine core not bound to its GPUs' nodes: {exc}")
        return
    _note(
        f"engine core bound to node(s) {format_cpulist(frozenset(nodes))} of its "
        f"{len(addresses)} GPU(s): CPUs {format_cpulist(binding.cpus)}"
        + (f"; {binding.reason}" if binding.reason else "")
    )


def _wrap_init_device() -> None:
    """Bind the worker to its GPU's node just before vLLM initialises the
    device (its local rank is known then; nothing is allocated yet)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    original = WorkerWrapperBase.init_device
    if getattr(original, "cpupin_wrapper", False):
        return

    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        rank = getattr(getattr(self, "worker", None), "local_rank", None)
        if isinstance(rank, int):
            _state["gpu_rank"] = rank
            _bind_to_gpu(rank, "worker")
            _publish()
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            _vllms_own(exc, "vLLM's init_device")
            raise

    init_device.cpupin_wrapper = True  # type: ignore[attr-defined]
    WorkerWrapperBase.init_device = init_device


# --- the engine core: vLLM-CPU's OpenMP plan ---------------------------------


def _vllms_own(exc: BaseException, where: str) -> None:
    """Say, in the traceback of an error that only passes through one of the
    plugin's wrappers, that the error is vLLM's: an operator who sees
    cpupin's file in it must not take it for cpupin's."""
    if not isinstance(exc, Exception):
        return
    text = (
        f"cpupin: this error is vLLM's own, raised in {where} before cpupin did anything; "
        "cpupin's wrapper only passed it on (CPUPIN_VLLM=off gives the same error)"
    )
    add = getattr(exc, "add_note", None)  # Python 3.11: shown with the traceback
    if callable(add):
        add(text)
    else:
        _say(logging.WARNING, text[len("cpupin: ") :])


def _wrap_omp_manager(mode: str) -> None:
    """Read (and in ``auto`` cap) vLLM-CPU's OpenMP CPU lists when the
    engine core makes them, before any worker starts."""
    try:
        from vllm.utils import ompmultiprocessing
    except ImportError:
        return  # not a build with the CPU worker's OpenMP plan
    manager = ompmultiprocessing.OMPProcessManager
    original = manager.__init__
    if getattr(original, "cpupin_wrapper", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        except BaseException as exc:
            _vllms_own(exc, "vLLM's OpenMP plan (OMPProcessManager)")
            raise
        try:
            _after_omp_plan(self, mode)
        except Exception as exc:  # noqa: BLE001
            _note(f"vLLM's OpenMP plan left as it is: {exc}")

    __init__.cpupin_wrapper = True  # type: ignore[attr-defined]
    manager.__init__ = __init__


#: Where vLLM reserves no CPU, no thread is moved: onto the OpenMP CPUs of
#: another rank would slow that rank's team, and vLLM has said of no other.
_NOTHING_MOVED = (
    "nothing moved: vLLM reserves no CPU beside the OpenMP CPUs (it reserves only under "
    "VLLM_CPU_OMP_THREADS_BIND=auto, VLLM_CPU_NUM_OF_RESERVED_CPU of them); no thread goes "
    "onto another rank's OpenMP CPUs"
)


def _after_omp_plan(manager: Any, mode: str) -> None:
    lists = [list(cpus) for cpus in getattr(manager, "cpu_lists", []) or []]
    if not lists:
        return
    reserved = frozenset(getattr(manager, "reserved_cpu_list", []) or [])
    launcher = _launcher_mask()
    omp = frozenset().union(*map(frozenset, lists))
    _note(
        f"vLLM binds OpenMP to {'; '.join(format_cpulist(frozenset(c)) for c in lists)}, "
        f"reserves {format_cpulist(reserved) or 'no CPU'}"
    )
    if mode == "auto":
        from cpupin.pools.limits import usable_cpus

        usable = usable_cpus()
        capped = cap_lists(lists, len(reserved), usable)
        if capped != lists:
            manager.cpu_lists = lists = capped
            omp = frozenset().union(*map(frozenset, capped))
            _note(
                f"OpenMP capped to {'; '.join(format_cpulist(frozenset(c)) for c in capped)}: "
                f"{usable} usable CPU(s) (the quota) for the team and the reserved CPUs"
            )
        lists, reserved, omp = _apart_from_other_servers(manager, lists, reserved, launcher)
    # Every rank of every data-parallel engine: vLLM gives this engine its
    # own ranks' lists, VLLM_CPU_OMP_THREADS_BIND names the others'.
    found = omp_plan({VLLM_BIND: os.environ.get(VLLM_BIND, "")}, omp, launcher)
    every = found[0] if found else omp & launcher
    kept = (reserved & launcher) - every
    # The workers start from here: they inherit what the plan is.
    os.environ[ENV_OMP_PLAN] = f"{format_cpulist(every)};{format_cpulist(kept)}"
    if mode != "auto":
        return
    if not kept:
        _note(_NOTHING_MOVED)
        _publish()
        return
    _sweep(every, kept, keep_team=False)
    parent = os.getppid()
    if _parent_is_api_server(parent):
        _sweep(every, kept, keep_team=False, pid=parent)
    _publish()


def _other_teams() -> dict[int, frozenset[int]]:
    """The OpenMP CPUs of every other live vLLM worker on the host (its step
    thread's pin, where vLLM bound it), by pid."""
    from cpupin.registry.reader import read_registry

    out: dict[int, frozenset[int]] = {}
    try:
        records = read_registry().records
    except OSError:
        return out
    for r in records:
        if r.kind == "process" and r.live and r.role == "vllm-worker" and r.pid != os.getpid():
            cpus = frozenset().union(*(p.cpus for p in r.pins if p.role == "step"))
            if cpus:
                out[r.pid] = cpus
    return out


def _apart_from_other_servers(
    manager: Any, lists: list[list[int]], reserved: frozenset[int], launcher: frozenset[int]
) -> tuple[list[list[int]], frozenset[int], frozenset[int]]:
    """Before any worker starts: vLLM's OpenMP lists moved off the CPUs
    other servers' teams run on, where the mask has room; a note either way
    (and so a line of ``cpupin ps``)."""
    teams = _other_teams()
    taken = frozenset().union(*teams.values()) if teams else frozenset()
    if bound_lists(os.environ.get(VLLM_BIND)) is not None:
        # The user's own binding: said, never changed.
        moved, kept = lists, sorted(reserved)
        shared = frozenset(c for cpus in lists for c in cpus) & taken
    else:
        moved, kept, shared = avoid_teams(lists, sorted(reserved), launcher, taken)
    owners = ", ".join(
        f"pid {pid} (CPU {format_cpulist(cpus)})" for pid, cpus in sorted(teams.items())
    )
    if shared:
        _note(
            f"shares CPU {format_cpulist(shared)} with another server's OpenMP team ({owners}): "
            f"the mask {format_cpulist(launcher)} has no room for a team of its own; give each "
            "server its own CPUs (taskset, VLLM_CPU_OMP_THREADS_BIND)"
        )
    elif moved != lists:
        manager.cpu_lists = moved
        manager.reserved_cpu_list = kept
        _note(
            f"OpenMP moved to {'; '.join(format_cpulist(frozenset(c)) for c in moved)}, off "
            f"another server's OpenMP team ({owners}); reserves "
            f"{format_cpulist(frozenset(kept)) or 'no CPU'}"
        )
    omp = frozenset(c for cpus in moved for c in cpus)
    return moved, frozenset(kept), omp


def _parent_is_api_server(pid: int) -> bool:
    from cpupin.registry.reader import read_registry

    try:
        return any(
            r.kind == "process" and r.live and r.pid == pid and r.role == "vllm-api-server"
            for r in read_registry().records
        )
    except OSError:
        return False


# --- metrics through vLLM's /metrics ----------------------------------------


def _export_metrics() -> None:
    """Add every server process's step figures and what ``auto`` did in it
    (from the records) to the registry vLLM's ``/metrics`` serves
    (``prometheus_client``'s default; with several API servers vLLM serves
    a multiprocess registry instead: use ``cpupin ps --prometheus`` there)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        _note("no step metrics on /metrics: prometheus_client is not installed")
        return
    from cpupin.measure.metrics import ServerStepsCollector

    REGISTRY.register(ServerStepsCollector(os.getpid(), model_name=model_name_of(sys.argv)))
