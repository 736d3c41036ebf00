"""A plan for the local ranks a launcher starts, in its own terms: pure.

:func:`plan_ranks` decides, for each local rank of one node, what
:func:`~cpupin.plan.binding.decide_binding` decides for one worker: on a
host with GPUs, rank ``r`` is the ``r``-th CUDA device (PCI order, as
``cpupin exec --local-rank`` counts it) and takes the binding ``mode``
chooses for it; with ``node`` (a host without GPUs, or any host), the ranks
divide that node's cores within the mask, SMT siblings together, as
``exclusive`` divides a GPU's node among its GPUs.

:func:`slurm_options` writes the plan as ``srun`` options (or, for a batch
script, ``#SBATCH`` lines and the variable its ``srun`` steps read), and
raises :class:`~cpupin.errors.PlanError` for a plan Slurm cannot express.
:func:`check_rank` compares what a launched rank has with what the plan
gives it: what ``cpupin verify`` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cpupin.cpulist import MAX_CPUS, cpus_phrase, format_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host.topology import Host, cuda_gpus
from cpupin.plan.binding import CPU_MODES, Binding, check_memory, decide_binding

__all__ = [
    "ENV_PLAN_MASK",
    "MAX_RANKS",
    "LaunchPlan",
    "check_rank",
    "hex_mask",
    "parse_hex_mask",
    "plan_ranks",
    "slurm_options",
]

#: The variable that carries the mask a plan was made within into the
#: processes launched with it, so that ``cpupin verify`` plans within it too
#: (a Slurm allocation smaller than the node). Hex, as Slurm writes masks:
#: ``0x3``.
ENV_PLAN_MASK = "CPUPIN_PLAN_MASK"
#: The most local ranks a plan takes.
MAX_RANKS = 4096
#: The modes a plan takes (a CPU list names one rank's CPUs, not a plan).
PLAN_MODES: tuple[str, ...] = tuple(m for m in CPU_MODES if m != "keep")


@dataclass(frozen=True)
class LaunchPlan:
    """Where each local rank of one node goes."""

    mask: frozenset[int]
    """The CPUs the plan was made within (the launcher's allocation)."""
    mode: str
    memory: str
    node: int | None
    """The node the ranks divide (``--node``); ``None``: a rank a GPU."""
    ranks: tuple[Binding, ...]
    """Rank ``r``'s binding: its GPU (``device``), node, CPUs, memory."""
    whole_host: bool
    """Whether the mask is every online CPU of the host (planned outside
    any allocation: the launcher must give the job the whole node)."""

    def as_dict(self) -> dict[str, object]:
        return {
            "mask": sorted(self.mask),
            "mask_list": format_cpulist(self.mask),
            "mode": self.mode,
            "memory": self.memory,
            "node": self.node,
            "ranks": [{"rank": r, **b.as_dict()} for r, b in enumerate(self.ranks)],
        }


def plan_ranks(
    host: Host,
    mask: frozenset[int],
    ranks: int,
    *,
    mode: str = "node",
    memory: str = "preferred",
    node: int | None = None,
) -> LaunchPlan:
    """The plan for ``ranks`` local ranks on ``host`` within ``mask``.

    :class:`ValueError` for a bad argument, :class:`PlanError` for a plan the
    host cannot hold (more ranks than GPUs, or than the node's cores)."""
    if type(ranks) is not int or not 1 <= ranks <= MAX_RANKS:
        raise ValueError(
            f"--ranks {excerpt(ranks)}: give a number of local ranks, 1 to {MAX_RANKS}"
        )
    if mode not in PLAN_MODES:
        raise ValueError(f"--mode {excerpt(mode)}: use {', '.join(PLAN_MODES)}")
    check_memory(memory)
    mask = mask & host.cpus
    if not mask:
        raise PlanError("the mask names no online CPU of the host: nothing to plan within")
    if node is not None:
        bindings = _divide_node(host, mask, ranks, mode, memory, node)
    else:
        gpus = cuda_gpus(host)
        if not gpus:
            raise PlanError(
                "this host has no GPU to give each rank: name the node the ranks divide "
                "with --node N"
            )
        if ranks > len(gpus):
            raise PlanError(
                f"{ranks} ranks for the host's {len(gpus)} GPU(s): a rank a GPU; give "
                f"--ranks {len(gpus)} or fewer, or --node N to divide a node's cores"
            )
        bindings = tuple(
            decide_binding(host, mask, device=g.address, cpus=mode, memory=memory)
            for g in gpus[:ranks]
        )
    return LaunchPlan(mask, mode, memory, node, bindings, mask == host.cpus)


def _divide_node(
    host: Host, mask: frozenset[int], ranks: int, mode: str, memory: str, node: int
) -> tuple[Binding, ...]:
    if mode not in ("node", "exclusive"):
        raise ValueError(
            f"--mode {mode} with --node: the ranks divide the node's cores (node or exclusive); "
            "socket and cache choose by a rank's GPU"
        )
    ids = {n.id for n in host.nodes}
    if node not in ids:
        raise PlanError(
            f"node {node} is not a node of this host (its nodes: {format_cpulist(ids) or 'none'})"
        )
    node_cpus = next(n.cpus for n in host.nodes if n.id == node)
    local = node_cpus & mask
    cores = [c for c in (frozenset(core.cpus) & local for core in host.cores) if c]
    if len(cores) < ranks:
        raise PlanError(
            f"node {node} has {len(cores)} core(s) in the mask {format_cpulist(mask)} for "
            f"{ranks} ranks: a rank needs a core of its own; give --ranks {len(cores) or 1} "
            "or fewer, or a wider mask"
        )
    share, extra = divmod(len(cores), ranks)
    out = []
    for rank in range(ranks):
        start = rank * share + min(rank, extra)
        end = start + share + (1 if rank < extra else 0)
        cpus = frozenset(cpu for core in cores[start:end] for cpu in core)
        binding = decide_binding(host, mask, cpus=cpus, memory=memory)
        out.append(replace(binding, node=node, mode="exclusive"))
    return tuple(out)


def hex_mask(cpus: frozenset[int]) -> str:
    """CPUs as Slurm writes a mask: ``0x`` and hex digits, CPU 0 lowest."""
    return f"{sum(1 << c for c in cpus):#x}"


def parse_hex_mask(text: str) -> frozenset[int]:
    """A mask as :func:`hex_mask` writes it (``0x`` optional); ValueError
    quoting the text for anything else, or a CPU past :data:`MAX_CPUS`."""
    body = text.strip().lower()
    body = body[2:] if body.startswith("0x") else body
    if not body or len(body) > MAX_CPUS // 4 or body.strip("0123456789abcdef"):
        raise ValueError(f"{excerpt(text)} is not a CPU mask such as 0x3")
    value = int(body, 16)
    return frozenset(c for c in range(value.bit_length()) if value >> c & 1)


def slurm_options(plan: LaunchPlan, *, batch: bool = False) -> list[str]:
    """The plan as ``srun`` options, or with ``batch`` as the lines that open
    a batch script (``#SBATCH`` lines, then the variables its ``srun`` steps
    read: sbatch has no ``--cpu-bind``). :class:`PlanError` for a plan
    Slurm cannot express."""
    ranks = plan.ranks
    count = len(ranks)
    per_task = max(1, len(plan.mask) // count)
    opts = ["--nodes=1", f"--ntasks-per-node={count}", f"--cpus-per-task={per_task}"]
    if plan.whole_host:
        # Slurm refuses a mask outside the job's CPUs: the job takes the node.
        opts.append("--exclusive")
    if any(b.device for b in ranks):
        opts += [f"--gres=gpu:{count}", "--gres-flags=enforce-binding"]
    memory = _slurm_memory(plan)
    if memory:
        opts.append(f"--mem-bind={memory}")
    cpu_bind = "mask_cpu:" + ",".join(hex_mask(b.cpus) for b in ranks)
    env = {"SLURM_CPU_BIND": cpu_bind}
    if not plan.whole_host:
        env[ENV_PLAN_MASK] = hex_mask(plan.mask)
    if batch:
        return [f"#SBATCH {o}" for o in opts] + [f"export {k}={v}" for k, v in env.items()]
    opts.append(f"--cpu-bind={cpu_bind}")
    if ENV_PLAN_MASK in env:
        opts.append(f"--export=ALL,{ENV_PLAN_MASK}={env[ENV_PLAN_MASK]}")
    return opts


def _slurm_memory(plan: LaunchPlan) -> str:
    """``--mem-bind``'s value: ``prefer,map_mem:`` a node a rank for
    preferred, ``mask_mem:`` for bind; empty for none."""
    policies = {b.memory_policy for b in plan.ranks}
    if policies == {"none"}:
        return ""
    if len(policies) > 1:
        alone = [r for r, b in enumerate(plan.ranks) if b.memory_policy == "none"]
        why = plan.ranks[alone[0]].reason if alone else ""
        raise PlanError(
            f"rank {alone[0] if alone else '?'} gets no memory policy"
            + (f" ({why})" if why else "")
            + " and the others do: Slurm's --mem-bind gives every rank the same kind; "
            "plan with --memory none"
        )
    (policy,) = policies
    if policy == "interleave":
        raise PlanError(
            "Slurm's --mem-bind cannot interleave: plan with --memory preferred or bind, or "
            "launch each rank through cpupin exec --local-rank --memory interleave"
        )
    if policy == "preferred":
        return "prefer,map_mem:" + ",".join(str(min(b.memory_nodes)) for b in plan.ranks)
    return "mask_mem:" + ",".join(hex_mask(b.memory_nodes) for b in plan.ranks)


def check_rank(
    plan: LaunchPlan,
    rank: int,
    cpus: frozenset[int],
    policy: tuple[str, frozenset[int]] | None,
    visible: tuple[str, ...] | None,
    host: Host,
    environ: Mapping[str, str],
    causes: Sequence[str] = (),
) -> list[str]:
    """What differs between rank ``rank``'s plan and what it has: its CPUs,
    its memory ``policy`` (name and nodes; ``None``: unknown) and the GPUs
    it sees (``visible`` PCI addresses; ``None``: every GPU). A finding a
    line, each with the cause where the environment names one (a Slurm
    binding), else with ``causes`` (what else narrows the CPUs: a
    Kubernetes cpuset, a quota, an OpenMP variable); empty when they agree."""
    want = plan.ranks[rank]
    out = []
    if cpus != want.cpus:
        out.append(
            f"rank {rank}: {_where(host, cpus)}, plan wants {_where(host, want.cpus)}"
            + (_cause(environ, "cpu") or "".join(f"; {c}" for c in causes))
        )
    elif want.reason and want.device is not None and want.node is not None:
        if not want.cpus & next((n.cpus for n in host.nodes if n.id == want.node), frozenset()):
            out.append(f"rank {rank}: {want.reason}")
    if policy is not None and want.memory_policy != "none":
        name, nodes = policy
        if (name, nodes) != (want.memory_policy, want.memory_nodes):
            have = (
                "the default policy"
                if name == "default"
                else f"{name} on node " + (format_cpulist(nodes) or "-")
            )
            out.append(
                f"rank {rank}: memory {have}, plan wants {want.memory_policy} on node "
                f"{format_cpulist(want.memory_nodes)}" + _cause(environ, "mem")
            )
    if want.device is not None and visible is not None and want.device not in visible:
        seen = ", ".join(visible) or "none"
        out.append(
            f"rank {rank}: sees GPU(s) {seen}, plan wants GPU {want.device}"
            + _cause(environ, "gpu")
        )
    return out


def _where(host: Host, cpus: frozenset[int]) -> str:
    nodes = sorted({n for n in map(host.node_of, cpus) if n is not None})
    return f"{cpus_phrase(cpus)} on node {format_cpulist(nodes) or '?'}"


_CAUSES = {
    "cpu": ("SLURM_CPU_BIND", "--cpu-bind="),
    "mem": ("SLURM_MEM_BIND", "--mem-bind="),
    "gpu": ("CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES="),
}


def _cause(environ: Mapping[str, str], what: str) -> str:
    """The launcher's setting that explains a difference, as a question."""
    name, spelled = _CAUSES[what]
    value = environ.get(name)
    if value is None:
        return ""
    if what != "gpu":
        # Slurm adds its verbosity words (quiet, verbose) to what it was given.
        words = [w for w in value.split(",") if w not in ("quiet", "verbose", "q", "v")]
        value = ",".join(words)
    return f"; launched with {spelled}{_plain(value)}?"


def _plain(text: str, size: int = 60) -> str:
    """A launcher's value quoted back bare: its printable ASCII, no spaces,
    at most ``size`` characters (``...`` when cut)."""
    kept = "".join(c if "!" <= c <= "~" else "?" for c in text[: size + 1])
    return kept if len(kept) <= size else kept[:size] + "..."
