"""Where a server's threads go: the ``auto | off | <cpu>`` rules of
docs/placement.md, as a pure function of (host, mask, devices, setting).

:func:`place` does no I/O and talks to no other process; servers on different
GPUs of one host never take the same CPU because each derives its CPUs from
its GPU's rank among the host's GPUs (one documented exception: a split
config's extra worker and an off-node GPU under the same mask). Where a rule
cannot be met, nothing is pinned and :attr:`Placement.reason` says why.

Choices where docs/placement.md is silent:

- ``"off"``/``"auto"`` are matched case-insensitively; a CPU number is ASCII
  digits only (leading zeros allowed).
- A core that spans two nodes (never seen) belongs to the node of its lowest
  allowed CPU.
- Under a CPU number the devices are only worker slots: they need not be GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from cpupin.cpulist import format_cpulist
from cpupin.errors import PlanError
from cpupin.host.topology import Gpu, Host, parse_pci_address

__all__ = [
    "ENV_SETTING",
    "Placement",
    "Setting",
    "WorkerPlacement",
    "parse_setting",
    "place",
    "setting_from_env",
]

#: The environment variable a runtime reads the setting from.
ENV_SETTING = "CPUPIN_STEP_THREAD_CORE"

Setting = Literal["off", "auto"] | int

_ACCEPTED = "'off' (the default), 'auto', or a CPU number such as 5"


def parse_setting(value: object) -> Setting:
    """The setting from a config value or an environment string.

    ``None`` and ``False`` (YAML's unquoted ``off``) mean ``"off"``; ``"off"``
    and ``"auto"`` in any case, with white space around, and a non-negative
    int or string of ASCII digits are accepted. Anything else (``True``,
    ``"on"``, ``"-1"``, ``"0x5"``, ``"5.0"``, ``"1_0"``, non-ASCII digits, the
    empty string) raises :class:`PlanError` listing the accepted forms.
    """
    if value is None or value is False:
        return "off"
    if isinstance(value, bool):
        raise PlanError(f"step_thread_core {value!r} is not a setting: use {_ACCEPTED}")
    if isinstance(value, int):
        if value < 0:
            raise PlanError(f"step_thread_core {value} is not a CPU number: use {_ACCEPTED}")
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("off", "auto"):
            return text.lower()  # type: ignore[return-value]
        if text and text.isascii() and text.isdigit():
            return int(text)
    raise PlanError(f"step_thread_core {value!r} is not a setting: use {_ACCEPTED}")


def setting_from_env(environ: Mapping[str, str] | None = None) -> Setting:
    """The setting in ``CPUPIN_STEP_THREAD_CORE`` (unset: ``"off"``)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_SETTING)
    if value is None:
        return "off"
    try:
        return parse_setting(value)
    except PlanError as exc:
        raise PlanError(f"{ENV_SETTING}={value!r}: {exc}") from None


@dataclass(frozen=True)
class WorkerPlacement:
    """One worker: its device and the CPUs its step threads share."""

    device: str
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where one server's threads go; ``workers`` is empty and ``result_cpu``
    ``None`` when nothing is pinned."""

    setting: Setting
    devices: tuple[str, ...]
    pinned: bool
    reason: str
    workers: tuple[WorkerPlacement, ...] = ()
    result_cpu: int | None = None

    @property
    def step_cpus(self) -> tuple[tuple[int, ...], ...]:
        """Each worker's step CPUs, in device-list order."""
        return tuple(w.cpus for w in self.workers)

    @property
    def cpus(self) -> frozenset[int]:
        """Every CPU this placement pins: the step cores and the result CPU."""
        out = {cpu for w in self.workers for cpu in w.cpus}
        if self.result_cpu is not None:
            out.add(self.result_cpu)
        return frozenset(out)

    def unpinned(self, reason: str) -> Placement:
        """The same server, pinning nothing, for ``reason``."""
        return Placement(self.setting, self.devices, False, reason)

    def as_dict(self) -> dict[str, object]:
        return {
            "setting": str(self.setting),
            "devices": list(self.devices),
            "pinned": self.pinned,
            "reason": self.reason,
            "workers": [{"device": w.device, "cpus": list(w.cpus)} for w in self.workers],
            "result_cpu": self.result_cpu,
        }


def _canonical(device: str) -> str:
    try:
        return parse_pci_address(device)
    except ValueError:
        return device


def _allowed_cores(host: Host, allowed: frozenset[int]) -> list[tuple[int, ...]]:
    cores = [tuple(c for c in core.cpus if c in allowed) for core in host.cores]
    return sorted((c for c in cores if c), key=lambda c: c[0])


def _by_class(host: Host, cores: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``cores`` (in CPU order) with the highest class first: the order of
    every pool of docs/placement.md. Unchanged on a host of one class."""
    if len(host.classes) < 2:
        return cores
    rank = {cpu: core.rank for core in host.cores for cpu in core.cpus}
    return sorted(cores, key=lambda c: (rank.get(c[0], 0), c[0]))


class _Pools:
    """P(n), G(n), O and L of docs/placement.md for one host and mask."""

    def __init__(self, host: Host, cores: list[tuple[int, ...]]) -> None:
        cores = _by_class(host, cores)
        node_of = {cpu: node.id for node in host.nodes for cpu in node.cpus}
        self.by_node: dict[int, list[tuple[int, ...]]] = {}
        for core in cores:
            node = node_of.get(core[0])
            if node is not None:
                self.by_node.setdefault(node, []).append(core)
        self.gpus_on: dict[int, list[Gpu]] = {}
        for gpu in host.gpus:
            if gpu.node is not None:
                self.gpus_on.setdefault(gpu.node, []).append(gpu)
        self.off_node = [g for g in host.gpus if not self.is_local(g)]
        reserved: set[tuple[int, ...]] = set()
        for node, pool in self.by_node.items():
            k = len(self.gpus_on.get(node, ()))
            if k:
                reserved.update(pool[:k])
                reserved.update(pool[-k:])
        self.leftover = [core for core in cores if core not in reserved]

    def is_local(self, gpu: Gpu) -> bool:
        return gpu.node is not None and bool(self.by_node.get(gpu.node))

    def pool(self, gpu: Gpu) -> tuple[list[tuple[int, ...]], list[Gpu], str]:
        """(Q, K, where) for ``gpu``."""
        if self.is_local(gpu):
            node = gpu.node
            assert node is not None
            return self.by_node[node], self.gpus_on[node], f"node {node}"
        return self.leftover, self.off_node, "off their node"


def _place_auto(host: Host, allowed: frozenset[int], devices: tuple[str, ...]) -> Placement:
    def none(reason: str) -> Placement:
        return Placement("auto", devices, False, reason)

    if not devices:
        return none("no device to place: give the server's worker devices")
    if not host.gpus:
        return none(
            "the host has no GPU (no display-class PCI function of NVIDIA, AMD or "
            "Intel under sys/bus/pci/devices), so auto has nothing to rank by; "
            "name a CPU to pin anyway"
        )
    by_address = {g.address: g for g in host.gpus}
    for device in devices:
        if device not in by_address:
            return none(
                f"device {device} is not one of the host's GPUs "
                f"({', '.join(by_address)}); give their PCI addresses or indexes"
            )
    cores = _allowed_cores(host, allowed)
    pools = _Pools(host, cores)
    workers = []
    notes = []
    seen: dict[str, int] = {}
    for device in devices:
        gpu = by_address[device]
        q, k, where = pools.pool(gpu)
        rank = k.index(gpu)
        if len(q) < 2 * len(k):
            label = "GPUs off their node" if where == "off their node" else where
            return none(
                f"{label}: {len(q)} core(s) for {len(k)} GPU(s), and each needs two; "
                f"widen the mask or name a CPU (the mask is {format_cpulist(allowed)})"
            )
        j = seen.get(device, 0)
        seen[device] = j + 1
        index = rank + j * len(k)
        if index >= len(q) - len(k):
            return none(
                f"worker {j + 1} on GPU {device} runs past the middle of its pool "
                f"({where}: {len(q)} core(s) for {len(k)} GPU(s)); widen the mask, "
                "use fewer workers a GPU, or name a CPU"
            )
        if j > 0 and pools.off_node:
            notes.append(
                f"the split worker on {device} takes core {format_cpulist(q[index])} "
                "from the middle of its pool, which a server on a GPU off its node "
                "may also take under this mask"
            )
        workers.append(WorkerPlacement(device, q[index]))
    first = by_address[devices[0]]
    q, k, where = pools.pool(first)
    result = min(q[len(q) - 1 - k.index(first)])
    steps = "; ".join(f"{w.device} on {format_cpulist(w.cpus)}" for w in workers)
    reason = f"auto: step threads {steps}; result threads on {result}"
    if notes:
        reason += " (note: " + "; ".join(notes) + ")"
    return Placement("auto", devices, True, reason, tuple(workers), result)


def _place_cpu(
    host: Host, allowed: frozenset[int], devices: tuple[str, ...], first: int
) -> Placement:
    mask = format_cpulist(allowed) if allowed else "(empty)"
    if first not in allowed:
        raise PlanError(
            f"step_thread_core {first} is outside the process mask {mask}: name "
            "one of its CPUs, or use auto"
        )
    cores = _allowed_cores(host, allowed)
    result = max(allowed)
    start = next(core[0] for core in cores if first in core)
    upward = [core for core in cores if core[0] >= start and result not in core]
    if len(upward) < len(devices):
        lower = "name a lower CPU, " if any(core[0] < start for core in cores) else ""
        raise PlanError(
            f"step_thread_core {first} leaves no allowed CPU for worker "
            f"{len(upward)} in {mask}: {lower}widen the mask, or run fewer workers"
        )
    workers = tuple(WorkerPlacement(d, upward[k]) for k, d in enumerate(devices))
    steps = "; ".join(f"worker {k} on {format_cpulist(w.cpus)}" for k, w in enumerate(workers))
    reason = f"step_thread_core {first}: {steps}; result threads on {result}"
    if first not in workers[0].cpus:
        reason += (
            f" (CPU {first} shares its core with the result CPU {result}, so the workers "
            "start at the next core)"
        )
    return Placement(
        first,
        devices,
        True,
        reason,
        workers,
        result,
    )


def place(host: Host, mask: Iterable[int], devices: Sequence[str], setting: object) -> Placement:
    """Where one server's threads go: a pure function of its four inputs.

    ``devices`` is the server's device list, one worker an entry (an entry
    may repeat: a split config), as PCI addresses in any spelling. ``mask`` is
    the process mask; the allowed CPUs are it and the online CPUs.

    ``"off"`` pins nothing. ``"auto"`` applies docs/placement.md's rules, and where
    one cannot be met pins nothing with a reason that names the numbers and
    what to do. A CPU number places the workers upward from its core and the
    result threads on the highest allowed CPU, and raises :class:`PlanError`
    when it cannot.
    """
    value = parse_setting(setting)
    allowed = frozenset(mask) & host.cpus
    entries = tuple(_canonical(str(d)) for d in devices)
    if value == "off":
        return Placement(
            "off",
            entries,
            False,
            "step_thread_core is off (the default): "
            "nothing pinned; see `cpupin doctor` for whether pinning pays here",
        )
    if value == "auto":
        return _place_auto(host, allowed, entries)
    assert isinstance(value, int)
    return _place_cpu(host, allowed, entries, value)
