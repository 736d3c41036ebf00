"""Thread pools sized to the CPUs a process really has.

A pool sized from the host's CPU count inside a cgroup quota or a narrow
cpuset runs more threads than the process can keep busy: they queue behind
one another and, under a quota, exhaust it early in each period and all wait
for the next. This module gives the one number that matters
(:func:`usable_cpus`) and caps the pools to it (:func:`limit_pools` in
process, :func:`pool_env` for children); :mod:`cpupin.census` counts the
pools a process runs, with a verdict for each.
"""

from __future__ import annotations

import os
import sys
from _thread import get_native_id
from collections.abc import Callable, Iterable, Mapping, MutableMapping

from cpupin._records import NamedTuple, field, record
from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import read_cgroup
from cpupin.plan.cpuplan import CpuPlan
from cpupin.process.mask import own_pinned_cpus, process_cpus, thread_masks

__all__ = [
    "ENV_POOL_VARS",
    "POOL_VARS",
    "PoolLimits",
    "ThreadLimit",
    "apply_thread_limits",
    "cpu_plan",
    "environment_advice",
    "limit_pools",
    "pool_env",
    "thread_limits",
    "usable_cpus",
]

#: The variables that size the pools of the libraries a serving runtime
#: loads, and the share of :data:`cpupin.plan.cpuplan.POOLS` each follows.
#: ``PYTHON_CPU_COUNT`` (Python 3.13+) is what ``os.cpu_count()`` and
#: ``os.process_cpu_count()`` return in the child: every pool that sizes itself
#: from them follows. ``RAYON_NUM_THREADS`` sizes the tokenizers' pool, which
#: runs beside decoding: the ``encode`` share.
POOL_VARS: dict[str, str] = {
    "OMP_NUM_THREADS": "intra_op",
    "MKL_NUM_THREADS": "intra_op",
    "OPENBLAS_NUM_THREADS": "intra_op",
    "BLIS_NUM_THREADS": "intra_op",
    "NUMEXPR_NUM_THREADS": "intra_op",
    "RAYON_NUM_THREADS": "encode",
    "TORCHINDUCTOR_COMPILE_THREADS": "intra_op",
    "PYTHON_CPU_COUNT": "usable",
}

#: Which of :data:`POOL_VARS` cpupin itself set, comma-separated: those a
#: later :func:`limit_pools` or :func:`pool_env` may lower again; any other
#: value of them is the user's and is kept.
ENV_POOL_VARS = "CPUPIN_POOL_VARS"

#: The value a threadpoolctl library's variable has (user_api/internal_api
#: to the variable whose explicit setting it obeys).
_LIBRARY_VARS = {
    "openmp": "OMP_NUM_THREADS",
    "mkl": "MKL_NUM_THREADS",
    "openblas": "OPENBLAS_NUM_THREADS",
    "blis": "BLIS_NUM_THREADS",
}


# --- the one number --------------------------------------------------------


def cpu_plan(
    pid: int | None = None,
    *,
    root: str = "/",
    mask: Iterable[int] | None = None,
    pinned: Iterable[int] | None = None,
) -> CpuPlan:
    """The :class:`~cpupin.CpuPlan` of a process (``None``: this one): its
    affinity mask ∩ its cgroup's cpuset ∩ the online CPUs, the strictest
    quota of its cgroup and ancestors (v1 and v2), and the CPUs pinned for
    its step and result threads (its registered pins; for another process,
    its record in the lock directory).

    ``mask`` and ``pinned`` replace what would be read (a plan for a tree
    under ``root``); the cgroup and the online CPUs are read under ``root``.
    """
    own = pid is None or pid == os.getpid()
    proc = "self" if own else str(pid)
    with Reader(root) as r:
        cpuset, quota = read_cgroup(r, proc)
        online = r.cpus("sys/devices/system/cpu/online")
    if mask is None:
        if own:
            mask = process_cpus()
        else:
            from cpupin.process.outside import process_mask_of  # another process's: not exec's

            mask = process_mask_of(pid or 0, [m for _, m in thread_masks(pid)])[0]
    allowed = frozenset(mask)
    if online:
        allowed &= online
    if cpuset:
        allowed = allowed & cpuset or allowed
    if pinned is None:
        pinned = _pinned_of(None if own else pid)
    return CpuPlan(allowed, quota, frozenset(pinned) & allowed)


def _pinned_of(pid: int | None) -> frozenset[int]:
    if pid is None:
        return own_pinned_cpus()
    from cpupin.process.outside import registry_of

    return frozenset().union(*(p.cpus for p in registry_of(pid, None).pins_of(pid)))


def usable_cpus(pid: int | None = None, *, root: str = "/") -> int:
    """The CPUs a process (``None``: this one) can keep busy: see
    :func:`cpu_plan`, whose :attr:`~cpupin.CpuPlan.usable_cpus` this is."""
    return cpu_plan(pid, root=root).usable_cpus


# --- capping ---------------------------------------------------------------


@record(frozen=True)
class PoolLimits:
    """What :func:`limit_pools` or :func:`pool_env` did."""

    usable_cpus: int
    set: dict[str, int] = field(default_factory=dict)
    """Pool or variable to the size it now has."""
    kept: dict[str, str] = field(default_factory=dict)
    """Pool or variable left alone, to why."""
    oversubscribed: list[str] = field(default_factory=list)
    """The variables kept because the user set them, to more threads than
    the usable CPUs (their reasons in :attr:`kept`)."""

    def as_dict(self) -> dict[str, object]:
        return {"usable_cpus": self.usable_cpus, "set": self.set, "kept": self.kept}

    def __str__(self) -> str:
        parts = [f"usable CPUs {self.usable_cpus}"]
        if self.set:
            parts.append("set " + ", ".join(f"{k}={v}" for k, v in self.set.items()))
        if self.kept:
            parts.append("kept " + "; ".join(f"{k}: {v}" for k, v in self.kept.items()))
        return "; ".join(parts)


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _cpus(n: int) -> str:
    return f"{n} CPU" + ("" if n == 1 else "s")


def _size(plan: CpuPlan, share: str) -> int:
    return plan.usable_cpus if share == "usable" else plan.pool_size(share)


def _ours(env: Mapping[str, str]) -> set[str]:
    """The pool variables cpupin set and that still hold what it set:
    ``CPUPIN_POOL_VARS`` records each as ``NAME=VALUE``, so that a value the
    user put in its place later (a child's shell, a script) counts as the
    user's even though the name was handed down. A bare name (the older
    form) counts as cpupin's."""
    ours = set()
    for item in env.get(ENV_POOL_VARS, "").split(","):
        name, eq, value = item.partition("=")
        if name in POOL_VARS and (not eq or env.get(name) == value):
            ours.add(name)
    return ours


def _record_ours(env: MutableMapping[str, str], ours: Iterable[str]) -> None:
    env[ENV_POOL_VARS] = ",".join(f"{n}={env[n]}" for n in sorted(ours) if n in env)


def _user_value(env: Mapping[str, str], name: str) -> str | None:
    """The user's explicit value of ``name``, or ``None`` (unset, or set by cpupin)."""
    value = env.get(name)
    if value is None or name in _ours(env):
        return None
    return value


def _shown(value: str) -> str:
    """A variable's value as a message quotes it: bare when plain digits."""
    return value if value.isascii() and value.isdigit() and len(value) <= 12 else excerpt(value, 32)


def _explain(name: str, env: Mapping[str, str], mask_cpus: int, size: int) -> str:
    value = env.get(name, "")
    count = pool_threads(name, env, mask_cpus)
    shown = _shown(value)
    if name == "OMP_NUM_THREADS" and omp_num_threads(value) is None:
        read = (
            f"set to {shown} by the user, which libgomp refuses: it runs one thread a CPU of "
            f"the mask ({_threads(mask_cpus)})"
        )
    elif count is not None and str(count) != value.strip():
        read = f"set to {shown} by the user, which its library reads as {_threads(count)}"
    else:
        read = f"set to {shown} by the user"
    if count is not None and count > size:
        return (
            f"{read}, more than the {size} the CPUs allow: kept, but the pool is "
            "oversubscribed; lower it or unset it"
        )
    return f"{read}: kept"


def pool_env(
    plan: CpuPlan | None = None,
    base: Mapping[str, str] | None = None,
    *,
    host_cpus: int | None = None,
    mask_cpus: int | None = None,
) -> tuple[dict[str, str], PoolLimits]:
    """A copy of ``base`` (default ``os.environ``) whose pool variables
    (:data:`POOL_VARS`) follow ``plan`` (default: :func:`cpu_plan` of this
    process), and what was set and kept. A variable the user set is kept,
    never raised or lowered; one cpupin set before (``CPUPIN_POOL_VARS``,
    say a parent's plan, which knew its pinned CPUs) is lowered, never
    raised.

    A variable is set only where it narrows what its readers would count
    by themselves: the libraries' (OpenMP, MKL, OpenBLAS, ...) when the
    usable CPUs are fewer than the CPUs of the mask they run under, which
    they count unset (``mask_cpus``, default ``plan``'s mask: a quota, or
    pinned CPUs); ``PYTHON_CPU_COUNT`` when they are fewer than
    ``host_cpus`` (default: the online CPUs), which ``os.cpu_count()``
    counts. Where nothing narrows, a value would only repeat the default,
    and an engine that plans its own pools takes any value it finds for
    the user's choice (vLLM-CPU then keeps a pool of that size on the one
    CPU it binds: docs/vllm.md)."""
    plan = plan or cpu_plan()
    env = dict(os.environ if base is None else base)
    ours = _ours(env)
    limits = PoolLimits(plan.usable_cpus)
    if host_cpus is None:
        from cpupin._native import online_cpus

        host_cpus = len(online_cpus())
    if mask_cpus is None:
        mask_cpus = len(plan.mask)
    for name, share in POOL_VARS.items():
        size = _size(plan, share)
        user = _user_value(env, name)
        if user is not None:
            limits.kept[name] = _explain(name, env, mask_cpus, size)
            count = pool_threads(name, env, mask_cpus)
            if count is not None and count > size:
                limits.oversubscribed.append(name)
            continue
        counted = host_cpus if share == "usable" else mask_cpus
        if plan.usable_cpus >= counted and name not in ours:
            limits.kept[name] = (
                f"left unset: {'os.cpu_count()' if share == 'usable' else 'its library'} "
                f"counts {_cpus(counted)}, all usable"
            )
            continue
        before = parse_pool_var(env.get(name, "")) if name in ours else None
        if before is not None and before <= size:
            # set by cpupin before (a parent that knew its pinned CPUs): not raised
            limits.kept[name] = f"already {before}, set by cpupin: not raised"
            continue
        env[name] = str(size)
        ours.add(name)
        limits.set[name] = size
    _record_ours(env, ours)
    return env, limits


# Whether limit_pools() capped this process's own pools (a later plan that
# pins CPUs lowers them again).
_limited_here = False


def limit_pools(
    plan: CpuPlan | None = None,
    *,
    environ: MutableMapping[str, str] | None = None,
) -> PoolLimits:
    """Cap this process's pools to its usable CPUs, once at start-up.

    - torch's intra-op pool (``torch.set_num_threads``) and its inter-op pool
      where it has not started (said where it has), when torch is imported;
    - every BLAS and OpenMP runtime loaded, through ``threadpoolctl``;
    - the pool variables of ``environ`` (default ``os.environ``): libraries
      loaded later, and children, size themselves from them.

    OpenMP keeps its limit per thread: torch's intra-op pool and each
    OpenMP runtime are limited in the calling thread, and in every
    :class:`cpupin.Thread` and :class:`cpupin.ThreadPool` worker started
    after; a plain ``threading.Thread`` that runs OpenMP (a torch operation)
    runs the default team, one thread a CPU of the mask, unless it calls
    :func:`apply_thread_limits` first (measured on torch's libgomp: a second
    thread's matmul started a team of 2 after ``torch.set_num_threads(1)``).

    Sizes follow ``plan``'s shares (default: :func:`cpu_plan`). Nothing is
    ever raised: a pool already smaller, and any variable the user set, are
    kept, and the result says why. The order does not matter: a
    :func:`~cpupin.plan_server` that pins CPUs afterwards lowers these pools
    again to what its plan leaves.
    """
    global _limited_here
    plan = plan or cpu_plan()
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    if environ is None:
        _limited_here = True
    # What libraries loaded later, and children, count unset: this
    # process's mask, which may be wider than the plan's.
    new_env, limits = pool_env(plan, env, mask_cpus=len(plan.mask | process_cpus()))
    for name in POOL_VARS:
        if name in limits.set:
            env[name] = new_env[name]
    env[ENV_POOL_VARS] = new_env[ENV_POOL_VARS]
    size = plan.pool_size("intra_op")
    _limit_torch(env, size, limits)
    _limit_libraries(env, size, limits)
    if environ is None:
        # A process that sizes its pools with cpupin says so in its record:
        # `cpupin ps` lists it, with its pools named as it names them.
        from cpupin.registry import writer as registry

        registry.add_note("limit_pools", f"limit_pools(): {limits}")
    return limits


class ThreadLimit(NamedTuple):
    """An OpenMP limit :func:`limit_pools` set, which OpenMP keeps per thread."""

    label: str
    size: int
    default: int
    """The team a thread that was not limited runs: the pool's size before
    :func:`limit_pools` lowered it, read on a thread that had not changed it."""
    apply: Callable[[int], object]


#: The OpenMP limits limit_pools() set: OpenMP keeps them per thread (a
#: thread's own ``nthreads-var``), so each applies in the thread that called
#: it, and in every cpupin.Thread started after (:func:`apply_thread_limits`).
_thread_limits: dict[str, ThreadLimit] = {}
#: The threads (native ids) the limits were applied in.
_limited_tids: set[int] = set()


def thread_limits() -> list[tuple[ThreadLimit, frozenset[int]]]:
    """Each OpenMP limit :func:`limit_pools` set, with the live threads it
    applies in (the others run the default team)."""
    import threading  # here: `import cpupin` does without it

    alive = {t.native_id for t in threading.enumerate()}
    _limited_tids.intersection_update(alive)
    return [(limit, frozenset(_limited_tids)) for limit in _thread_limits.values()]


def apply_thread_limits() -> None:
    """Apply in the calling thread the OpenMP limits :func:`limit_pools`
    set in another: OpenMP keeps a limit per thread, and a thread that was
    not limited runs the default team, as many threads as the mask has
    CPUs. :class:`cpupin.Thread` and :class:`cpupin.ThreadPool` workers do
    this as they start; a plain ``threading.Thread`` that runs OpenMP (torch
    operations) calls it first. Nothing when no limit was set; never raises."""
    if not _thread_limits:
        return
    for limit in list(_thread_limits.values()):
        try:
            limit.apply(limit.size)
        except Exception:  # noqa: BLE001 - a library that refuses keeps its default
            continue
    _limited_tids.add(get_native_id())


def _lower(
    limits: PoolLimits,
    label: str,
    now: int,
    size: int,
    apply: Callable[[int], object],
    per_thread: bool = False,
) -> None:
    """Lower a pool of ``now`` threads to ``size`` with ``apply``, never
    raise one, and say which. ``per_thread``: an OpenMP limit, kept for
    :func:`apply_thread_limits`."""
    if now > size:
        apply(size)
        limits.set[label] = size
        if per_thread:
            was = _thread_limits.get(label)
            _thread_limits[label] = ThreadLimit(label, size, was.default if was else now, apply)
            _limited_tids.add(get_native_id())
    else:
        limits.kept[label] = f"already {_threads(now)}, not raised"


def _limit_torch(env: Mapping[str, str], size: int, limits: PoolLimits) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_num_threads"):
        return  # not imported: it reads OMP_NUM_THREADS when it is
    if _user_value(env, "OMP_NUM_THREADS") is not None:
        limits.kept["torch intra-op"] = (
            f"OMP_NUM_THREADS set by the user: {_threads(torch.get_num_threads())} kept"
        )
    else:
        _lower(
            limits,
            "torch intra-op",
            torch.get_num_threads(),
            size,
            torch.set_num_threads,
            per_thread=True,
        )
    try:
        _lower(
            limits,
            "torch inter-op",
            torch.get_num_interop_threads(),
            size,
            torch.set_num_interop_threads,
        )
    except RuntimeError:
        limits.kept["torch inter-op"] = (
            f"already started with {_threads(torch.get_num_interop_threads())}: torch cannot "
            "resize it; call limit_pools() before the first parallel operation"
        )


def _limit_libraries(env: Mapping[str, str], size: int, limits: PoolLimits) -> None:
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a dependency
        limits.kept["BLAS/OpenMP"] = "threadpoolctl is not installed: pip install threadpoolctl"
        return
    for lib in ThreadpoolController().lib_controllers:
        label = f"{lib.internal_api} ({os.path.basename(lib.filepath)})"
        var = _LIBRARY_VARS.get(lib.internal_api) or _LIBRARY_VARS.get(lib.user_api, "")
        if var and _user_value(env, var) is not None:
            limits.kept[label] = f"{var} set by the user: {_threads(lib.num_threads)} kept"
        else:
            _lower(
                limits,
                label,
                lib.num_threads,
                size,
                lib.set_num_threads,
                per_thread=lib.internal_api == "openmp",
            )


#: What C's ``isspace`` takes for space in the "C" locale.
_C_SPACE = " \t\n\v\f\r"
#: The largest count a runtime keeps (a ``long``): past it libgomp refuses.
_LONG_MAX = (1 << 63) - 1


def _strtoul(text: str, at: int) -> tuple[int | None, int]:
    """C's ``strtoul(text + at, &end, 10)``, for the runtimes' parsers: the
    value (``None`` for a negative, out-of-range or missing number, which
    libgomp refuses) and where it stopped. Digits past 20 stop the read."""
    while at < len(text) and text[at] in _C_SPACE:
        at += 1
    negative = text[at : at + 1] == "-"
    if text[at : at + 1] in ("+", "-"):
        at += 1
    start = at
    while at < len(text) and "0" <= text[at] <= "9" and at - start <= 20:
        at += 1
    if at == start:
        return None, start
    value = int(text[start:at])
    if negative or value > _LONG_MAX:
        return None, at
    return value, at


def omp_num_threads(value: str) -> int | None:
    """The team size libgomp reads from ``OMP_NUM_THREADS``, or ``None``
    where it refuses the value (then it warns, and runs one thread a CPU of
    the mask): a list of whole numbers above 0 (``4,2``: 4 at the first
    level), each read as ``strtoul`` reads it (spaces, a ``+``), and
    nothing else. ``0``, ``-1``, ``""``, ``2x``, ``4,x`` are refused."""
    first, at = _strtoul(value, 0)
    if not first:
        return None
    while True:
        while at < len(value) and value[at] in _C_SPACE:
            at += 1
        if at == len(value):
            return first
        if value[at] != ",":
            return None
        n, at = _strtoul(value, at + 1)
        if not n:
            return None


def _atoi(value: str) -> int:
    """C's ``atoi``: spaces, a sign, the digits it starts with; 0 for none."""
    n, _ = _strtoul(value, 0)
    stripped = value.lstrip(_C_SPACE)
    if n is None:
        return 0
    return -n if stripped.startswith("-") else n


def pool_threads(name: str, env: Mapping[str, str], mask_cpus: int) -> int | None:
    """The threads the library that reads ``name`` runs, set as ``env``
    says, in a process whose mask has ``mask_cpus`` CPUs; ``None`` where
    the variable is unset and the library's own count is not known.

    - ``OMP_NUM_THREADS``: libgomp's reading (:func:`omp_num_threads`); a
      value it refuses, or none, is one thread a CPU of the mask.
    - ``OPENBLAS_NUM_THREADS``: OpenBLAS reads it with ``atoi`` (else
      ``GOTO_NUM_THREADS``, else ``OMP_NUM_THREADS``); 0 or less is the
      mask's CPUs; more is cut to them.
    - the others: a whole number (spaces and a ``+`` allowed) above 0."""
    value = env.get(name)
    if name == "OMP_NUM_THREADS":
        n = None if value is None else omp_num_threads(value)
        return mask_cpus if n is None else n
    if name == "OPENBLAS_NUM_THREADS":
        for var in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
            got = _atoi(env.get(var, ""))
            if got > 0:
                return min(got, mask_cpus)
        return mask_cpus
    return None if value is None else parse_pool_var(value)


def parse_pool_var(value: str) -> int | None:
    """A pool variable's thread count, or ``None`` when it is not one
    (OpenMP's nested ``4,2`` counts its first level): a whole number above
    0, with spaces and a ``+`` allowed, as the runtimes read it."""
    head = value.split(",")[0]
    n, at = _strtoul(head, 0)
    if not n or head[at:].strip(_C_SPACE):
        return None
    return n


def environment_advice(
    plan: CpuPlan,
    host_cpus: int,
    environ: Mapping[str, str] | None = None,
    python: tuple[int, int] | None = None,
) -> tuple[list[str], dict[str, int]]:
    """What the pool variables of ``environ`` give a process started under
    it with ``plan`` on a host of ``host_cpus`` online CPUs: a line for each
    that leaves a pool larger than the usable CPUs, and the values
    :func:`pool_env` would set (empty when nothing is wrong).

    Unset, OpenMP sizes its pool from the affinity mask (not the quota, not
    the pinned CPUs) and Python's ``os.cpu_count()`` counts the host; a
    value above the usable CPUs oversubscribes whatever reads it.
    ``PYTHON_CPU_COUNT`` is read only from Python 3.13 (``python``, default
    the running one): before that it is never advised, and the line on
    ``os.cpu_count()`` says what works there instead.
    """
    env = os.environ if environ is None else environ
    reads_cpu_count = (python or sys.version_info[:2]) >= (3, 13)
    usable = plan.usable_cpus
    mask = len(plan.mask)
    lines: list[str] = []
    for name in POOL_VARS:
        value = env.get(name)
        if value is None:
            seen = {"OMP_NUM_THREADS": mask, "PYTHON_CPU_COUNT": host_cpus}.get(name)
            are = "is" if usable == 1 else "are"
            if seen is None or seen <= usable:
                continue
            if name == "PYTHON_CPU_COUNT" and not reads_cpu_count:
                lines.append(
                    f"os.cpu_count() counts {seen} CPUs, but {usable} {are} usable; this "
                    "Python (before 3.13) does not read PYTHON_CPU_COUNT: size pools from "
                    "cpupin.usable_cpus(), or use cpupin.ThreadPool"
                )
                continue
            lines.append(
                f"{name} unset: {'OpenMP' if name.startswith('OMP') else 'os.cpu_count()'} "
                f"counts {seen} CPUs, but {usable} {are} usable"
            )
            continue
        count = pool_threads(name, env, mask)
        if count is None or count <= usable:
            continue
        if name == "OMP_NUM_THREADS" and omp_num_threads(value) is None:
            lines.append(
                f"{name}={_shown(value)}: libgomp refuses it and runs one thread a CPU of "
                f"the mask, {count}, more than the {usable} usable CPU(s)"
            )
        else:
            lines.append(f"{name}={_shown(value)}: {_threads(count)}, more than the "
                         f"{usable} usable CPU(s)")  # fmt: skip
    if not lines:
        return lines, {}
    advice = {}
    for name, share in POOL_VARS.items():
        if name == "PYTHON_CPU_COUNT" and not reads_cpu_count:
            continue  # not a fix on this Python
        count = pool_threads(name, env, mask) if name in env else None
        if count is None or count > usable:
            advice[name] = _size(plan, share)
    return lines, advice
