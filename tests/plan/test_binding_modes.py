"""Every CPU mode of bind_process against torch's definitions.

``tests/support/torch_reference.py`` restates torch's ``--numa-binding`` modes over
plain data; here cpupin's :func:`decide_binding` is compared with it on
random, shipped and captured hosts (AMD core complexes, sub-NUMA clusters),
and the reference itself with torch's own code, run over the same trees."""

import io
import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import PlanError
from cpupin.host.shapes import HOSTS, build_tree, host_named
from cpupin.host.topology import Gpu, read_host
from cpupin.plan.binding import decide_binding, parse_cpus
from tests.support import torch_reference as ref
from tests.support.captures import NAMES, needs_captures
from tests.support.specs import spec_host
from tests.support.strategies import host_specs, masks

MODES = ("node", "socket", "exclusive", "cache")


def machine_of(spec):
    """The reference's view of a spec, from the spec's own arithmetic."""
    online = spec.online()
    core_of, llc_of, package_of = {}, {}, {}
    domains = {}
    for c in range(spec.cores_count):
        cpus = {spec.cpu(c, t) for t in range(spec.threads)} & online
        domains.setdefault(spec.cache_of(c), set()).update(cpus)
    for c in range(spec.cores_count):
        cpus = {spec.cpu(c, t) for t in range(spec.threads)} & online
        for cpu in cpus:
            core_of[cpu] = cpus
            llc_of[cpu] = domains[spec.cache_of(c)]
            package_of[cpu] = spec.package_of_node(c // spec.cores_per_node)
    gpus = sorted(spec.gpus, key=lambda g: host_named_key(g.address))
    return ref.Machine(
        {n: set(cpus) for n, cpus in spec.node_cpus().items()},
        core_of,
        llc_of,
        package_of,
        [g.node if spec.numa else -1 for g in gpus],
    )


def host_named_key(address):
    from cpupin.host.topology import parse_pci_address, pci_sort_key

    return pci_sort_key(parse_pci_address(address))


def known_nodes(spec):
    """GPUs of a host of several nodes all name one (cpupin will not guess a
    node for numa_node -1 there, torch takes node 0: docs/placement.md)."""
    if spec.nodes_count == 1 or not spec.numa:
        return spec
    return replace(spec, gpus=tuple(replace(g, node=max(g.node, 0)) for g in spec.gpus))


def check_against_reference(host, machine, mask):
    for index, gpu in enumerate(host.gpus):
        for mode in MODES:
            want = ref.MODES[mode](machine, index, mask)
            got = decide_binding(host, mask, device=gpu.address, cpus=mode, memory="none")
            assert got.mode == mode
            if want:
                assert got.cpus == want, (mode, gpu.address, got.reason)
                assert "kept" not in got.reason
            else:  # torch binds nothing (or raises): the mask is kept, and why
                assert got.cpus == mask
                assert "the mask is kept" in got.reason or "nothing to bind to" in got.reason
                assert got.reason, mode


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_every_mode_matches_torchs_definition_on_random_hosts(data):
    spec = known_nodes(data.draw(host_specs(max_cores=64)))
    host = spec_host(spec)
    mask = data.draw(masks(host)) & host.cpus
    if mask:
        check_against_reference(host, machine_of(spec), mask)


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_every_mode_matches_torchs_definition_on_the_shipped_hosts(name):
    spec = known_nodes(HOSTS[name])
    host = host_named(name)
    for mask in (host.cpus, frozenset(sorted(host.cpus)[: len(host.cpus) // 3])):
        check_against_reference(host, machine_of(spec), mask)


def test_the_modes_on_the_epyc_and_on_sub_numa_clusters():
    """Worked cases: the EPYC's 8-core complexes and the B300's two nodes a
    socket."""
    epyc = host_named("amd-8gpu")  # node 1: cores 96-191, siblings +192, GPUs a6 is 2nd
    b = lambda host, gpu, mode: decide_binding(host, host.cpus, device=gpu, cpus=mode)  # noqa: E731
    assert b(epyc, "0000:a6:00.0", "cache").cpus == set(range(104, 112)) | set(range(296, 304))
    excl = b(epyc, "0000:a6:00.0", "exclusive").cpus
    assert excl == set(range(120, 144)) | set(range(312, 336))  # 96 cores / 4 GPUs, 2nd share
    b300 = host_named("xeon6-b300")  # node 1 is the second node of socket 0
    sock = b(b300, "0000:5f:00.0", "socket")
    assert sock.cpus == set(range(0, 64)) | set(range(128, 192))
    assert sock.memory_nodes == {1} and sock.memory_policy == "preferred"
    inter = decide_binding(
        b300, b300.cpus, device="0000:5f:00.0", cpus="socket", memory="interleave"
    )
    assert inter.memory_nodes == {0, 1} and inter.memory_policy == "interleave"


def test_a_cpu_list_stays_within_the_mask_and_says_what_it_left_out():
    host = host_named("xeon6-b300")
    mask = frozenset(range(96, 104))
    got = decide_binding(host, mask, cpus="100-110", memory="interleave")
    assert got.cpus == set(range(100, 104)) and got.mode == "list"
    assert "CPUs 104-110 are outside the process mask 96-103" in got.reason
    assert got.memory_nodes == {3}
    with pytest.raises(PlanError, match="none of these CPUs is online and in the process mask"):
        decide_binding(host, mask, cpus=[0, 1])
    assert decide_binding(host, mask, node=3, cpus=range(96, 98)).cpus == {96, 97}


@pytest.mark.parametrize(
    "value",
    ["", "nodes", "0-", "-1", "x", [], [-1], [True], [1 << 16], {"a": 1}, 3, None, "0x3"],
)
def test_bad_cpu_modes_name_the_value_and_the_forms(value):
    with pytest.raises(ValueError, match="cpus=.*use node, socket, exclusive, cache, keep"):
        parse_cpus(value)


@pytest.mark.parametrize(
    "text, says", [("0-99999999", "past the limit of 65536"), ("5-3", "runs backwards")]
)
def test_a_bad_cpu_list_says_what_is_wrong_with_it(text, says):
    with pytest.raises(ValueError, match=f"cpus='{text}': .*{says}.*use node, socket"):
        parse_cpus(text)


def test_exclusive_with_fewer_cores_than_gpus_keeps_the_mask_and_says_why():
    host = host_named("amd-8gpu")
    mask = frozenset({0, 1, 2})  # three cores of node 0, which has four GPUs
    got = decide_binding(host, mask, device="0000:05:00.0", cpus="exclusive")
    assert got.cpus == mask
    assert "3 core(s) in the process mask for 4 GPU(s)" in got.reason


def test_exclusive_and_cache_need_a_gpu():
    host = host_named("amd-8gpu")
    for mode in ("exclusive", "cache"):
        with pytest.raises(ValueError, match="shares a node among its GPUs: name the GPU"):
            decide_binding(host, host.cpus, node=0, cpus=mode)


# --- the reference against torch's own code --------------------------------------

#: What torch gives where it cannot read a tree: a file it needs is missing
#: (a node without ``cpulist``, a cache without ``shared_cpu_list``), or a
#: node with no allowed CPU breaks its ``socket`` mode's ``min()``.
UNREADABLE = "unreadable"


@pytest.fixture
def torch_binding(monkeypatch):
    """torch.numa.binding with its sysfs reads turned to a tree, its GPUs to
    a list of nodes and its affinity to a mask: ``run(root, gpu_nodes,
    mask)`` gives each mode's CPUs for each GPU, ``None`` where torch
    raises."""
    binding = pytest.importorskip("torch.numa.binding")

    def run(root, gpu_nodes, mask):
        root = str(root)

        class FsOs:
            path = os.path

            @staticmethod
            def listdir(path):
                return os.listdir(root + path)

        def read(path, *args, **kwargs):
            # Some captures end a value with a NUL, which torch's parser
            # refuses (a real kernel's file has none): torch reads it without.
            with open(root + path) as f:
                return io.StringIO(f.read().replace("\x00", ""))

        monkeypatch.setattr(binding, "open", read, raising=False)
        monkeypatch.setattr(binding, "os", FsOs)
        monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(gpu_nodes))
        monkeypatch.setattr(
            binding,
            "_get_numa_node_index_for_gpu_index",
            lambda *, gpu_index: max(gpu_nodes[gpu_index], 0),
        )
        monkeypatch.setattr(
            binding, "_get_allowed_cpu_indices_for_current_thread", lambda: set(mask)
        )
        names = {
            "node": "node",
            "socket": "socket",
            "exclusive": "exclusive",
            "cache": "core-complex",
        }
        out = {}
        for mode, name in names.items():
            options = binding.NumaOptions(affinity_mode=binding.AffinityMode(name))
            for gpu in range(len(gpu_nodes)):
                try:
                    cpus = binding._get_logical_cpus_to_bind_to(gpu_index=gpu, numa_options=options)
                except RuntimeError as exc:
                    # Its own refusal (fewer cores than GPUs), or a file it lacks.
                    cpus = None if "physical cores" in str(exc) else UNREADABLE
                except ZeroDivisionError:
                    cpus = None  # core-complex on a node with no allowed CPU
                except (OSError, ValueError):
                    cpus = UNREADABLE  # a tree torch cannot read (cpupin can)
                out[mode, gpu] = cpus
        return out

    return run


@pytest.mark.parametrize("name", ["amd-8gpu", "xeon6-b300", "xeon6-pct", "dgx-h100", "xeon-sst-bf"])
def test_the_reference_is_torchs_own_answer_on_the_shipped_hosts(fast_dir, torch_binding, name):
    spec = HOSTS[name]
    machine = machine_of(spec)
    with fast_dir() as root:
        build_tree(spec, root)
        for mask in (spec.online(), frozenset(sorted(spec.online())[::3])):
            got = torch_binding(root, machine.gpu_nodes, mask)
            for (mode, gpu), cpus in got.items():
                want = ref.MODES[mode](machine, gpu, mask)
                assert (cpus or None) == (want or None), (mode, gpu)


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_cpupin_matches_torch_on_the_captured_hosts(unpacked, torch_binding, name):  # noqa: F811
    """Real machines' trees, two made-up GPUs on each node with CPUs:
    decide_binding against torch's code reading the same tree."""
    host = read_host(unpacked[name])
    gpus = []
    for n in host.cpu_nodes:
        for k in range(2):
            address = f"{n.id + 1:04x}:{k + 1:02x}:00.0"
            gpus.append(Gpu(address, "nvidia", 0x10DE, 0x030200, n.id, n.cpus))
    host = replace(host, gpus=tuple(gpus))
    compared = 0
    for mask in (host.default_mask(), frozenset(sorted(host.default_mask())[1::2])):
        got = torch_binding(unpacked[name], [g.node for g in host.gpus], mask)
        for (mode, index), cpus in got.items():
            if cpus == UNREADABLE:
                continue
            address = host.gpus[index].address
            mine = decide_binding(host, mask, device=address, cpus=mode, memory="none")
            if cpus:
                assert mine.cpus == cpus, (name, mode, index, mine.reason)
            else:
                assert mine.cpus == mask and "kept" in mine.reason
            compared += 1
    if compared == 0:
        # Only where torch cannot read a node's CPUs: an older kernel's tree
        # with no node cpulist (cpumap only), which cpupin reads instead.
        nodes = unpacked[name] / "sys/devices/system/node"
        assert not list(nodes.glob("node*/cpulist")), f"torch read nothing of {name}"
        assert host.cpu_nodes
