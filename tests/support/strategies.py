"""Hypothesis strategies shared by the tests."""

from dataclasses import replace

from hypothesis import strategies as st

#: CPU numbers well past 1024 and 4096, where fixed cpu_set_t code breaks.
cpu_numbers = st.one_of(
    st.integers(0, 255),
    st.integers(1000, 1100),
    st.integers(4090, 4200),
    st.integers(0, 65535),
)

cpu_sets = st.frozensets(cpu_numbers, max_size=300)


@st.composite
def cpu_ranges(draw):
    """Sets made of a few long runs, as real masks are."""
    cpus = set()
    for _ in range(draw(st.integers(0, 6))):
        start = draw(cpu_numbers)
        cpus.update(range(start, min(start + draw(st.integers(1, 200)), 65536)))
    return frozenset(cpus)


# --- hosts -----------------------------------------------------------------

GPU_VENDOR_IDS = (0x10DE, 0x1002, 0x8086)


@st.composite
def host_specs(draw, max_cores=256):
    """Random host shapes: sockets x nodes x cores x SMT, sibling numbering,
    offline CPUs, 0-16 GPUs on random nodes, same-vendor non-GPU functions."""
    from cpupin.host.shapes import GpuSpec, HostSpec, PciSpec

    sockets = draw(st.integers(1, 4))
    nodes_per_socket = draw(st.integers(1, 4))
    cores_per_node = draw(st.integers(1, max(1, max_cores // (sockets * nodes_per_socket))))
    threads = draw(st.sampled_from((1, 2, 2, 4)))
    siblings = draw(st.sampled_from(("offset", "adjacent")))
    numa = draw(st.booleans()) if sockets * nodes_per_socket == 1 else True
    spec = HostSpec(
        "random",
        sockets=sockets,
        nodes_per_socket=nodes_per_socket,
        cores_per_node=cores_per_node,
        threads=threads,
        siblings=siblings,
        numa=numa,
    )
    every = sorted(spec.online())
    # Never CPU 0 offline (Linux cannot), and never a whole node.
    offline = draw(
        st.frozensets(st.sampled_from(every[1:]), max_size=len(every) // 4)
        if len(every) > 1
        else st.just(frozenset())
    )
    nodes = spec.nodes_count
    buses = draw(st.lists(st.integers(1, 0xFE), min_size=0, max_size=16, unique=True))
    gpus = tuple(
        GpuSpec(
            f"{draw(st.sampled_from((0, 0, 1, 0x10000))):04x}:{bus:02x}:00.0",
            draw(st.integers(-1, nodes - 1)) if numa else -1,
            vendor=draw(st.sampled_from(GPU_VENDOR_IDS)),
            class_code=draw(st.sampled_from((0x030000, 0x030200, 0x038000))),
            local_cpulist=draw(st.booleans()),
        )
        for bus in buses
    )
    taken = {g.address for g in gpus}
    others = tuple(
        PciSpec(
            f"0000:{bus:02x}:01.0",
            draw(st.sampled_from(GPU_VENDOR_IDS + (0x15B3, 0x1A03))),
            draw(st.sampled_from((0x068000, 0x060400, 0x020700, 0x030000))),
        )
        for bus in draw(st.lists(st.integers(1, 0xFE), max_size=6, unique=True))
    )
    # A VGA of another vendor (a BMC) is fine; one of a GPU vendor would be a GPU.
    others = tuple(
        p
        for p in others
        if not (p.class_code >> 16 == 3 and p.vendor in GPU_VENDOR_IDS) and p.address not in taken
    )
    # None at all too: many VMs list no cpuidle folder.
    states = draw(st.sampled_from(((), (("POLL", 0),), (("POLL", 0), ("C1", 1), ("C6", 170)))))
    # What cores report of their speed: nothing, all alike, or some cores
    # above the others (priority cores, SST-BF's higher base, Arm's big cores)
    # in figures far enough apart to be two classes.
    base, raised = draw(st.sampled_from(PERF_SHAPES))
    per_package = cores_per_node * nodes_per_socket
    priority = draw(st.lists(st.integers(0, per_package - 1), unique=True, max_size=per_package))
    return replace(
        spec,
        gpus=gpus,
        pci=others,
        offline=offline,
        idle_states=states,
        llc_cores=draw(st.integers(0, cores_per_node)),
        perf=base,
        priority_cores=tuple(priority) if raised else (),
        priority=raised,
    )


#: (every core's figures, a priority core's raised ones).
PERF_SHAPES = (
    ((), ()),
    ((("highest_perf", 38), ("nominal_perf", 20)), ()),
    (
        (("highest_perf", 38), ("nominal_perf", 20), ("max_khz", 3_800_000)),
        (("highest_perf", 46), ("max_khz", 4_600_000)),
    ),
    ((("max_khz", 3_500_000), ("base_khz", 2_100_000)), (("base_khz", 2_600_000),)),
    ((("capacity", 446),), (("capacity", 1024),)),
)


@st.composite
def masks(draw, host):
    """Masks users run under: the whole host, one node, ranges with and
    without the siblings, scattered CPUs."""
    cpus = sorted(host.cpus)
    kind = draw(st.sampled_from(("all", "node", "range", "range+siblings", "scattered")))
    if kind == "all" or not cpus:
        return frozenset(cpus)
    if kind == "node":
        node = draw(st.sampled_from([n for n in host.nodes if n.cpus] or list(host.nodes)))
        return node.cpus
    if kind == "scattered":
        return draw(st.frozensets(st.sampled_from(cpus), min_size=1))
    firsts = sorted(core.cpus[0] for core in host.cores)
    lo = draw(st.integers(0, len(firsts) - 1))
    hi = draw(st.integers(lo, len(firsts) - 1))
    chosen = [core for core in host.cores if firsts[lo] <= core.cpus[0] <= firsts[hi]]
    if kind == "range":
        return frozenset(core.cpus[0] for core in chosen)
    return frozenset(cpu for core in chosen for cpu in core.cpus)
