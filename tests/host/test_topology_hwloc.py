"""The topology reader on real machines' captures, against hwloc's answer."""

import os
import shutil
import subprocess

import pytest

from cpupin.host.shapes import HOSTS, build_tree
from cpupin.host.topology import read_host
from tests.support.captures import CAPTURES, NAMES, needs_captures
from tests.support.hwloc_oracle import (
    caches_from_console,
    caches_from_xml,
    from_console,
    from_xml,
    kinds_from_console,
    kinds_from_xml,
)


def oracle(name):
    console = CAPTURES / f"{name}.console"
    if console.exists():
        return from_console(console.read_text())
    return from_xml((CAPTURES / f"{name}.xml").read_text())


def oracle_caches_and_kinds(name):
    console = CAPTURES / f"{name}.console"
    if console.exists():
        text = console.read_text()
        return caches_from_console(text), kinds_from_console(text)
    text = (CAPTURES / f"{name}.xml").read_text()
    return caches_from_xml(text), kinds_from_xml(text)


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_last_level_caches_match_hwloc(unpacked, name):
    """Each capture's last-level cache domains, as hwloc groups its PUs under
    its deepest cache objects (within the PUs hwloc shows)."""
    caches, _ = oracle_caches_and_kinds(name)
    _, _, pus = oracle(name)
    host = read_host(unpacked[name])
    ours = {domain & pus for domain in host.caches} - {frozenset()}
    caches = caches - {frozenset()}  # hwloc keeps a cache the cgroup hides, empty
    if not caches:
        assert not host.caches
        return
    assert ours == caches


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_core_classes_match_hwloc_kinds(unpacked, name):
    """Where hwloc finds CPU kinds (hybrid Intel, the GB10's big and little
    Arm cores), the classes are those kinds in the same order; where it finds
    one kind or none, there is at most one class."""
    _, kinds = oracle_caches_and_kinds(name)
    _, _, pus = oracle(name)
    host = read_host(unpacked[name])
    ours = [
        frozenset(cpu for core in host.cores if core.rank == c.rank for cpu in core.cpus) & pus
        for c in host.classes
    ]
    if len(kinds) < 2:
        assert len(ours) <= 1
    else:
        assert ours == kinds


@needs_captures
def test_every_capture_has_an_oracle():
    for name in NAMES:
        assert (CAPTURES / f"{name}.console").exists() or (CAPTURES / f"{name}.xml").exists()


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_cores_match_hwloc(unpacked, name):
    cores, _, pus = oracle(name)
    host = read_host(unpacked[name])
    ours = {frozenset(core.cpus) & pus for core in host.cores} - {frozenset()}
    assert ours == cores
    assert host.cpus >= pus


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_numa_nodes_match_hwloc(unpacked, name):
    _, nodes, pus = oracle(name)
    host = read_host(unpacked[name])
    ours = {node.id: node.cpus & pus for node in host.nodes if node.cpus & pus}
    assert ours == {n: cpus for n, cpus in nodes.items() if cpus}


@needs_captures
@pytest.mark.parametrize("name", NAMES)
def test_a_capture_reads_without_a_traceback(unpacked, name):
    host = read_host(unpacked[name])
    assert host.cpus
    assert all(isinstance(reason, str) for reason in host.reasons)


LSTOPO = shutil.which("lstopo-no-graphics")


def hwloc_reads(root):
    """hwloc's cores and nodes for a tree (its x86 backend off: it would mix
    in this machine's own CPUID)."""
    env = {**os.environ, "HWLOC_FSROOT": str(root), "HWLOC_COMPONENTS": "-x86"}
    out = subprocess.run(
        [LSTOPO, "--of", "xml", "-"], env=env, capture_output=True, text=True, check=True
    )
    return (*from_xml(out.stdout), caches_from_xml(out.stdout), kinds_from_xml(out.stdout))


@pytest.mark.skipif(LSTOPO is None, reason="needs hwloc's lstopo (apt-get install hwloc)")
@pytest.mark.parametrize("name", sorted(HOSTS))
def test_the_shipped_hosts_as_hwloc_reads_their_trees(fast_dir, name):
    """The builder writes trees that hwloc reads as the spec says, so they are
    trees a real kernel could show."""
    with fast_dir() as root:
        build_tree(HOSTS[name], root)
        cores, nodes, pus, caches, kinds = hwloc_reads(root)
        host = read_host(root)
    assert set(host.caches) == caches
    classes = [
        frozenset(c for core in host.cores if core.rank == k.rank for c in core.cpus)
        for k in host.classes
    ]
    assert classes == kinds if len(kinds) > 1 else len(classes) <= 1
    assert pus == host.cpus
    assert cores == {frozenset(core.cpus) for core in host.cores}
    assert {n: c for n, c in nodes.items() if c} == {n.id: n.cpus for n in host.cpu_nodes}
