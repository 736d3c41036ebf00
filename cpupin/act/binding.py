"""Binding a worker process to its GPU's NUMA node: its CPUs and its memory.

A worker runs best on the CPUs of its GPU's node, with its memory there. The
usual tools for it (``numactl --cpunodebind=N --preferred=N`` wrapped around
each worker) override a CPU set that Kubernetes, Slurm or docker already
narrowed, bind nothing where the image lacks ``numactl``, and kill the worker
or bind nothing without a word where the container may not set a memory
policy. Here:

- :func:`decide_binding` is pure: the binding is a function of the host, the
  process mask, the target (a GPU or a node), the modes and the nodes the
  process may allocate on (``Mems_allowed``). CPUs are chosen by the mode
  (the node, its package, an exclusive share of the node, one last-level
  cache of it, or a list), always within the process mask and never empty;
  memory goes only to nodes that have memory and that the process may use.
- :func:`bind_process` reads, decides and applies, in that order: the CPU
  mask of every thread of the process first (and :func:`~cpupin.process_cpus`
  becomes it, so that :class:`~cpupin.Thread` and :class:`~cpupin.ThreadPool`
  start there), then the memory policy of the calling thread. A CPU move that
  fails is undone and raises before any memory policy is set; a memory policy
  the kernel refuses (``EPERM`` without ``CAP_SYS_NICE`` under docker's
  seccomp profile, ``ENOSYS`` without NUMA, ``EINVAL``) leaves the CPUs
  bound, sets no policy, and says why in :attr:`Binding.reason`, with a
  warning logged once: never an exception, unless ``strict=True`` and
  ``memory="bind"``.

A memory policy belongs to a thread and is inherited by the threads it starts
later; threads already running keep theirs. So bind first thing in the worker,
before any pool starts: the reason says when other threads already existed.

Grace Hopper and GB200 hosts show GPU memory as extra NUMA nodes without
CPUs, while the GPU's PCI ``numa_node`` names its CPU node: the binding uses
the CPU node, and never binds memory to a node without CPUs. A GPU without a
node (``numa_node`` -1 on a host of several nodes) binds nothing, unless its
``local_cpus`` lie within one node, which is then its node.
"""

from __future__ import annotations

import errno
import os
from _thread import allocate_lock
from collections.abc import Iterable, Mapping

from cpupin import _native
from cpupin._records import replace
from cpupin.cpulist import format_cpulist, parse_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host._sysfs import Reader
from cpupin.host.topology import Host, read_host_for_binding
from cpupin.plan.binding import Binding, check_memory, decide_binding, parse_cpus
from cpupin.process.mask import process_cpus, set_process_cpus, thread_masks

__all__ = ["bind_process", "device_address", "memory_binding_check", "read_mems_allowed"]

_MPOL = {
    "preferred": _native.MPOL_PREFERRED,
    "bind": _native.MPOL_BIND,
    "interleave": _native.MPOL_INTERLEAVE,
}


def read_mems_allowed(root: str = "/") -> frozenset[int] | None:
    """The nodes the process may allocate on (``Mems_allowed_list`` of
    ``proc/self/status`` under ``root``); ``None`` when it does not say."""
    with Reader(root) as r:
        text = r.text("proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith("Mems_allowed_list:"):
            try:
                return parse_cpulist(line.split(":", 1)[1])
            except ValueError:
                return None
    return None


# The one door to the kernel's memory policy, so that a test can make the
# kernel refuse it (a seccomp filter, a container without CAP_SYS_NICE).
_set_mempolicy = _native.set_mempolicy

# Errnos already warned about: the warning is logged once each.
_warned: set[int] = set()
_warned_lock = allocate_lock()


def _refusal(err: int, policy: str, node: int | str) -> str:
    if err == errno.EPERM:
        return (
            f"the kernel refused the {policy} memory policy on node {node} (EPERM): a "
            "container needs CAP_SYS_NICE for it (docker run --cap-add SYS_NICE), or pass "
            "memory='none' (--memory none) to bind CPUs only"
        )
    if err == errno.ENOSYS:
        return (
            f"this kernel has no NUMA memory policy (ENOSYS), so no {policy} policy on node "
            f"{node}: pass memory='none' (--memory none)"
        )
    return (
        f"the kernel refused the {policy} memory policy on node {node} "
        f"({errno.errorcode.get(err, err)}: {os.strerror(err)}): no memory policy"
    )


def bind_process(
    device: str | int | None = None,
    *,
    node: int | None = None,
    cpus: str | Iterable[int] = "node",
    memory: str = "preferred",
    root: str | os.PathLike[str] = "/",
    environ: Mapping[str, str] | None = None,
    strict: bool = False,
) -> Binding:
    """Bind this process to a GPU's NUMA node (or to ``node``): call it first
    thing in a worker, before it allocates and before any thread starts.

    ``device`` is a PCI address or a CUDA device index, resolved as
    :func:`~cpupin.plan_server` does (through ``CUDA_VISIBLE_DEVICES`` in
    ``environ``, onto the host's GPUs in PCI order); exactly one of
    ``device`` and ``node``, except that a CPU list needs neither.

    ``cpus`` chooses the CPUs, always within the process mask (the
    launcher's CPU set), and every thread of the process moves there:

    - ``"node"``: the node's CPUs;
    - ``"socket"``: the CPUs of every node of the node's package;
    - ``"exclusive"``: the node's cores (SMT siblings together) divided
      among the host's GPUs on the node in PCI order, the lowest GPUs taking
      one more where they do not divide evenly, as torch defines it;
    - ``"cache"``: one last-level cache domain of the node, the fullest
      first, a domain for each GPU of the node in PCI order while they last
      (then they wrap round), as torch's ``core-complex``;
    - a CPU list (``"0-7,64-71"`` or CPU numbers): those CPUs;
    - ``"keep"``: moves nothing.

    ``memory`` sets the calling thread's policy (inherited by the threads it
    starts): ``"preferred"`` (``MPOL_PREFERRED``, the target's node),
    ``"bind"`` (``MPOL_BIND``) or ``"interleave"`` (``MPOL_INTERLEAVE``)
    over the chosen nodes (the package's under ``socket``, the list's CPUs'
    under a list, else the target's), or ``"none"``.

    Raises :class:`PlanError` for a device or node the host lacks (on a host
    without GPUs, a device names nothing: name the node), and ``OSError``
    when a thread cannot be moved (the moves made are undone, and no memory
    policy is set). A memory policy the kernel refuses is a reason, not an
    exception, unless ``strict`` and ``memory="bind"``.
    """
    mode, listed = parse_cpus(cpus)
    check_memory(memory)
    if listed is None and (device is None) == (node is None):
        raise ValueError("bind_process: name exactly one of device and node")
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 0):
        raise ValueError(f"node {excerpt(node)} is not a node id: give a whole number from 0")
    host = read_host_for_binding(root, caches=mode == "cache")
    mask = process_cpus() & host.cpus
    if not mask:
        raise PlanError(
            f"the process mask {format_cpulist(process_cpus())} holds no online CPU of the "
            f"host under {host.root}"
        )
    address = None if device is None else device_address(host, device, environ)
    decided = decide_binding(
        host,
        mask,
        device=address,
        node=node,
        cpus=listed if listed is not None else mode,
        memory=memory,
        mems_allowed=read_mems_allowed(os.fspath(root)),
    )
    if mode != "keep":
        left = _move_every_thread(decided.cpus)
        set_process_cpus(decided.cpus)
        if left:
            reason = f"{decided.reason}; {left}" if decided.reason else left
            decided = replace(decided, reason=reason)
    return _apply_memory(decided, strict)


def device_address(host: Host, device: str | int, environ: Mapping[str, str] | None = None) -> str:
    """The PCI address of a device index or address on ``host``; on a host
    without GPUs, :class:`PlanError` saying to name the node instead."""
    if not host.gpus:
        raise PlanError(
            f"device {excerpt(device)}: this host has no GPU (no display-class PCI function "
            "of NVIDIA, AMD or Intel under sys/bus/pci/devices), so a GPU index names nothing "
            "to bind to; name the node instead: node=0 (cpupin exec --node 0)"
        )
    from cpupin.act.server import resolve_devices  # its imports cost a binding that names a node

    (address,) = resolve_devices([device], host, environ)
    return address


#: Passes over the thread list before a binding gives up on threads that
#: keep starting while it runs.
_MOVE_PASSES = 8


def _move_every_thread(cpus: frozenset[int]) -> str:
    """Every thread of this process onto ``cpus``, or none: a move that fails
    is undone and raised. A thread cpupin pinned on purpose within ``cpus``
    keeps its pin; one pinned outside is moved, and its pin released. Threads
    started while it runs (a thread started from one not yet moved inherits
    the old mask) are caught by another pass over the list, until a pass
    finds nothing to move; returns what was left or released, and why, or
    an empty string."""
    from cpupin.threads.pins import _drop_pins, pinned_threads

    pins = pinned_threads()
    kept = {tid for tid, pin in pins.items() if pin <= cpus}
    moved: list[tuple[int, frozenset[int]]] = []
    try:
        for _ in range(_MOVE_PASSES):
            left = [
                (st.tid, before)
                for st, before in thread_masks()
                if before != cpus and st.tid not in kept
            ]
            if not left:
                break
            for tid, before in left:
                try:
                    _native.set_affinity(cpus, tid)
                except ProcessLookupError:
                    continue  # exited meanwhile
                moved.append((tid, before))
    except BaseException:
        for tid, before in moved:
            try:
                _native.set_affinity(before, tid)
            except (OSError, ValueError):
                pass
        raise
    said = []
    released = sorted({tid for tid, _ in moved if tid in pins})
    if released:
        _drop_pins(released)
        shown = ", ".join(map(str, released[:8])) + ("..." if len(released) > 8 else "")
        said.append(
            f"{len(released)} pinned thread(s) (tid {shown}) had pins outside CPU "
            f"{format_cpulist(cpus)}: moved, and their pins released; pin them again within it"
        )
    stragglers = [st.tid for st, before in thread_masks() if before != cpus and st.tid not in kept]
    if stragglers:
        shown = ", ".join(map(str, stragglers[:8])) + ("..." if len(stragglers) > 8 else "")
        said.append(
            f"threads kept starting while the process was bound: {len(stragglers)} thread(s) "
            f"(tid {shown}) are not on CPU {format_cpulist(cpus)}; bind before starting threads"
        )
    return "; ".join(said)


def _apply_memory(decided: Binding, strict: bool) -> Binding:
    if decided.memory_policy == "none" or not decided.memory_nodes:
        return decided
    reasons = [decided.reason] if decided.reason else []
    rc = _set_mempolicy(_MPOL[decided.memory_policy], decided.memory_nodes)
    if rc < 0:
        why = _refusal(-rc, decided.memory_policy, format_cpulist(decided.memory_nodes))
        if strict and decided.memory_policy == "bind":
            raise OSError(-rc, why)
        with _warned_lock:
            first = -rc not in _warned
            _warned.add(-rc)
        if first:
            import logging

            logging.getLogger("cpupin").warning("cpupin: %s", why)
        reasons.append(why)
        return replace(
            decided, memory_policy="none", memory_nodes=frozenset(), reason="; ".join(reasons)
        )
    others = len(_native.thread_stats()) - 1
    if others > 0:
        reasons.append(
            f"{others} other thread(s) already running keep their memory policy (a policy "
            "is per thread): bind before starting threads"
        )
    return replace(decided, reason="; ".join(reasons))


def memory_binding_check() -> tuple[bool, str]:
    """Whether this process may set a memory policy, by a harmless round trip:
    read the calling thread's policy and set the same one again."""
    try:
        mode, nodes = _native.get_mempolicy()
    except OSError as exc:
        return False, _refusal(exc.errno or errno.ENOSYS, "any", 0).replace(" on node 0", "")
    rc = _set_mempolicy(mode, nodes)
    if rc < 0:
        return False, _refusal(-rc, "any", 0).replace(" on node 0", "")
    return True, "set_mempolicy works here (the current policy was read and set again)"
