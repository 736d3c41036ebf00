"""The vLLM plugin's decisions, pure: which process of a server this is,
the mode asked for, the CPUs an OpenMP setting names, which threads move
where, and what a quota leaves. Functions of what was read, so that the
tests run them over vLLM's own settings and random hosts."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from cpupin.host.openmp import omp_team_cpus
from cpupin.host.topology import Host

__all__ = [
    "ENV_MASK",
    "ENV_MODE",
    "ENV_OMP_PLAN",
    "ENV_SERVER",
    "MODES",
    "ROLES",
    "VLLM_BIND",
    "VLLM_SIZED",
    "Confinement",
    "Pressure",
    "avoid_teams",
    "bound_lists",
    "omp_plan",
    "cap_lists",
    "env_warnings",
    "mode_from_env",
    "model_name_of",
    "next_confinement",
    "host_pressure",
    "omp_cpus",
    "quota_cpus",
    "role_of",
    "threads_to_move",
]

#: The variable that chooses what the plugin does.
ENV_MODE = "CPUPIN_VLLM"
#: Its values; the first is the default.
MODES = ("observe", "auto", "off")
#: The roles, as the records name them.
ROLES = ("vllm-api-server", "vllm-engine-core", "vllm-worker")
#: The launcher's mask, as the API server found it, for its children (the
#: worker's own mask is OpenMP's pin by the time the plugin loads there).
ENV_MASK = "CPUPIN_VLLM_MASK"
#: The API server's pid and start time (``PID-START``), for its children's
#: records: the API server removes them at exit when vLLM killed their
#: processes (its shutdown ends the engine core and workers with SIGKILL).
ENV_SERVER = "CPUPIN_VLLM_SERVER"
#: What the engine core tells its workers of vLLM's OpenMP plan:
#: ``OMP;RESERVED``, every local rank's OpenMP CPUs and the CPUs vLLM
#: reserves for everything else, as CPU lists (``0-1;`` reserves none).
ENV_OMP_PLAN = "CPUPIN_VLLM_OMP"
#: vLLM-CPU's own binding: ``auto``, ``nobind``, or a CPU list a rank
#: separated by ``|`` (every data-parallel rank's, in order).
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: The library pool variables whose pools vLLM sizes itself.
VLLM_SIZED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS")


def mode_from_env(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The mode ``CPUPIN_VLLM`` asks for, and a warning when its value is
    not one of :data:`MODES` (the default then applies)."""
    value = environ.get(ENV_MODE)
    if value is None or value.strip() == "":
        return MODES[0], None
    word = value.strip().lower()
    if word in MODES:
        return word, None
    from cpupin.errors import excerpt

    return MODES[0], (
        f"{ENV_MODE}={excerpt(value, 24)} is not a mode: choose {', '.join(MODES)}; "
        f"observing, the default"
    )


def env_warnings(environ: Mapping[str, str], online: frozenset[int]) -> list[str]:
    """A line for each variable the plugin reads whose value it cannot use,
    naming the variable, its value and what to do (the server starts either
    way, as if it were unset). ``online``: the host's CPUs."""
    from cpupin.act.server import wake_latency_from_env
    from cpupin.cpulist import format_cpulist, parse_cpulist
    from cpupin.errors import PlanError, excerpt
    from cpupin.plan.placement import setting_from_env
    from cpupin.pools.limits import ENV_POOL_VARS, POOL_VARS

    out = []
    _, bad_mode = mode_from_env(environ)
    if bad_mode:
        out.append(bad_mode)
    for read in (wake_latency_from_env, setting_from_env):
        try:
            read(environ)
        except (PlanError, ValueError) as exc:
            out.append(f"{exc}; ignored")
    mask = environ.get(ENV_MASK)
    if mask is not None:
        try:
            cpus = parse_cpulist(mask)
            if not cpus or not cpus <= online:
                raise ValueError(f"not CPUs of this host (online: {format_cpulist(online)})")
        except ValueError as exc:
            out.append(
                f"{ENV_MASK}={excerpt(mask, 32)}: {exc}; cpupin's API server sets it for its "
                "children: unset it (the launcher's mask is read instead)"
            )
    pools = environ.get(ENV_POOL_VARS)
    if pools:
        for item in pools.split(",")[:64]:
            name = item.partition("=")[0]
            if name not in POOL_VARS:
                out.append(
                    f"{ENV_POOL_VARS}={excerpt(pools, 48)}: {excerpt(item, 24)} is not "
                    f"NAME=VALUE of a pool variable cpupin sets ({', '.join(sorted(POOL_VARS))}); "
                    "cpupin writes it for its children: unset it"
                )
                break
    return out


def role_of(title: str, mp_name: str, main: str, argv: list[str]) -> str | None:
    """The role of a vLLM process from what vLLM sets: its process title
    (``VLLM::EngineCore``, ``VLLM::Worker_TP1``; any prefix), the name of its
    ``multiprocessing`` process (``EngineCore``, ``EngineCore_DP0``,
    ``VllmWorker-0``), or, for the API server, the module or command that
    runs it; ``None`` for anything else (a helper)."""
    _, _, name = title.partition("::")
    if name.startswith("EngineCore") or mp_name.startswith("EngineCore"):
        return "vllm-engine-core"
    if name.startswith("Worker") or mp_name.startswith("VllmWorker"):
        return "vllm-worker"
    if name.startswith("APIServer"):
        return "vllm-api-server"
    if mp_name != "MainProcess":
        return None
    if main.startswith("vllm.entrypoints"):
        return "vllm-api-server"
    if len(argv) >= 2 and os.path.basename(argv[0]) == "vllm" and argv[1] == "serve":
        return "vllm-api-server"
    return None


def omp_cpus(
    environ: Mapping[str, str], mask: Iterable[int], host: Host | None = None
) -> tuple[frozenset[int], str] | None:
    """The CPUs an OpenMP team binds to within the process mask ``mask``,
    from the variables vLLM (or anyone) set for it, read as libgomp reads
    them (:mod:`cpupin.host.openmp`: ``OMP_PLACES`` over
    ``GOMP_CPU_AFFINITY``, ``OMP_PROC_BIND=false`` dropping both,
    ``master``/``primary`` keeping the team on the first place), else
    Intel's ``KMP_AFFINITY`` proclist; and which variable said so. ``None``
    when none binds."""
    return omp_team_cpus(environ, mask, host)


def bound_lists(text: str | None) -> list[frozenset[int]] | None:
    """The CPU lists ``VLLM_CPU_OMP_THREADS_BIND`` names, a local rank each
    (every data-parallel rank's: vLLM slices them by rank); ``None`` for
    ``auto``, ``nobind``, unset or a list that does not read."""
    from cpupin.cpulist import parse_cpulist

    if text is None or text.strip() in ("", "auto", "nobind", "all"):
        return None
    try:
        lists = [parse_cpulist(item) for item in text.split("|")]
    except ValueError:
        return None
    return lists if all(lists) else None


def omp_plan(
    environ: Mapping[str, str],
    own: frozenset[int] | None,
    launcher: frozenset[int],
) -> tuple[frozenset[int], frozenset[int]] | None:
    """Every local rank's OpenMP CPUs within ``launcher`` and the CPUs
    vLLM reserves for everything else: what a thread may be moved off and
    where to. ``own`` is this process's team's CPUs (:func:`omp_cpus`),
    the engine core's word (:data:`ENV_OMP_PLAN`) gives the others' and
    vLLM's reserved CPUs, ``VLLM_CPU_OMP_THREADS_BIND`` every rank's it
    names. What is neither a rank's nor reserved by vLLM is not reserved:
    the reserved CPUs are vLLM's alone (none: nothing may move), never
    "the mask less my rank's". ``None`` when no OpenMP CPU is known."""
    from cpupin.cpulist import parse_cpulist

    omp = set(own or ())
    reserved: frozenset[int] = frozenset()
    told = environ.get(ENV_OMP_PLAN)
    if told is not None:
        ranks, sep, kept = told.partition(";")
        try:
            if sep:
                omp |= parse_cpulist(ranks) if ranks.strip() else frozenset()
                reserved = parse_cpulist(kept) if kept.strip() else frozenset()
        except ValueError:
            reserved = frozenset()
    for cpus in bound_lists(environ.get(VLLM_BIND)) or []:
        omp |= cpus
    every = frozenset(omp) & launcher
    if not every:
        return None
    return every, (reserved & launcher) - every


def avoid_teams(
    lists: list[list[int]],
    reserved: Iterable[int],
    launcher: frozenset[int],
    taken: frozenset[int],
) -> tuple[list[list[int]], list[int], frozenset[int]]:
    """vLLM's OpenMP lists (a local rank each) and reserved CPUs, moved off
    ``taken``, the CPUs other servers' OpenMP teams run on, where the
    launcher's mask has room: each list keeps its length and order, on the
    free CPUs vLLM did not reserve first, then on its reserved ones (which
    then are reserved no longer). Returns the lists, the reserved CPUs and
    the CPUs still shared with another team (empty when none is)."""
    omp = frozenset(c for cpus in lists for c in cpus)
    kept = [c for c in reserved]
    shared = omp & taken
    if not shared:
        return lists, kept, frozenset()
    free = sorted(launcher - taken)
    need = sum(len(cpus) for cpus in lists)
    if len(free) < need:
        return lists, kept, shared
    held = set(kept)
    order = [c for c in free if c not in held] + [c for c in free if c in held]
    moved: list[list[int]] = []
    at = 0
    for cpus in lists:
        moved.append(order[at : at + len(cpus)])
        at += len(cpus)
    team = set(order[:at])
    return moved, [c for c in kept if c not in team and c not in taken], frozenset()


def threads_to_move(
    threads: Iterable[tuple[int, str, frozenset[int]]],
    *,
    main_tid: int,
    omp: frozenset[int],
    reserved: frozenset[int],
    keep_team: bool,
) -> list[tuple[int, str]]:
    """Which threads go to ``reserved``: each ``(tid, name, mask)`` that
    touches the OpenMP CPUs and is not the main thread, and (``keep_team``,
    in the worker) that carries a name of its own. OpenMP's team threads
    keep their creator's name (the main thread's), so a thread named alike
    may be one of them and stays; gloo, ZMQ and named Python threads go."""
    if not reserved or not omp:
        return []
    main_name = next((name for tid, name, _ in threads if tid == main_tid), None)
    out = []
    for tid, name, mask in threads:
        if tid == main_tid and keep_team:
            continue
        if not mask & omp or mask <= reserved:
            continue
        if keep_team and name == main_name:
            continue
        out.append((tid, name))
    return out


def cap_lists(lists: list[list[int]], reserved: int, usable: int) -> list[list[int]]:
    """vLLM-CPU's OpenMP CPU lists (one a local rank) cut so that the teams
    and the reserved CPUs fit the usable CPUs (a quota): each rank keeps an
    equal share, at least one CPU, its first CPUs in vLLM's order."""
    if not lists:
        return lists
    total = sum(len(cpus) for cpus in lists)
    room = max(len(lists), usable - reserved)
    if total <= room:
        return lists
    share = max(1, room // len(lists))
    return [cpus[:share] for cpus in lists]


def quota_cpus(mask: frozenset[int], capacity: int, host: Host | None = None) -> frozenset[int]:
    """The CPUs a server confined to its quota keeps: ``capacity`` of
    ``mask`` (the quota's CPUs, rounded up), or the whole mask where the
    quota allows it all. A server spread over more CPUs than its quota runs
    its processes side by side until the quota is spent, then stands still
    for the rest of the period: every step that meets the stall waits for
    it. Confined, they take turns instead.

    One CPU a core first, the host's highest core class first (its priority
    cores), then each core's other hardware threads: vLLM-CPU binds one
    OpenMP thread a physical core, so the lowest-numbered CPUs, which on
    hosts that number siblings side by side are pairs of one core, would
    give its plan half the cores the quota pays for. Without ``host``, a
    core a CPU: the lowest CPUs."""
    if capacity < 1 or capacity >= len(mask):
        return mask
    cores: list[tuple[int, list[int]]] = []
    seen: set[int] = set()
    if host is not None:
        for core in host.cores:
            own = sorted(set(core.cpus) & mask)
            if own:
                cores.append((core.rank, own))
                seen.update(own)
    cores += [(0, [cpu]) for cpu in sorted(mask - seen)]
    cores.sort(key=lambda item: (item[0], item[1][0]))
    order = [
        own[depth]
        for depth in range(max(len(own) for _, own in cores))
        for _, own in cores
        if depth < len(own)
    ]
    return frozenset(order[:capacity])


# --- auto on a busy host: confine only while it pays --------------------------

#: ``auto`` widens the threads it confined to the CPUs vLLM reserves (back to
#: the launcher's CPUs, as vLLM alone runs them) when the launcher's CPUs
#: are full (less than :data:`FULL_BELOW` CPUs' worth idle) and work from
#: outside the server takes at least :data:`OUTSIDE_AT` CPUs' worth of
#: them ...
OUTSIDE_AT = 0.5
FULL_BELOW = 0.5
#: ... in :data:`WIDEN_AFTER` samples in a row (one a second); and confines
#: them again after :data:`NARROW_AFTER` samples in a row in which outside
#: work stayed below :data:`OUTSIDE_GONE` or the CPUs had a whole CPU idle.
WIDEN_AFTER = 3
OUTSIDE_GONE = 0.2
NARROW_AFTER = 30


class Confinement(NamedTuple):
    """Where ``auto``'s confinement stands: ``widened`` (the confined
    threads are back on the launcher's CPUs) and how many samples in a row
    have argued for changing that."""

    widened: bool = False
    streak: int = 0


class Pressure(NamedTuple):
    """The launcher's CPUs over one sample, in CPUs' worth: the work of
    tasks outside the server, and the time no task ran."""

    outside: float
    idle: float


def host_pressure(
    busy_s: Mapping[int, float], seconds: float, cpus: frozenset[int], server_s: float
) -> Pressure:
    """:class:`Pressure` on ``cpus`` (the launcher's) over a sample of
    ``seconds``: ``busy_s`` each CPU's busy seconds in it (``/proc/stat``),
    ``server_s`` the CPU seconds of every thread of the server (which all
    run within ``cpus``). Pure; never below 0.

    Why the whole mask, not only the reserved CPUs: confined, the server's
    other threads make the reserved CPUs look loaded, and the kernel's
    balancer moves outside work onto the OpenMP CPUs, where it delays the
    step; the work lands anywhere, and what it costs shows only when the
    CPUs are full."""
    if not cpus or seconds <= 0:
        return Pressure(0.0, 0.0)
    busy = sum(max(0.0, busy_s.get(cpu, 0.0)) for cpu in cpus) / seconds
    outside = max(0.0, busy - max(0.0, server_s) / seconds)
    return Pressure(outside, max(0.0, len(cpus) - busy))


def next_confinement(state: Confinement, seen: Pressure) -> tuple[Confinement, str | None]:
    """The state after one sample, and what to do now: ``"widen"``, after
    :data:`WIDEN_AFTER` samples in a row of full CPUs with outside work on
    them (confined threads and the step queue behind it); ``"narrow"``,
    after :data:`NARROW_AFTER` samples in a row with that work gone or room
    to spare; else ``None``. Pure; the gap between the two conditions and
    the longer wait to narrow keep a load near either from moving threads
    back and forth."""
    if not state.widened:
        crowded = seen.outside >= OUTSIDE_AT and seen.idle < FULL_BELOW
        streak = state.streak + 1 if crowded else 0
        if streak >= WIDEN_AFTER:
            return Confinement(True, 0), "widen"
        return Confinement(False, streak), None
    eased = seen.outside < OUTSIDE_GONE or seen.idle >= 1.0
    streak = state.streak + 1 if eased else 0
    if streak >= NARROW_AFTER:
        return Confinement(False, 0), "narrow"
    return Confinement(True, streak), None


def model_name_of(argv: list[str]) -> str:
    """The ``model_name`` label vLLM gives its own metrics, from the API
    server's command line: the first ``--served-model-name``, else
    ``--model``, else the model ``vllm serve`` names (its first argument);
    empty when none is given. Pure; the text is cut to 128 characters."""
    from cpupin.errors import printable

    def value_of(flag: str) -> str | None:
        for i, word in enumerate(argv):
            if word == flag and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(flag + "="):
                return word[len(flag) + 1 :]
        return None

    name = value_of("--served-model-name") or value_of("--model")
    if name is None and "serve" in argv[:3]:
        rest = argv[argv.index("serve") + 1 :]
        name = rest[0] if rest and not rest[0].startswith("-") else None
    return printable(name or "", 128)
