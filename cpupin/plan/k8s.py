"""The plan in Kubernetes' terms and in the NRI balloons policy's: pure.

Kubernetes chooses a container's CPUs itself: the kubelet's static CPU
manager gives a Guaranteed pod's whole-CPU containers CPUs of their own,
and its Topology Manager puts them on the node of the GPU the device plugin
gave. What a plan can say there is how many CPUs each rank's container
asks for, which CPUs the kubelet keeps for the system, and the kubelet
settings that make the rest follow. :func:`k8s_plan` makes the plan with
those constraints (every rank's CPUs its own; one core kept for the system,
off every step core); :func:`k8s_manifest` writes it as YAML a user
pastes; :func:`balloons_policy` writes the same plan as the NRI resource
policy plugin's ``BalloonsPolicy`` (``config.nri/v1alpha1``), a balloon a
rank, sized from the plan, close to its GPU. :func:`check_k8s_rank` is what
``cpupin verify`` checks inside a container: Kubernetes picks which CPUs,
so a rank is right when it has as many as the plan gives it, of its own,
on its GPU's node.

The YAML is written here (no YAML library at run time): mappings in
insertion order, every string a double-quoted scalar with anything but
printable ASCII escaped, so no value is ever read back as another type.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cpupin.cpulist import cpus_phrase, format_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host.topology import Host, cuda_gpus
from cpupin.plan.launch import LaunchPlan, plan_ranks
from cpupin.plan.placement import place

__all__ = [
    "BALLOON_ANNOTATION",
    "K8sPlan",
    "balloons_policy",
    "check_k8s_rank",
    "k8s_manifest",
    "k8s_plan",
    "parse_quantity",
    "to_yaml",
]

#: The pod annotation that puts a pod's containers in a balloon type.
BALLOON_ANNOTATION = "balloon.balloons.resource-policy.nri.io"
#: A memory quantity as Kubernetes writes one: a whole or decimal number and
#: an optional binary or decimal suffix.
_QUANTITY = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,6})?(?:[KMGTPE]i|[kMGTPE])?\Z", re.ASCII)


@dataclass(frozen=True)
class K8sPlan:
    """The rank plan, and the CPUs the kubelet keeps for the system."""

    plan: LaunchPlan
    reserved: frozenset[int]
    """One core's CPUs (``reservedSystemCPUs``), on no rank's step core."""
    full_cores: bool
    """Whether every rank's CPUs, and the reserved ones, are whole cores (the
    static policy's ``full-pcpus-only`` then holds)."""

    def as_dict(self) -> dict[str, object]:
        return {
            **self.plan.as_dict(),
            "reserved": sorted(self.reserved),
            "reserved_list": format_cpulist(self.reserved),
            "full_cores": self.full_cores,
        }


def parse_quantity(text: str) -> str:
    """A Kubernetes memory quantity (``64Gi``, ``500M``), as given; ValueError
    quoting anything else."""
    body = text.strip()
    if not _QUANTITY.match(body) or not any(c != "0" and c.isdigit() for c in body):
        raise ValueError(
            f"--rank-memory {excerpt(text)} is not a memory quantity such as 64Gi or 500M"
        )
    return body


def k8s_plan(
    host: Host,
    mask: frozenset[int],
    ranks: int,
    *,
    mode: str = "node",
    memory: str = "preferred",
    node: int | None = None,
) -> K8sPlan:
    """The plan for ``ranks`` containers of one node: one core kept for the
    system first (the static CPU manager needs one), then the ranks within
    the rest. :class:`PlanError` where two ranks would share a CPU (a
    container's CPUs are its own) or no core is left to keep."""
    mask = mask & host.cpus
    steps = _step_cpus(host, mask, ranks, node)
    reserved = _reserve(host, mask, steps)
    plan = plan_ranks(host, mask - reserved, ranks, mode=mode, memory=memory, node=node)
    seen: dict[int, int] = {}
    for rank, binding in enumerate(plan.ranks):
        for cpu in binding.cpus:
            other = seen.setdefault(cpu, rank)
            if other != rank:
                raise PlanError(
                    f"ranks {other} and {rank} both want CPU {cpu} (--mode {mode}): "
                    "Kubernetes gives each container CPUs of its own; plan with --mode "
                    "exclusive, which divides a node's cores among its ranks"
                )
    cores = [frozenset(core.cpus) for core in host.cores]
    whole = [reserved, *(b.cpus for b in plan.ranks)]
    full = all(not (c & part) or c <= part for c in cores for part in whole)
    return K8sPlan(plan, reserved, bool(host.smt) and full)


def _step_cpus(host: Host, mask: frozenset[int], ranks: int, node: int | None) -> frozenset[int]:
    """The CPUs ``auto`` would pin step and result threads on, for the
    ranks' GPUs: what the system's reserved core must stay off."""
    if node is not None:
        return frozenset()
    gpus = [g.address for g in cuda_gpus(host)[:ranks]]
    if not gpus:
        return frozenset()
    return place(host, mask, gpus, "auto").cpus


def _reserve(host: Host, mask: frozenset[int], steps: frozenset[int]) -> frozenset[int]:
    """The last core within the mask that holds no step CPU."""
    cores = sorted(
        (frozenset(core.cpus) & mask for core in host.cores if mask.intersection(core.cpus)),
        key=max,
        reverse=True,
    )
    if len(cores) < 2:
        raise PlanError(
            f"the mask {format_cpulist(mask)} has {len(cores)} core(s): Kubernetes' static "
            "CPU manager keeps at least one for the system, and a rank needs another; give "
            "a wider mask"
        )
    for core in cores:
        if not core & steps:
            return core
    raise PlanError(
        f"every core of the mask {format_cpulist(mask)} holds a rank's step threads: no core "
        "is left for the kubelet to keep for the system; give a wider mask or fewer --ranks"
    )


def _topology_policy(host: Host, k: K8sPlan) -> str:
    """``single-numa-node`` where every rank sits on one node, else
    ``restricted`` (which admits a container spanning the nodes it must)."""
    for binding in k.plan.ranks:
        if len({host.node_of(c) for c in binding.cpus}) > 1:
            return "restricted"
    return "single-numa-node"


def k8s_manifest(host: Host, k: K8sPlan, rank_memory: str, header: Sequence[str] = ()) -> str:
    """The kubelet's settings and each rank's container, as YAML documents."""
    plan = k.plan
    gpus = any(b.device for b in plan.ranks)
    kubelet: dict[str, object] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static",
    }
    if k.full_cores:
        kubelet["cpuManagerPolicyOptions"] = {"full-pcpus-only": "true"}
    kubelet["topologyManagerPolicy"] = _topology_policy(host, k)
    kubelet["topologyManagerScope"] = "container"
    kubelet["reservedSystemCPUs"] = format_cpulist(k.reserved)
    containers = []
    for rank, binding in enumerate(plan.ranks):
        amounts: dict[str, object] = {"cpu": str(len(binding.cpus)), "memory": rank_memory}
        if binding.device:
            amounts["nvidia.com/gpu"] = "1"
        containers.append(
            {
                "name": f"rank-{rank}",
                "env": [{"name": "LOCAL_RANK", "value": str(rank)}],
                "resources": {"requests": amounts, "limits": dict(amounts)},
            }
        )
    lines = [f"# {h}" for h in header]
    lines += [
        f"# kept for the system: {cpus_phrase(k.reserved)} (reservedSystemCPUs), off every "
        "rank's step core",
        "---",
        "# The node's kubelet: Guaranteed containers get CPUs of their own (static), "
        + ("on their GPU's NUMA node (Topology Manager)." if gpus else "on one NUMA node."),
    ]
    if gpus:
        lines.append(
            "# A GPU allocated through DRA (resource.k8s.io) is not aligned by the Topology "
            "Manager: request nvidia.com/gpu from the device plugin, as below."
        )
    lines += [to_yaml(kubelet), "---"]
    lines.append(
        "# Each rank's container: merge into the pod spec (requests == limits, whole CPUs: "
        "Guaranteed QoS)."
    )
    if plan.memory != "none":
        lines.append(
            f"# Memory {plan.memory} on the rank's node: start the command with cpupin exec "
            f"--local-rank --cpus keep --memory {plan.memory} -- ... (or the kubelet's "
            "memoryManagerPolicy: Static)."
        )
    lines.append(to_yaml({"containers": containers}))
    return "\n".join(lines) + "\n"


def _cstates(host: Host, max_us: int) -> list[str]:
    """The names of the host's idle states that wake slower than ``max_us``."""
    out: list[str] = []
    for states in host.idle_states.values():
        for state in states:
            if state.latency_us > max_us and state.name not in out:
                out.append(state.name)
    return out


def balloons_policy(
    host: Host, k: K8sPlan, wake_latency_us: int | None = None, header: Sequence[str] = ()
) -> str:
    """The plan as a ``BalloonsPolicy``: a balloon type a rank (its CPUs'
    count, close to its GPU, IRQs kept off, memory pinned where the plan
    binds it, and with ``wake_latency_us`` a CPU class that disables the
    idle states slower than it), then the shared pool for everything else."""
    plan = k.plan
    spec: dict[str, object] = {"reservedResources": {"cpu": f"cpuset:{format_cpulist(k.reserved)}"}}
    if plan.mask | k.reserved != host.cpus:
        spec["availableResources"] = {"cpu": f"cpuset:{format_cpulist(plan.mask | k.reserved)}"}
    spec["pinCPU"] = True
    spec["pinMemory"] = plan.memory != "none"
    disabled = _cstates(host, wake_latency_us) if wake_latency_us is not None else []
    types: list[dict[str, object]] = []
    for rank, binding in enumerate(plan.ranks):
        count = len(binding.cpus)
        kind: dict[str, object] = {
            "name": f"cpupin-rank-{rank}",
            "minCPUs": count,
            "maxCPUs": count,
            "minBalloons": 1,
            "maxBalloons": 1,
            "allocatorPriority": "high",
        }
        if binding.device:
            kind["preferCloseToDevices"] = [f"/sys/bus/pci/devices/{binding.device}"]
        if disabled:
            kind["cpuClass"] = "cpupin-step"
        kind["irqMode"] = "isolate"
        kind["preferSpreadOnPhysicalCores"] = False
        kind["hideHyperthreads"] = False
        kind["pinMemory"] = plan.memory != "none"
        types.append(kind)
    types.append({"name": "shared", "namespaces": ["*"], "shareIdleCPUsInSame": "system"})
    spec["balloonTypes"] = types
    if disabled:
        spec["control"] = {"cpu": {"classes": {"cpupin-step": {"disabledCstates": disabled}}}}
    policy = {
        "apiVersion": "config.nri/v1alpha1",
        "kind": "BalloonsPolicy",
        "metadata": {"name": "default", "namespace": "kube-system"},
        "spec": spec,
    }
    lines = [f"# {h}" for h in header]
    lines.append(
        f"# Put rank R's pod in its balloon with the annotation {BALLOON_ANNOTATION}: "
        "cpupin-rank-R; every other pod runs in the shared pool."
    )
    if wake_latency_us is None:
        lines.append(
            "# No CPU class: --wake-latency US adds one that disables the idle states slower "
            "than US µs on the ranks' CPUs."
        )
    elif not disabled:
        why = "lists no idle state" if not host.idle_states else "has none slower"
        lines.append(
            f"# No CPU class: this host {why} than {wake_latency_us} µs to disable "
            "(--wake-latency)."
        )
    lines.append(to_yaml(policy))
    return "\n".join(lines) + "\n"


def check_k8s_rank(
    k: K8sPlan,
    rank: int,
    cpus: frozenset[int],
    qos: str | None,
    host: Host,
    gpu_node: int | None = None,
    *,
    balloons: bool = False,
) -> list[str]:
    """What differs between rank ``rank``'s plan and the CPUs Kubernetes
    gave its container: their count, whether they are its own (Guaranteed
    QoS, not the node's shared pool) and their node (``gpu_node``, the node
    of the GPU the container sees, else the plan's). With ``balloons`` the
    CPUs came from the NRI balloons policy, which pins a pod of any QoS
    class. A finding a line."""
    want = k.plan.ranks[rank]
    count = len(want.cpus)
    want_nodes = (
        frozenset({gpu_node})
        if gpu_node is not None
        else frozenset(n for n in map(host.node_of, want.cpus) if n is not None)
    )
    nodes = frozenset(n for n in map(host.node_of, cpus) if n is not None)
    where = f"{cpus_phrase(cpus)} on node {format_cpulist(nodes) or '?'}"
    wanted = f"{count} CPU(s) of its own on node {format_cpulist(want_nodes) or '?'}"
    out = []
    # The kubelet never gives its reserved CPUs to a container of its own:
    # a container that has them runs in the node's shared pool.
    shared = bool(cpus & k.reserved) and len(cpus) > count
    if balloons:
        # A balloon holds exactly its minCPUs == maxCPUs: more is a pool.
        if len(cpus) > count:
            out.append(
                f"rank {rank}: {where}, the shared pool; plan wants {wanted}: annotate its pod "
                f"{BALLOON_ANNOTATION}: cpupin-rank-{rank} (cpupin plan --emit nri-balloons "
                "made the balloon)"
            )
        elif len(cpus) != count:
            out.append(
                f"rank {rank}: {where}, plan wants {wanted}: its balloon's minCPUs and maxCPUs "
                f"are {count} in the policy cpupin plan --emit nri-balloons prints"
            )
    elif qos != "Guaranteed":
        out.append(
            f"rank {rank}: {where}, Kubernetes' shared pool (QoS {qos or 'unknown'}); plan "
            f'wants {wanted}: give its container requests == limits with cpu: "{count}" and '
            "memory (cpupin plan --emit k8s prints them)"
        )
    elif shared:
        out.append(
            f"rank {rank}: {where}, the node's shared pool although the pod is Guaranteed; "
            f"plan wants {wanted}: the kubelet's cpuManagerPolicy is not static"
        )
    elif len(cpus) != count:
        out.append(
            f'rank {rank}: {where}, plan wants {wanted}: its container asks for cpu: "{count}"'
        )
    if not out and not nodes <= want_nodes:
        gpu = f" (GPU {want.device}'s)" if want.device and gpu_node is None else ""
        how = (
            "the balloon type's preferCloseToDevices names the GPU; is the policy the one "
            "cpupin plan --emit nri-balloons prints?"
            if balloons
            else "the kubelet's topologyManagerPolicy single-numa-node (or restricted) aligns "
            "a device-plugin GPU with its CPUs; a DRA GPU is not aligned"
        )
        out.append(
            f"rank {rank}: {where}, plan wants them on node {format_cpulist(want_nodes)}{gpu}: "
            + how
        )
    return out


# --- YAML -------------------------------------------------------------------

#: A key written bare: it starts with a letter, and is none of the words
#: YAML reads as a boolean or null.
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*\Z", re.ASCII)
_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n"})


def to_yaml(value: object, indent: int = 0) -> str:
    """``value`` (mappings, lists, strings, whole numbers, booleans) as
    block-style YAML."""
    return "\n".join(_lines(value, indent))


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _quoted(value)
    raise TypeError(f"no YAML for {type(value).__name__}")


def _quoted(text: str) -> str:
    """A double-quoted YAML scalar: printable ASCII as is, anything else
    escaped (``\\uXXXX``, ``\\UXXXXXXXX``), so it reads back as written."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        elif ord(c) <= 0xFFFF:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def _key(key: object) -> str:
    text = str(key)
    return text if _KEY.match(text) and text.lower() not in _WORDS else _quoted(text)


def _lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        out = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{_key(key)}:")
                out += _lines(item, indent + (0 if isinstance(item, list) else 2))
            else:
                out.append(f"{pad}{_key(key)}: {_inline(item)}")
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0][indent + 2 :]}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(value)]


def _inline(value: object) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)
