"""The topology reader: this machine, built trees, and every odd input."""

import os
import re
import shutil
import subprocess
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import process_cpus
from cpupin.host.cgroup import parse_cpu_max
from cpupin.host.shapes import HOSTS, build_tree, host_named
from cpupin.host.topology import parse_pci_address, pci_sort_key, read_host
from tests.support.specs import spec_cores, spec_host
from tests.support.strategies import host_specs


def write(root, files):
    """Write ``files`` (path -> text) under ``root``; return root."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
PCI = "sys/bus/pci/devices"


def two_cpus(**extra):
    files = {f"{CPU}/online": "0-1\n"}
    for cpu in (0, 1):
        files[f"{CPU}/cpu{cpu}/topology/thread_siblings_list"] = f"{cpu}\n"
    files.update(extra)
    return files


# --- this machine ----------------------------------------------------------


def test_this_machine_agrees_with_os():
    host = read_host("/")
    assert host.cpus == frozenset(range(os.cpu_count())) or host.cpus >= os.sched_getaffinity(0)
    assert len(host.cpus) == os.cpu_count()
    assert process_cpus() <= host.cpus
    assert sorted(c for core in host.cores for c in core.cpus) == sorted(host.cpus)
    assert set().union(*(n.cpus for n in host.nodes)) == host.cpus


def listed_idle_states(cpu):
    """The idle states sysfs lists for ``cpu``, read in plain Python: (name,
    latency) in state order; [] where the host lists none (many VMs)."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/cpuidle"
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    states = []
    for index in sorted(int(n[5:]) for n in names if n.startswith("state")):
        with open(f"{base}/state{index}/name") as f:
            name = f.read().strip()
        with open(f"{base}/state{index}/latency") as f:
            states.append((name, int(f.read())))
    return states


def test_this_machine_idle_states_agree_with_sysfs():
    """Each package's idle states, as sysfs lists them for its first CPU, or
    none at all (a VM that lists no cpuidle): then no deepest state, and a
    reason that says so."""
    host = read_host("/")
    firsts = {}
    for core in host.cores:
        firsts.setdefault(core.package if core.package is not None else -1, core.cpus[0])
    expected = {p: listed_idle_states(cpu) for p, cpu in firsts.items()}
    expected = {p: states for p, states in expected.items() if states}
    got = {p: [(s.name, s.latency_us) for s in states] for p, states in host.idle_states.items()}
    assert got == expected
    if not expected:
        assert host.deepest_idle_state() is None
        assert "no cpuidle states listed" in host.reasons
        assert host.as_dict()["deepest_idle_state"] is None


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="needs lscpu")
def test_this_machine_agrees_with_lscpu():
    out = subprocess.run(
        ["lscpu", "-p=CPU,CORE,NODE"], capture_output=True, text=True, check=True
    ).stdout
    cores, nodes = {}, {}
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        cpu, core, node = line.split(",")
        cores.setdefault(int(core), set()).add(int(cpu))
        nodes.setdefault(int(node or 0), set()).add(int(cpu))
    host = read_host("/")
    assert {frozenset(c.cpus) for c in host.cores} == {frozenset(c) for c in cores.values()}
    assert {n.id: n.cpus for n in host.cpu_nodes} == {k: frozenset(v) for k, v in nodes.items()}


# --- built trees -----------------------------------------------------------


def check_reads_back(spec, root):
    host = read_host(build_tree(spec, root))
    assert replace(host, root="", reasons=()) == spec_host(spec)
    # and, spelled out, what that comparison covers:
    assert host.cpus == spec.online()
    assert [c.cpus for c in host.cores] == spec_cores(spec)
    assert {n.id: n.cpus for n in host.nodes} == spec.node_cpus()
    assert [g.address for g in host.gpus] == sorted(
        (parse_pci_address(g.address) for g in spec.gpus), key=pci_sort_key
    )
    assert host.smt == (spec.threads > 1)
    if not spec.idle_states:  # a VM that lists no cpuidle: nothing deepest, and a reason
        assert host.deepest_idle_state() is None and host.idle_states == {}
        assert "no cpuidle states listed" in host.reasons
        return host
    deepest = max(spec.idle_states, key=lambda s: s[1])
    assert (host.deepest_idle_state().name, host.deepest_idle_state().latency_us) == deepest
    return host


@settings(max_examples=80)
@given(host_specs(max_cores=64))
def test_a_host_built_from_a_random_spec_reads_back_to_it(fast_dir, spec):
    """read_host(build_tree(spec)) is the spec: cores, nodes, GPUs, SMT."""
    with fast_dir() as root:
        check_reads_back(spec, root)


@settings(max_examples=30)
@given(
    host_specs(max_cores=16),
    st.sampled_from(["no folder", "empty folders", "driver none", "system folder empty"]),
)
def test_a_host_that_lists_no_idle_states_reads_alike_in_each_shape(fast_dir, spec, shape):
    """Many VMs list no idle states, in one of these shapes: no cpuidle
    folder at all; an empty one for each CPU; the system's current_driver
    "none"; or its folder there but empty. Each reads as no states, with the
    reason, and the rest of the host as its spec."""
    spec = replace(spec, idle_states=())
    with fast_dir() as root:
        build_tree(spec, root)
        cpu = os.path.join(root, "sys/devices/system/cpu")
        if shape in ("empty folders", "driver none"):
            for name in os.listdir(cpu):
                if name.startswith("cpu") and name[3:].isdigit():
                    os.makedirs(os.path.join(cpu, name, "cpuidle"), exist_ok=True)
        if shape == "driver none":
            os.makedirs(os.path.join(cpu, "cpuidle"), exist_ok=True)
            with open(os.path.join(cpu, "cpuidle", "current_driver"), "w") as f:
                f.write("none\n")
        if shape == "system folder empty":
            os.makedirs(os.path.join(cpu, "cpuidle"), exist_ok=True)
        host = read_host(root)
    assert host.idle_states == {} and host.deepest_idle_state() is None
    assert "no cpuidle states listed" in host.reasons
    assert replace(host, root="", reasons=()) == spec_host(spec)


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_the_shipped_hosts_read_back_to_their_specs(fast_dir, name):
    with fast_dir() as root:
        host = check_reads_back(HOSTS[name], root)
    assert replace(host_named(name), root=host.root) == host


def test_the_dgx_h100_is_what_it_is():
    host = host_named("dgx-h100")
    assert len(host.cpus) == 224 and len(host.cores) == 112
    assert host.core_of(0).cpus == (0, 112)
    assert [len(n.cpus) for n in host.nodes] == [112, 112]
    assert [g.node for g in host.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(g.vendor == "nvidia" for g in host.gpus)
    assert "0000:e1:00.0" not in {g.address for g in host.gpus}  # the BMC's VGA
    assert host.deepest_idle_state().latency_us == 290


# --- odd inputs: each becomes a reason, never a traceback -------------------


def test_no_online_file_takes_the_cpus_with_a_topology_folder(tmp_path):
    files = two_cpus()
    del files[f"{CPU}/online"]
    files[f"{CPU}/cpu2/cache/index0/level"] = "1\n"  # offline: no topology folder
    host = read_host(write(tmp_path, files))
    assert host.cpus == {0, 1}
    assert any("online" in r for r in host.reasons)


def test_siblings_from_hex_masks_when_lists_are_missing(tmp_path):
    files = {f"{CPU}/online": "0-3\n"}
    for cpu in range(4):
        files[f"{CPU}/cpu{cpu}/topology/thread_siblings"] = "00000005\n" if cpu % 2 == 0 else "a\n"
    host = read_host(write(tmp_path, files))
    assert [c.cpus for c in host.cores] == [(0, 2), (1, 3)]


def test_core_cpus_list_is_preferred_to_thread_siblings(tmp_path):
    files = two_cpus()
    for cpu in (0, 1):
        files[f"{CPU}/cpu{cpu}/topology/core_cpus_list"] = "0-1\n"
    assert [c.cpus for c in read_host(write(tmp_path, files)).cores] == [(0, 1)]


def test_a_cpu_with_no_siblings_listed_is_its_own_core(tmp_path):
    files = two_cpus()
    del files[f"{CPU}/cpu1/topology/thread_siblings_list"]
    host = read_host(write(tmp_path, files))
    assert [c.cpus for c in host.cores] == [(0,), (1,)]
    assert any("CPU 1" in r for r in host.reasons)


def test_offline_siblings_are_left_out_of_cores(tmp_path):
    files = {f"{CPU}/online": "0\n", f"{CPU}/cpu0/topology/thread_siblings_list": "0-1\n"}
    assert [c.cpus for c in read_host(write(tmp_path, files)).cores] == [(0,)]


def test_hybrid_cores_with_one_or_two_threads(tmp_path):
    files = {f"{CPU}/online": "0-3\n"}
    for cpu, siblings in {0: "0-1", 1: "0-1", 2: "2", 3: "3"}.items():
        files[f"{CPU}/cpu{cpu}/topology/core_cpus_list"] = siblings + "\n"
    assert [c.cpus for c in read_host(write(tmp_path, files)).cores] == [(0, 1), (2,), (3,)]


def test_no_node_folders_is_one_implicit_node_0(tmp_path):
    host = read_host(write(tmp_path, two_cpus()))
    assert [(n.id, n.cpus) for n in host.nodes] == [(0, {0, 1})]
    assert any("no NUMA nodes" in r for r in host.reasons)


def test_sparse_node_ids_cpumap_only_and_an_empty_node(tmp_path):
    files = two_cpus(
        **{
            f"{NODE}/node3/cpulist": "0\n",
            f"{NODE}/node7/cpumap": "00000002\n",
            f"{NODE}/node9/cpulist": "\n",
            f"{NODE}/node12/meminfo": "x",
        }
    )
    host = read_host(write(tmp_path, files))
    assert [(n.id, n.cpus) for n in host.nodes] == [(3, {0}), (7, {1}), (9, set()), (12, set())]
    assert [n.id for n in host.cpu_nodes] == [3, 7]


def test_nodes_that_claim_the_same_cpu_are_one_node(tmp_path):
    files = two_cpus(**{f"{NODE}/node0/cpulist": "0-1\n", f"{NODE}/node1/cpulist": "0-1\n"})
    host = read_host(write(tmp_path, files))
    assert [(n.id, n.cpus) for n in host.nodes] == [(0, {0, 1})]
    assert any("inconsistent" in r for r in host.reasons)


@pytest.mark.parametrize("garbage", ["0-x\n", "3-1\n", "\x00\x01", "0-99999999\n"])
def test_garbage_in_a_cpulist_is_a_reason(tmp_path, garbage):
    files = two_cpus(**{f"{NODE}/node0/cpulist": garbage, f"{NODE}/node1/cpulist": "1\n"})
    host = read_host(write(tmp_path, files))
    assert host.nodes[0].cpus == frozenset()
    assert any("node0/cpulist" in r for r in host.reasons)


def test_an_empty_root_reads_as_an_unknown_host(tmp_path):
    host = read_host(tmp_path)
    assert host.cpus == frozenset() and host.gpus == ()
    assert host.reasons


def gpu_files(address="0000:3b:00.0", cls="0x030200", vendor="0x10de", **extra):
    files = {f"{PCI}/{address}/class": cls + "\n", f"{PCI}/{address}/vendor": vendor + "\n"}
    files.update({f"{PCI}/{address}/{k}": v for k, v in extra.items()})
    return files


@pytest.mark.parametrize(
    "cls, vendor, is_gpu",
    [
        ("0x030000", "0x10de", True),
        ("0x030200", "0x10de", True),
        ("0x038000", "0x1002", True),
        ("0x030000", "0x8086", True),
        ("0x068000", "0x10de", False),
        ("0x060400", "0x10de", False),
        ("0x020700", "0x15b3", False),
        ("0x030000", "0x1a03", False),
        ("zz", "0x10de", False),
    ],
)
def test_gpus_are_display_functions_of_gpu_vendors(tmp_path, cls, vendor, is_gpu):
    host = read_host(write(tmp_path, two_cpus(**gpu_files(cls=cls, vendor=vendor))))
    assert bool(host.gpus) is is_gpu


def test_gpu_node_minus_one_on_a_one_node_host_is_that_node(tmp_path):
    files = two_cpus(**{f"{NODE}/node1/cpulist": "0-1\n"}, **gpu_files(numa_node="-1\n"))
    (gpu,) = read_host(write(tmp_path, files)).gpus
    assert gpu.node == 1 and gpu.local_cpus == {0, 1}


def test_gpu_node_missing_on_a_host_without_nodes_is_node_0(tmp_path):
    (gpu,) = read_host(write(tmp_path, two_cpus(**gpu_files()))).gpus
    assert gpu.node == 0 and gpu.local_cpus == {0, 1}


def test_gpu_node_minus_one_on_a_several_node_host_is_no_node(tmp_path):
    files = two_cpus(
        **{f"{NODE}/node0/cpulist": "0\n", f"{NODE}/node1/cpulist": "1\n"},
        **gpu_files(numa_node="-1\n"),
    )
    (gpu,) = read_host(write(tmp_path, files)).gpus
    assert gpu.node is None and gpu.local_cpus is None


def test_gpu_local_cpus_from_the_list_then_the_mask_then_the_node(tmp_path):
    files = two_cpus(**{f"{NODE}/node0/cpulist": "0\n", f"{NODE}/node1/cpulist": "1\n"})
    files.update(
        gpu_files("0000:01:00.0", numa_node="0\n", local_cpulist="1\n", local_cpus="00000001\n")
    )
    files.update(gpu_files("0000:02:00.0", numa_node="0\n", local_cpus="00000002\n"))
    files.update(gpu_files("0000:03:00.0", numa_node="1\n"))
    host = read_host(write(tmp_path, files))
    assert [g.local_cpus for g in host.gpus] == [{1}, {1}, {1}]


def test_gpus_sort_by_address_numerically(tmp_path):
    files = two_cpus()
    for address in (
        "0000:9a:00.0",
        "10000:00:00.0",
        "0000:1b:00.0",
        "0001:00:00.0",
        "0000:1b:00.1",
    ):
        files.update(gpu_files(address))
    host = read_host(write(tmp_path, files))
    assert [g.address for g in host.gpus] == [
        "0000:1b:00.0",
        "0000:1b:00.1",
        "0000:9a:00.0",
        "0001:00:00.0",
        "10000:00:00.0",
    ]


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("3b:00.0", "0000:3b:00.0"),
        ("10000:01:1f.7", "10000:01:1f.7"),
        (" 0001:00:00.0\n", "0001:00:00.0"),
    ],
)
def test_pci_addresses_in_any_spelling(text, canonical):
    assert parse_pci_address(text) == canonical


@pytest.mark.parametrize(
    "text",
    [
        "",
        "3b:00",
        "0000:3b:20.0",
        "0000:3b:00.8",
        "gpu0",
        "0000:3b:00.0/../x",
        "123456789:00:00.0",
        None,
        3,
    ],
)
def test_bad_pci_addresses_name_the_value(text):
    with pytest.raises(ValueError, match="PCI address"):
        parse_pci_address(text)


def test_idle_states_with_a_disabled_deepest_state(tmp_path):
    files = two_cpus()
    for i, (name, latency, disable) in enumerate([("POLL", 0, 0), ("C1", 1, 0), ("C6", 170, 1)]):
        base = f"{CPU}/cpu0/cpuidle/state{i}"
        files.update(
            {
                f"{base}/name": f"{name}\n",
                f"{base}/latency": f"{latency}\n",
                f"{base}/disable": f"{disable}\n",
            }
        )
    files[f"{CPU}/cpu0/cpuidle/state3/name"] = "broken\n"  # no latency: left out
    host = read_host(write(tmp_path, files))
    assert host.deepest_idle_state().name == "C1"
    assert [s.name for s in host.idle_states[-1]] == ["POLL", "C1", "C6"]


def test_hypervisor_from_cpuinfo(tmp_path):
    files = two_cpus(**{"proc/cpuinfo": "processor : 0\nflags : fpu hypervisor sse\n"})
    assert read_host(write(tmp_path, files)).hypervisor
    assert not read_host(write(tmp_path / "b", two_cpus())).hypervisor


# --- the cgroup: cpuset and quota --------------------------------------------


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("max 100000\n", None),
        ("200000 100000\n", (200000, 100000)),
        ("150000\n", (150000, 100000)),
        ("max\n", None),
    ],
)
def test_cpu_max(text, parsed):
    assert parse_cpu_max(text) == parsed


@pytest.mark.parametrize("text", ["", "\n", "1 2 3\n", "abc 100000", "0 100000", "100 -5"])
def test_cpu_max_that_cannot_be_parsed_says_why(text):
    with pytest.raises(ValueError, match=r"\S"):
        parse_cpu_max(text)


def v2(cpu_max=None, parent_max=None, cpuset=None, path="/job/step"):
    files = two_cpus(
        **{
            "proc/self/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
            "proc/self/cgroup": f"0::{path}\n",
        }
    )
    if cpu_max is not None:
        files[f"sys/fs/cgroup{path}/cpu.max"] = cpu_max
    if parent_max is not None:
        files[f"sys/fs/cgroup{os.path.dirname(path)}/cpu.max"] = parent_max
    if cpuset is not None:
        files[f"sys/fs/cgroup{path}/cpuset.cpus.effective"] = cpuset
    files[f"sys/fs/cgroup{path}/cgroup.procs"] = "1\n"
    return files


@pytest.mark.parametrize(
    "cpu_max, parent_max, quota",
    [
        ("max 100000\n", None, None),
        ("200000 100000\n", None, (200000, 100000)),
        ("150000\n", None, (150000, 100000)),
        ("", None, None),
        (None, None, None),
        ("1 2 3\n", None, None),
        ("400000 100000\n", "150000 100000\n", (150000, 100000)),
        ("50000 100000\n", "max 100000\n", (50000, 100000)),
    ],
)
def test_cgroup_v2_quota_the_strictest_of_the_ancestors(tmp_path, cpu_max, parent_max, quota):
    host = read_host(write(tmp_path, v2(cpu_max, parent_max)))
    assert (None if host.quota is None else (host.quota.quota_us, host.quota.period_us)) == quota
    if cpu_max in ("", "1 2 3\n"):
        assert any("cpu.max" in r for r in host.reasons)


def test_quota_cpus_round_up_and_are_at_least_one(tmp_path):
    host = read_host(write(tmp_path, v2("150000 100000\n")))
    assert host.quota.cpus == 2
    host = read_host(write(tmp_path / "b", v2("1000 100000\n")))
    assert host.quota.cpus == 1


def test_cgroup_v2_cpuset(tmp_path):
    host = read_host(write(tmp_path, v2(cpuset="1\n")))
    assert host.cpuset == {1} and host.default_mask() == {1}


def test_cgroup_path_missing_under_the_mount_reads_the_mount_itself(tmp_path):
    files = two_cpus(
        **{
            "proc/self/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
            "proc/self/cgroup": "0::/elsewhere/in/the/host\n",
            "sys/fs/cgroup/cpu.max": "100000 100000\n",
        }
    )
    assert read_host(write(tmp_path, files)).quota.cpus == 1


def v1(mount_options, mount_point, quota="-1", period="100000", extra_cgroup=""):
    return two_cpus(
        **{
            "proc/self/mounts": f"cgroup {mount_point} cgroup rw,{mount_options} 0 0\n"
            "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n",
            "proc/self/cgroup": f"4:{mount_options}:/docker/abc\n0::/\n{extra_cgroup}",
            f"{mount_point.lstrip('/')}/docker/abc/cpu.cfs_quota_us": f"{quota}\n",
            f"{mount_point.lstrip('/')}/docker/abc/cpu.cfs_period_us": f"{period}\n",
            "sys/fs/cgroup/unified/cpu.max": "100000 100000\n",  # v1 cpu wins: hybrid
        }
    )


@pytest.mark.parametrize(
    "options, point",
    [
        ("cpu,cpuacct", "/sys/fs/cgroup/cpu,cpuacct"),
        ("cpu", "/sys/fs/cgroup/cpu"),
        ("cpuacct,cpu", "/sys/fs/cgroup/cpuacct,cpu"),
    ],
)
def test_cgroup_v1_quota_with_cpu_and_cpuacct_together_or_apart(tmp_path, options, point):
    host = read_host(write(tmp_path, v1(options, point, "300000")))
    assert host.quota.cpus == 3
    assert "cfs_quota_us" in host.quota.source
    host = read_host(write(tmp_path / "none", v1(options, point, "-1")))
    assert host.quota is None


def test_cgroup_v1_quota_that_is_not_a_number_is_no_quota(tmp_path):
    host = read_host(write(tmp_path, v1("cpu", "/sys/fs/cgroup/cpu", "lots")))
    assert host.quota is None
    assert any("cfs_quota_us" in r for r in host.reasons)


def test_cgroup_v1_cpuset(tmp_path):
    files = two_cpus(
        **{
            "proc/self/mounts": "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n",
            "proc/self/cgroup": "3:cpuset:/slurm/job1\n",
            "sys/fs/cgroup/cpuset/slurm/job1/cpuset.effective_cpus": "0\n",
        }
    )
    assert read_host(write(tmp_path, files)).cpuset == {0}


def test_no_cgroup_files_is_no_quota_and_no_cpuset(tmp_path):
    host = read_host(
        write(
            tmp_path,
            two_cpus(**{"proc/self/cgroup": "garbage\n", "proc/self/mounts": "nonsense\n"}),
        )
    )
    assert host.quota is None and host.cpuset is None


# --- core classes and caches: trees that do not add up ----------------------------

PCT_LIKE = HOSTS["xeon6-pct"]


def small_pct(tmp_path):
    from dataclasses import replace as swap

    spec = swap(
        PCT_LIKE,
        sockets=1,
        nodes_per_socket=1,
        cores_per_node=8,
        gpus=(),
        priority_cores=(4,),
        llc_cores=4,
    )
    return spec, build_tree(spec, tmp_path)


def test_a_figure_one_core_lacks_ranks_no_core_and_the_reason_says_so(tmp_path):
    spec, root = small_pct(tmp_path)
    os.unlink(os.path.join(root, "sys/devices/system/cpu/cpu3/acpi_cppc/highest_perf"))
    host = read_host(root)
    assert any(
        "cpu3/acpi_cppc/highest_perf" in r and "highest_perf does not rank" in r
        for r in host.reasons
    )
    # max_khz still tells core 4 apart.
    assert [c.cores for c in host.classes] == [1, 7]
    assert "highest_perf" not in host.classes[0].values


def test_figures_out_of_range_are_reasons_and_rank_nothing(tmp_path):
    spec, root = small_pct(tmp_path)
    for name in ("acpi_cppc/highest_perf", "cpufreq/cpuinfo_max_freq"):
        with open(os.path.join(root, f"sys/devices/system/cpu/cpu4/{name}"), "w") as f:
            f.write("9" * 19 + "\n")
    host = read_host(root)
    assert any("is outside" in r for r in host.reasons)
    assert len(host.classes) == 1  # nothing else sets core 4 apart


def test_caches_that_overlap_or_leave_a_cpu_out_are_unknown(tmp_path):
    spec, root = small_pct(tmp_path)
    base = "sys/devices/system/cpu/cpu{}/cache/index1/shared_cpu_list"
    assert read_host(root).caches == (
        frozenset({0, 1, 2, 3, 8, 9, 10, 11}),
        frozenset({4, 5, 6, 7, 12, 13, 14, 15}),
    )
    with open(os.path.join(root, base.format(4)), "w") as f:  # CPU 4's domain claims CPU 3 too
        f.write("3-7,12-15\n")
    host = read_host(root)
    assert host.caches == () and any("in two level-3 caches" in r for r in host.reasons)
    spec, root = small_pct(tmp_path / "b")
    with open(os.path.join(root, base.format(0)), "w") as f:
        f.write("1-7\n")
    host = read_host(root)
    assert host.caches == () and any("CPU 0 lists no level-3 cache" in r for r in host.reasons)


def test_this_machines_caches_and_classes_agree_with_sysfs():
    """The oracle: sysfs read in plain Python, CPU by CPU."""
    host = read_host("/")
    base = "/sys/devices/system/cpu"
    groups = set()
    for cpu in host.cpus:
        best, level = None, 0
        try:
            names = os.listdir(f"{base}/cpu{cpu}/cache")
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.startswith("index"):
                continue
            with open(f"{base}/cpu{cpu}/cache/{name}/type") as f:
                if f.read().strip() not in ("Unified", "Data"):
                    continue
            with open(f"{base}/cpu{cpu}/cache/{name}/level") as f:
                lv = int(f.read())
            if lv > level:
                best, level = name, lv
        if best is not None:
            with open(f"{base}/cpu{cpu}/cache/{best}/shared_cpu_list") as f:
                listed = set()
                for part in f.read().strip().split(","):
                    lo, _, hi = part.partition("-")
                    listed.update(range(int(lo), int(hi or lo) + 1))
                groups.add(frozenset(listed) & host.cpus)
    assert set(host.caches) == groups
    capacities = set()
    for core in host.cores:
        try:
            with open(f"{base}/cpu{core.cpus[0]}/cpu_capacity") as f:
                capacities.add(int(f.read()))
        except FileNotFoundError:
            pass
    if len(capacities) == 1:
        assert len(host.classes) <= 1 or "capacity" not in host.class_keys()


def test_topo_shows_classes_and_cache_domains(capsys):
    from cpupin.cli import main

    assert main(["topo", "--host", "xeon6-pct"]) == 0
    out = capsys.readouterr().out
    assert "class  0 (highest): highest_perf 46, max 4.60 GHz; 16 core(s), CPUs 4,12,20" in out
    assert "class  1: highest_perf 39, max 3.90 GHz; 112 core(s)" in out
    assert "cache  L3: 4 domain(s) of 64 CPUs: 0-31,128-159 | 32-63,160-191" in out
    assert main(["topo", "--host", "amd-8gpu", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["cache_level"] == 3 and len(data["caches"]) == 24
    assert data["caches"][1] == list(range(8, 16)) + list(range(200, 208))
    assert data["classes"] == []
    assert main(["topo", "--host", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "class  no per-core performance figures (CPPC, cpufreq, capacity): one class" in out


# parse_pci_address reads with str's methods; the regular expression it had
# (the grammar of sysfs's, NVML's and lspci's addresses) is the oracle.
PCI_GRAMMAR = r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\Z"


def pci_by_grammar(text):
    m = re.match(PCI_GRAMMAR, text.strip(), re.ASCII)
    if m is None or int(m.group(3), 16) > 0x1F:
        return None
    domain, bus = int(m.group(1) or "0", 16), int(m.group(2), 16)
    return f"{domain:04x}:{bus:02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


HEXISH = st.text("0123456789abcdefABCDEFg\u0663 ", min_size=0, max_size=9)


def hex_part(most):
    """Mostly a right part (one to ``most`` hex digits), else anything near."""
    right = st.text("0123456789abcdefABCDEF", min_size=1, max_size=most)
    return st.one_of(right, right, right, HEXISH)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.builds(
            lambda d, b, v, f, sep, pad: (
                pad + (f"{d}:" if d is not None else "") + f"{b}:{v}{sep}{f}" + pad
            ),
            st.one_of(st.none(), hex_part(8)),
            hex_part(2),
            hex_part(2),
            st.sampled_from(["0", "3", "7", "8", "", "07", "x"]),
            st.sampled_from([".", ".", ".", ":", ""]),
            st.sampled_from(["", " ", "\n"]),
        ),
        st.text(max_size=16),
    )
)
def test_a_pci_address_is_read_as_its_grammar_reads_it(text):
    try:
        got = parse_pci_address(text)
    except ValueError:
        got = None
    assert got == pci_by_grammar(text)
