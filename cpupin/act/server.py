"""What a runtime's API server calls at startup, and what it passes on.

:func:`plan_server` reads the host, resolves the device list, places the
server's threads, claims its GPUs under ``auto``, and returns a
:class:`ServerPlan`, whose :meth:`~ServerPlan.child_env` gives the
environment for the processes the server spawns, so that a server that
stands aside makes its workers stand aside too. The module-level
:func:`child_env` passes on the process mask alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpupin.cpulist import format_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host._pmqos import MAX_US
from cpupin.host.topology import Host, cuda_gpus, parse_pci_address, read_host
from cpupin.plan.cpuplan import CpuPlan
from cpupin.plan.placement import ENV_SETTING, Placement, parse_setting, place, setting_from_env
from cpupin.process.mask import ENV_PROCESS_CPUS, process_cpus, start_time
from cpupin.registry import writer as registry
from cpupin.registry.lock import Claim, claim_gpus

if TYPE_CHECKING:
    from cpupin.act.wake import WakeHold

__all__ = [
    "ServerPlan",
    "child_env",
    "cuda_gpus",
    "parse_visible_devices",
    "plan_server",
    "resolve_devices",
]

log = logging.getLogger("cpupin")

#: OpenMP runtimes that pin their own threads when these are set.
OPENMP_AFFINITY_VARS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def resolve_devices(
    entries: Iterable[object],
    host: Host,
    environ: Mapping[str, str] | None = None,
    *,
    strict: bool = True,
) -> tuple[str, ...]:
    """PCI addresses for a device list.

    An entry is a PCI address in any spelling, or a device index (an int, or
    digits), which counts the devices ``CUDA_VISIBLE_DEVICES`` makes visible
    (:func:`parse_visible_devices`: indexes, or GPU UUIDs through ``pynvml``
    when it is installed) and those count the host's CUDA devices
    (:func:`cuda_gpus`: NVIDIA's) in PCI order, as ``nvidia-smi`` and
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` number them. Raises :class:`PlanError`
    naming an entry that cannot be resolved; with ``strict=False`` such an
    entry stays as its text, a worker slot (what a CPU-number setting needs
    on a host without GPUs).
    """
    if not strict:
        out: list[str] = []
        for entry in entries:
            try:
                out.extend(resolve_devices([entry], host, environ))
            except PlanError:
                out.append(str(entry))
        return tuple(out)
    env = os.environ if environ is None else environ
    out = []
    for entry in entries:
        if isinstance(entry, int) and not isinstance(entry, bool):
            index = entry
        elif isinstance(entry, str) and entry.strip().isascii() and entry.strip().isdigit():
            index = int(entry.strip())
        elif isinstance(entry, str):
            try:
                out.append(parse_pci_address(entry))
            except ValueError:
                raise PlanError(
                    f"device {entry!r} is neither a PCI address such as "
                    "0000:3b:00.0 nor a device index"
                ) from None
            continue
        else:
            raise PlanError(f"device {entry!r} is neither a PCI address nor a device index")
        out.append(_by_index(index, host, env))
    return tuple(out)


def parse_visible_devices(text: str) -> list[int] | list[str]:
    """``CUDA_VISIBLE_DEVICES`` read as the CUDA runtime reads it: device
    ordinals, or GPU or MIG UUIDs (``GPU-…``, ``MIG-…``, possibly cut short).

    - An ordinal entry is read like ``strtoul``: leading spaces and a sign,
      then the digits it starts with (``1gpu`` is 1). A negative one
      (``-1``) or one that is not a number ends the list there: what came
      before stays visible, nothing after it.
    - A UUID list (the variable starts with the prefix) keeps its entries
      while they start with it.
    - An entry named twice makes no device visible at all.

    ``""`` and ``"-1"`` give no device. Pure; never raises."""
    entries = text.split(",")
    for prefix in ("GPU-", "MIG-"):
        if text.startswith(prefix):
            uuids: list[str] = []
            for entry in entries:
                if not entry.startswith(prefix):
                    break
                if entry in uuids:
                    return []
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in entries:
        n = _leading_number(entry)
        if n is None or n < 0:
            break
        if n in ordinals:
            return []
        ordinals.append(n)
    return ordinals


def _leading_number(text: str) -> int | None:
    """The number ``text`` starts with (after spaces, with a sign), as
    ``strtol`` reads it; ``None`` when it starts with none. Bounded: at
    most 19 digits are read."""
    text = text.lstrip()
    sign = 1
    if text[:1] in ("+", "-"):
        sign = -1 if text[0] == "-" else 1
        text = text[1:]
    digits = 0
    while digits < len(text) and digits < 19 and "0" <= text[digits] <= "9":
        digits += 1
    return sign * int(text[:digits]) if digits else None


def _by_index(index: int, host: Host, env: Mapping[str, str]) -> str:
    if index < 0:
        raise PlanError(f"device index {index} is negative")
    gpus = cuda_gpus(host)
    amd = bool(gpus) and gpus[0].vendor == "amd"
    name = "HIP_VISIBLE_DEVICES" if amd and "HIP_VISIBLE_DEVICES" in env else "CUDA_VISIBLE_DEVICES"
    visible = env.get(name)
    if visible is not None:
        listed = parse_visible_devices(visible)
        # CUDA stops at an ordinal past the devices it has, as at any
        # invalid entry.
        if listed and isinstance(listed[0], int):
            cut = [n for n in listed if isinstance(n, int)]
            for at, n in enumerate(cut):
                if n >= len(gpus):
                    listed = cut[:at]
                    break
        if index >= len(listed):
            raise PlanError(
                f"device index {index} is past {name}={excerpt(visible)}, which makes "
                f"{len(listed)} device(s) visible (read as the CUDA runtime reads it: it stops "
                "at the first entry that is not a device, and -1 means none)"
            )
        item = listed[index]
        if isinstance(item, str):
            return _by_uuid(item)
        index = item
    if index >= len(gpus):
        kind = "AMD" if amd else "NVIDIA" if gpus and gpus[0].vendor == "nvidia" else ""
        raise PlanError(
            f"device index {index} is past the host's {len(gpus)} {kind + ' ' if kind else ''}"
            "GPU(s)"
        )
    return gpus[index].address


def _by_uuid(uuid: str) -> str:
    try:
        import pynvml
    except ImportError:
        raise PlanError(
            f"CUDA_VISIBLE_DEVICES names {uuid!r}, a UUID: resolving it needs "
            "pynvml (pip install 'cpupin[nvml]'), or give PCI addresses"
        ) from None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
    except Exception as exc:  # noqa: BLE001 - NVML raises its own error types
        raise PlanError(f"NVML cannot resolve {uuid!r}: {exc}") from None
    return parse_pci_address(bus_id.decode() if isinstance(bus_id, bytes) else bus_id)


@dataclass(frozen=True)
class ServerPlan:
    """What :func:`plan_server` decided: the placement, the claim that
    backs it (``auto`` only) and the process's CPU plan."""

    placement: Placement
    claim: Claim | None
    cpu_plan: CpuPlan
    host: Host
    wake_hold: WakeHold | None = None
    """The hold on the wake latency of the pinned CPUs (``wake_latency_us``),
    released with :meth:`release_wake_hold` or at exit."""
    wake_refused: str = ""
    """Why a hold that was asked for was not taken; empty otherwise."""

    def release_wake_hold(self) -> list[str]:
        """End the hold on the pinned CPUs' wake latency, if any."""
        return self.wake_hold.release() if self.wake_hold is not None else []

    @property
    def pinned(self) -> bool:
        return self.placement.pinned

    @property
    def stood_aside(self) -> bool:
        """Whether ``auto`` was asked for and pins nothing (a rule it cannot
        meet, OpenMP's own affinity, another server holding a GPU)."""
        return self.placement.setting == "auto" and not self.placement.pinned

    def child_env(
        self, base: Mapping[str, str] | None = None, *, pools: bool = True
    ) -> dict[str, str]:
        """The environment for a process this server spawns: :func:`child_env`
        of ``base``, with ``CPUPIN_STEP_THREAD_CORE=off`` when this server
        stood aside, so that the workers of a refused server pin nothing
        either, and (``pools=True``) the pool variables capped to the CPUs
        the plan leaves (:func:`cpupin.pools.limits.pool_env`: a value the user set
        is kept)."""
        env = child_env(base)
        if self.stood_aside:
            env[ENV_SETTING] = "off"
        if pools:
            from cpupin.pools.limits import pool_env

            env = pool_env(self.cpu_plan, env)[0]
        return env

    def as_dict(self) -> dict[str, object]:
        return {
            "placement": self.placement.as_dict(),
            "claim": None if self.claim is None else self.claim.reason,
            "pool_size": self.cpu_plan.pool_size(),
            "usable_cpus": self.cpu_plan.usable_cpus,
        }


def plan_server(
    setting: object,
    devices: Sequence[object],
    *,
    root: str | os.PathLike[str] = "/",
    mask: Iterable[int] | None = None,
    lock_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    wake_latency_us: int | None = None,
) -> ServerPlan:
    """Plan a server at startup: read the host, place, claim under ``auto``.

    ``setting`` is the runtime's config value (``None`` reads
    ``CPUPIN_STEP_THREAD_CORE``). Raises :class:`PlanError` for a bad setting
    or a CPU number that cannot be honoured. Under ``auto`` anything that
    stops pinning (a rule, OpenMP's own affinity, another server holding a
    GPU) pins nothing and logs a warning naming it; the plan's
    :meth:`ServerPlan.child_env` then turns its workers' setting off.

    ``wake_latency_us`` (``None``: ``CPUPIN_WAKE_LATENCY_US``, unset for
    none) holds the wake latency of the CPUs the plan pins, step and result
    CPUs only (:func:`cpupin.hold_wake_latency`, ``0``: they poll when
    idle), for as long as the process lives or until
    :meth:`ServerPlan.release_wake_hold`. A hold the host refuses (no root,
    no cpuidle, a container) leaves the plan as it is, with a warning and
    :attr:`ServerPlan.wake_refused`.
    """
    env = os.environ if environ is None else environ
    hold_us = wake_latency_from_env(env) if wake_latency_us is None else wake_latency_us
    if hold_us is not None and (type(hold_us) is not int or not 0 <= hold_us <= MAX_US):
        raise PlanError(
            f"wake_latency_us={excerpt(hold_us)}: give whole µs from 0 to {MAX_US} (0: the "
            "pinned CPUs poll when idle), or None to hold nothing"
        )
    value = setting_from_env(env) if setting is None else parse_setting(setting)
    host = read_host(root)
    allowed = (frozenset(mask) if mask is not None else process_cpus()) & host.cpus
    # Under a CPU number, or on a host without GPUs, the devices are only
    # worker slots.
    entries = resolve_devices(devices, host, env, strict=value == "auto" and bool(host.gpus))
    placement = place(host, allowed, entries, value)
    claim = None
    if value == "auto":
        openmp = [name for name in OPENMP_AFFINITY_VARS if env.get(name)]
        if openmp and placement.pinned:
            placement = placement.unpinned(
                f"{' and '.join(openmp)} set: the OpenMP runtime pins its threads itself, so "
                f"auto pins nothing; unset {' and '.join(openmp)} to let cpupin place them"
            )
        if placement.pinned:
            claim = claim_gpus(entries, lock_dir)
            if not claim:
                placement = placement.unpinned(f"nothing pinned: {claim.reason}")
            else:
                _write_record(claim, placement, allowed)
        if not placement.pinned:
            log.warning("cpupin auto: %s", placement.reason)
    cpu_plan = CpuPlan.for_host(host, allowed, placement.cpus)
    hold, refused = None, ""
    if os.fspath(root) == "/":  # this process's own plan, not a tree's
        _relimit(cpu_plan, placement)
        if hold_us is not None and placement.pinned:
            hold, refused = _hold(placement, hold_us)
    return ServerPlan(placement, claim, cpu_plan, host, hold, refused)


#: The variable that asks :func:`plan_server` to hold the pinned CPUs' wake latency.
ENV_WAKE_LATENCY = "CPUPIN_WAKE_LATENCY_US"


def wake_latency_from_env(environ: Mapping[str, str]) -> int | None:
    """``CPUPIN_WAKE_LATENCY_US`` as a number of µs (unset or empty: ``None``).
    :class:`PlanError` naming the value for anything else."""
    value = environ.get(ENV_WAKE_LATENCY)
    if value is None or value == "":
        return None
    body = value.strip()
    if not (body.isascii() and body.isdigit() and len(body) <= 10 and int(body) <= MAX_US):
        raise PlanError(
            f"{ENV_WAKE_LATENCY}={excerpt(value)}: not a whole number of µs from 0 to {MAX_US} "
            "(0: the pinned CPUs poll when idle); unset it to hold nothing"
        )
    return int(body)


def _hold(placement: Placement, max_us: int) -> tuple[WakeHold | None, str]:
    from cpupin.act.wake import HoldRefused, hold_wake_latency

    try:
        hold = hold_wake_latency(placement.cpus, max_us)
    except HoldRefused as exc:
        why = f"wake latency of CPUs {format_cpulist(placement.cpus)} not held: {exc.strerror}"
        log.warning("cpupin: %s", why)
        return None, why
    return hold, ""


def _relimit(cpu_plan: CpuPlan, placement: Placement) -> None:
    """Where this process capped its pools before planning (the README's
    one-process recipe calls limit_pools() first), lower them to what the
    plan leaves beside the CPUs it pins: the order of the two calls does
    not matter."""
    from cpupin.pools import limits as pools

    if not pools._limited_here or not placement.pinned:
        return
    limits = pools.limit_pools(cpu_plan)
    if limits.set:
        log.info("cpupin: pools lowered to what the plan leaves: %s", limits)


def _write_record(claim: Claim, placement: Placement, mask: frozenset[int]) -> None:
    """The server's record in its lock files, for ``cpupin ps`` and audits."""
    pid = os.getpid()
    why = claim.write_record(
        {
            "version": registry.VERSION,
            "pid": pid,
            "start_time": start_time(pid) or 0,
            "uid": os.geteuid(),
            "time": round(time.time(), 3),
            "setting": str(placement.setting),
            "devices": list(placement.devices),
            "workers": [{"device": w.device, "cpus": list(w.cpus)} for w in placement.workers],
            "result_cpu": placement.result_cpu,
            "process_mask": sorted(mask),
        }
    )
    if why:
        log.debug("cpupin: no record in the lock files: %s", why)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) with this process's mask
    in ``CPUPIN_PROCESS_CPUS``: a child started from a pinned thread would
    otherwise take that pin for its whole mask.

    Only the process mask: a server passes its plan's decision on with
    :meth:`ServerPlan.child_env`, which also turns the workers' setting off
    when the server stood aside.
    """
    env = dict(os.environ if base is None else base)
    try:
        env[ENV_PROCESS_CPUS] = format_cpulist(process_cpus())
    except OSError:  # no affinity on this platform
        pass
    return env
