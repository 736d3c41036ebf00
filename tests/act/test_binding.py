"""Binding a worker process to its GPU's NUMA node: the pure decision on
shipped, captured and random hosts, and the real kernel's CPU masks and
memory policy in a child process (bind_process and cpupin exec)."""

import errno
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin import PlanError
from cpupin.act import binding
from cpupin.cli import main
from cpupin.host.shapes import HOSTS, host_named
from cpupin.host.topology import read_host
from cpupin.plan.binding import Binding, decide_binding
from tests.support.captures import needs_captures
from tests.support.helpers import run, run_python
from tests.support.specs import spec_host
from tests.support.strategies import host_specs

# --- the pure decision -----------------------------------------------------


def check_invariants(host, mask, b, memory="preferred", mems_allowed=None):
    """What every binding must satisfy, whatever the host."""
    assert b.cpus and b.cpus <= mask  # never empty, never outside the mask
    cpu_nodes = {n.id: n.cpus for n in host.nodes if n.cpus}
    if b.node is not None:
        assert b.node in cpu_nodes  # a CPU node, never GPU memory
        on_node = mask & cpu_nodes[b.node]
        # On the node exactly when the node has allowed CPUs.
        assert b.cpus == (on_node or mask)
        assert bool(on_node) == (b.cpus <= cpu_nodes[b.node])
    else:
        assert b.cpus == mask
    if b.memory_policy == "none":
        assert not b.memory_nodes
    else:
        assert b.memory_policy == memory and b.memory_nodes == {b.node}
        assert host.memory_nodes is None or b.node in host.memory_nodes
        assert mems_allowed is None or b.node in mems_allowed
        assert cpu_nodes.get(b.node)  # memory only on a node with CPUs
    assert b.reason == "" or len(b.reason) < 600


@pytest.mark.parametrize("name", sorted(HOSTS))
@pytest.mark.parametrize("memory", ["preferred", "bind", "none"])
def test_every_gpu_of_every_shipped_host(name, memory):
    host = host_named(name)
    mask = host.default_mask()
    for gpu in host.gpus:
        b = decide_binding(host, mask, device=gpu.address, memory=memory)
        check_invariants(host, mask, b, memory)
        if gpu.node is not None:
            node = next(n for n in host.nodes if n.id == gpu.node)
            assert b.node == gpu.node and b.cpus == node.cpus
            assert b.memory_policy == memory and b.reason == ""


def test_dgx_h100_gpu_5_binds_to_node_1():
    host = host_named("dgx-h100")
    b = decide_binding(host, host.cpus, device="0000:ab:00.0")
    assert b == Binding(
        "0000:ab:00.0",
        1,
        frozenset(range(56, 112)) | frozenset(range(168, 224)),
        "preferred",
        frozenset({1}),
    )
    assert b.as_dict()["memory"] == {"policy": "preferred", "nodes": [1]}


def test_a_mask_narrowed_by_the_launcher_is_respected():
    host = host_named("dgx-h100")
    mask = frozenset(range(50, 60))  # a Slurm job across the two sockets
    b = decide_binding(host, mask, device="0000:ab:00.0")
    assert b.cpus == frozenset(range(56, 60)) and b.node == 1


def test_a_mask_outside_the_node_is_kept_with_a_reason():
    host = host_named("dgx-h100")
    mask = frozenset(range(0, 8))
    b = decide_binding(host, mask, device="0000:ab:00.0")
    assert b.cpus == mask and "outside the process mask 0-7" in b.reason
    assert b.memory_policy == "preferred" and b.memory_nodes == {1}  # memory still near the GPU


def test_cpus_keep_moves_nothing():
    host = host_named("dgx-h100")
    b = decide_binding(host, host.cpus, device="0000:ab:00.0", cpus="keep", memory="bind")
    assert b.cpus == host.cpus and b.memory_policy == "bind" and b.node == 1


def test_a_node_outside_mems_allowed_gets_no_policy():
    host = host_named("dgx-h100")
    b = decide_binding(host, host.cpus, node=1, mems_allowed=frozenset({0}))
    assert b.memory_policy == "none" and "Mems_allowed 0" in b.reason


def test_a_node_without_memory_gets_no_policy():
    host = replace(host_named("dgx-h100"), memory_nodes=frozenset({0}))
    b = decide_binding(host, host.cpus, node=1)
    assert b.memory_policy == "none" and "no memory" in b.reason and b.node == 1


def test_grace_hopper_binds_the_cpu_node_never_the_gpu_memory_nodes():
    host = host_named("gh200")
    b = decide_binding(host, host.cpus, device="0009:01:00.0", memory="bind")
    assert b.node == 0 and b.memory_nodes == {0} and b.cpus == host.cpus
    memory_only = decide_binding(host, host.cpus, node=4, memory="bind")
    assert memory_only.node is None and memory_only.memory_policy == "none"
    assert "no CPUs" in memory_only.reason


def test_a_gpu_without_a_node_on_a_multi_node_host_binds_nothing():
    host = host_named("dgx-h100")
    gpu = replace(host.gpus[0], node=None, local_cpus=host.cpus)
    host = replace(host, gpus=(gpu, *host.gpus[1:]))
    b = decide_binding(host, host.cpus, device=gpu.address)
    assert b.node is None and b.cpus == host.cpus and b.memory_policy == "none"
    assert "numa_node -1" in b.reason


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"device": "0000:01:00.0"}, "not a GPU of this host"),
        ({"node": 7}, "node 7 is not a node of this host"),
        ({"node": 0, "cpus": "all"}, "cpus='all'"),
        ({"node": 0, "memory": "weave"}, "memory='weave'"),
        ({}, "exactly one"),
        ({"node": 0, "device": "0000:18:00.0"}, "exactly one"),
    ],
)
def test_bad_requests_name_the_value(kwargs, says):
    host = host_named("dgx-h100")
    with pytest.raises(ValueError, match=says):
        decide_binding(host, host.cpus, **kwargs)


@given(
    spec=host_specs(max_cores=64),
    data=st.data(),
    memory=st.sampled_from(["preferred", "bind", "none"]),
)
def test_random_hosts_masks_and_targets(spec, data, memory):
    host = spec_host(spec)
    cpus = sorted(host.cpus)
    mask = frozenset(data.draw(st.lists(st.sampled_from(cpus), min_size=1, unique=True)))
    mems = data.draw(st.none() | st.frozensets(st.sampled_from([n.id for n in host.nodes])))
    for gpu in host.gpus:
        b = decide_binding(host, mask, device=gpu.address, memory=memory, mems_allowed=mems)
        check_invariants(host, mask, b, memory, mems)
    for node in host.nodes:
        b = decide_binding(host, mask, node=node.id, memory=memory, mems_allowed=mems)
        check_invariants(host, mask, b, memory, mems)


@needs_captures
def test_power9_gpus_bind_to_their_cpu_node_not_the_gpu_memory_nodes(unpacked):  # noqa: F811
    from cpupin import read_host

    host = read_host(unpacked["nvidiagpunumanodes"])
    assert {n.id for n in host.nodes if not n.cpus} == set(range(250, 256))
    assert len(host.gpus) == 6
    nodes = set()
    for gpu in host.gpus:
        b = decide_binding(host, host.cpus, device=gpu.address, memory="bind")
        check_invariants(host, host.cpus, b, "bind")
        assert b.node in (0, 8) and b.memory_nodes == {b.node}
        assert gpu.local_cpus <= b.cpus and "local CPUs lie in node" in b.reason
        nodes.add(b.node)
    assert nodes == {0, 8}


@needs_captures
def test_the_dgx_gb10_binds_its_one_node(unpacked):  # noqa: F811
    from cpupin import read_host

    host = read_host(unpacked["nvidia-dgx-gb10"])
    b = decide_binding(host, host.cpus, node=0, memory="bind")
    assert b.node == 0 and b.cpus == host.cpus and b.memory_nodes == {0}


def test_the_captures_ship_with_the_tests():
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hwloc")
    assert os.path.exists(os.path.join(here, "nvidiagpunumanodes.tar.bz2"))
    assert os.path.exists(os.path.join(here, "COPYING"))


# --- the real kernel, in a child process -----------------------------------


def run_child(code, env=None):
    """The last line of a child's output, as JSON."""
    return json.loads(run_python(code, env).strip().splitlines()[-1])


def numa_maps_policies(text):
    return {line.split()[1] for line in text.splitlines() if len(line.split()) > 1}


CHILD = """
    import json, os
    import cpupin
    from cpupin import _native
    b = cpupin.bind_process(node=0, memory=MEMORY)
    block = bytearray(32 << 20)           # touched after the binding
    for i in range(0, len(block), 4096):
        block[i] = 1
    with open("/proc/self/numa_maps") as f:
        maps = f.read()
    print(json.dumps({
        "binding": b.as_dict(),
        "policy": _native.get_mempolicy()[0],
        "nodes": sorted(_native.get_mempolicy()[1]),
        "maps": maps,
        "mask": sorted(os.sched_getaffinity(0)),
        "process": sorted(cpupin.process_cpus()),
    }))
"""


@pytest.mark.parametrize(
    "memory, mode, shown", [("bind", 2, "bind:0"), ("preferred", 1, "prefer:0")]
)
def test_bind_process_sets_the_policy_the_kernel_then_reports(memory, mode, shown):
    if not os.path.exists("/proc/self/numa_maps"):
        pytest.skip("this kernel shows no /proc/self/numa_maps (built without NUMA)")
    out = run_child(CHILD.replace("MEMORY", repr(memory)))
    assert out["binding"]["memory"] == {"policy": memory, "nodes": [0]}
    assert out["binding"]["reason"] == ""
    assert (out["policy"], out["nodes"]) == (mode, [0])
    assert shown in numa_maps_policies(out["maps"])
    assert out["mask"] == out["process"] == out["binding"]["cpus"]


def test_bind_process_moves_every_thread_and_new_threads_start_there(two_cpus):
    out = run_child(f"""
        import json, os, threading
        import cpupin
        os.sched_setaffinity(0, {{{two_cpus[0]}}})  # a launcher's narrower mask
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()
        b = cpupin.bind_process(node=0, memory="none")
        masks = {{int(x): sorted(os.sched_getaffinity(int(x)))
                  for x in os.listdir("/proc/self/task")}}
        box = []
        n = cpupin.Thread(target=lambda: box.append(sorted(os.sched_getaffinity(0))))
        n.start(); n.join(); stop.set(); t.join()
        print(json.dumps({{"b": b.as_dict(), "masks": list(masks.values()), "new": box[0]}}))
    """)
    # The process mask recorded at import was both CPUs; node 0 holds both.
    assert out["b"]["cpus"] == sorted(two_cpus)
    assert all(m == sorted(two_cpus) for m in out["masks"])
    assert out["new"] == sorted(two_cpus)


def test_other_threads_keep_their_memory_policy_and_the_reason_says_so():
    out = run_child("""
        import json, threading
        import cpupin
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()
        b = cpupin.bind_process(node=0, memory="preferred")
        stop.set(); t.join()
        print(json.dumps(b.as_dict()))
    """)
    assert "1 other thread(s) already running keep their memory policy" in out["reason"]


@pytest.mark.parametrize(
    "err, says", [(errno.EPERM, "CAP_SYS_NICE"), (errno.ENOSYS, "ENOSYS"), (errno.EINVAL, "EINVAL")]
)
def test_a_refused_policy_is_a_reason_never_an_exception(monkeypatch, caplog, err, says):
    """The kernel's refusal is injected at the one door to set_mempolicy;
    CPUs are left alone (cpus='keep') so this process is not changed."""
    monkeypatch.setattr(binding, "_set_mempolicy", lambda mode, nodes: -err)
    monkeypatch.setattr(binding, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="cpupin"):
        for _ in range(2):
            b = binding.bind_process(node=0, cpus="keep", memory="preferred")
            assert b.memory_policy == "none" and not b.memory_nodes
            assert says in b.reason and b.node == 0
    assert len([r for r in caplog.records if says in r.getMessage()]) == 1
    with pytest.raises(OSError, match=says):
        binding.bind_process(node=0, cpus="keep", memory="bind", strict=True)
    b = binding.bind_process(node=0, cpus="keep", memory="bind")  # not strict: a reason
    assert b.memory_policy == "none"


def test_memory_binding_check_says_why_it_cannot(monkeypatch):
    assert binding.memory_binding_check()[0] is True
    monkeypatch.setattr(binding, "_set_mempolicy", lambda mode, nodes: -errno.EPERM)
    ok, why = binding.memory_binding_check()
    assert not ok and "CAP_SYS_NICE" in why


def test_bind_process_refuses_a_device_this_host_lacks():
    if read_host("/").gpus:
        with pytest.raises(PlanError, match="not a GPU of this host"):
            binding.bind_process("0000:3b:00.0", cpus="keep", memory="none")
    else:  # this machine: a device names nothing, and the message says what does
        for device in ("0000:3b:00.0", 0):
            with pytest.raises(PlanError, match=r"has no GPU.*name the node instead: node=0"):
                binding.bind_process(device, cpus="keep", memory="none")
    with pytest.raises(ValueError, match="node -1"):
        binding.bind_process(node=-1)


# --- cpupin exec -----------------------------------------------------------


def cpupin(*args, env=None):
    return run([sys.executable, "-m", "cpupin", *args], env={**os.environ, **(env or {})})


def test_exec_binds_the_command_it_runs():
    code = (
        "import json, os; from cpupin import _native; "
        "print(json.dumps([_native.get_mempolicy()[0], sorted(_native.get_mempolicy()[1]), "
        "os.environ.get('CPUPIN_PROCESS_CPUS'), sorted(os.sched_getaffinity(0)), "
        "open('/proc/self/numa_maps').read()]))"
    )
    out = cpupin("exec", "--node", "0", "--memory", "bind", "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    mode, nodes, env, mask, maps = json.loads(out.stdout)
    assert (mode, nodes) == (2, [0])
    assert env is not None and mask == sorted(int(c) for c in env.replace("-", ",").split(","))
    assert "bind:0" in numa_maps_policies(maps)


@pytest.mark.parametrize("cpus", ["first", "socket"])
def test_exec_interleaves_memory_over_the_chosen_nodes_for_real(cpus):
    """A CPU list (with no target) and socket mode, run for real: the child's
    affinity is the list (or the whole node of this one-package machine),
    its policy MPOL_INTERLEAVE over node 0 as get_mempolicy and numa_maps
    report it."""
    code = (
        "import json, os; from cpupin import _native; "
        "print(json.dumps([_native.get_mempolicy()[0], sorted(_native.get_mempolicy()[1]), "
        "sorted(os.sched_getaffinity(0)), open('/proc/self/numa_maps').read()]))"
    )
    here = sorted(os.sched_getaffinity(0))
    first = str(here[0])
    target = [] if cpus == "first" else ["--node", "0"]
    chosen = first if cpus == "first" else cpus
    out = cpupin(
        "exec",
        *target,
        "--cpus",
        chosen,
        "--memory",
        "interleave",
        "--",
        sys.executable,
        "-c",
        code,
    )
    assert out.returncode == 0, out.stderr
    mode, nodes, mask, maps = json.loads(out.stdout)
    assert (mode, nodes) == (binding._native.MPOL_INTERLEAVE, [0])
    assert mask == ([here[0]] if cpus == "first" else here)
    assert "interleave:0" in numa_maps_policies(maps)


def test_exec_dry_run_json_has_exactly_the_documented_shape():
    out = cpupin(
        "exec", "--host", "dgx-h100", "--device", "0", "--dry-run", "--json", "--", "python", "x"
    )
    data = json.loads(out.stdout)
    assert set(data) == {
        "device",
        "node",
        "mode",
        "cpus",
        "memory",
        "reason",
        "pools",
        "cpus_from",
        "wake_latency_us",
        "argv",
    }
    assert set(data["memory"]) == {"policy", "nodes"}
    assert data["device"] == "0000:18:00.0" and data["node"] == 0
    assert data["argv"] == ["python", "x"] and data["memory"]["nodes"] == [0]
    assert data["cpus"] == list(range(56)) + list(range(112, 168))


def test_cuda_visible_devices_reordered_maps_device_0_to_the_fourth_gpu():
    out = cpupin(
        "exec",
        "--host",
        "dgx-h100",
        "--device",
        "0",
        "--dry-run",
        "--json",
        "--",
        "x",
        env={"CUDA_VISIBLE_DEVICES": "3,1"},
    )
    data = json.loads(out.stdout)
    assert data["device"] == host_named("dgx-h100").gpus[3].address == "0000:5d:00.0"


def test_exec_local_rank_takes_the_device_from_torchrun_or_slurm(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "5")
    argv = ["exec", "--host", "dgx-h100", "--local-rank", "--dry-run", "--json", "--", "x"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "0000:ab:00.0"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "0000:2a:00.0"


@pytest.mark.parametrize(
    "name",
    ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"],
)
def test_exec_local_rank_reads_each_launchers_variable(capsys, monkeypatch, name):
    for other in (
        "LOCAL_RANK",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK",
    ):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "6")
    argv = ["exec", "--host", "dgx-h100", "--local-rank", "--dry-run", "--json", "--", "x"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "0000:ba:00.0"


def test_gpu_index_paths_on_a_host_without_gpus_say_to_name_the_node(tmp_path):
    """exec --local-rank and --device on a GPU-less host: one line naming
    --node, exit 2; --node works there."""
    from cpupin.host.shapes import build_tree

    root = build_tree(replace(HOSTS["dgx-h100"], gpus=()), tmp_path)
    for args, env in ((["--device", "0"], {}), (["--local-rank"], {"LOCAL_RANK": "0"})):
        out = cpupin("exec", "--root", root, "--dry-run", *args, "--", "x", env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "has no GPU" in out.stderr and "cpupin exec --node 0" in out.stderr
    out = cpupin("exec", "--root", root, "--dry-run", "--node", "0", "--", "x")
    assert out.returncode == 0 and "cpus   0-55,112-167" in out.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--host", "dgx-h100", "--gpu", "0000:01:00.0", "--dry-run", "--", "x"], "not a GPU"),
        (["--node", "9", "--dry-run", "--", "x"], "node 9 is not a node"),
        (["--node", "0"], "no command to run"),
        (["--node", "0", "--"], "no command to run"),
        (["--host", "dgx-h100", "--node", "0", "--", "x"], "use them with --dry-run"),
        (["--node", "0", "--memory", "weave", "--", "x"], "invalid choice"),
        (["--node", "0", "--cpus", "nodes", "--", "x"], "--cpus 'nodes': use node, socket"),
        (["--node", "0", "--cpus", "exclusive", "--dry-run", "--", "x"], "name the GPU"),
        (["--", "x"], "name the GPU (--gpu, --device or --local-rank) or the node"),
        (["--local-rank", "--dry-run", "--", "x"], "LOCAL_RANK"),
    ],
)
def test_exec_errors_exit_2_with_a_message(args, says):
    out = cpupin("exec", *args, env={"LOCAL_RANK": "", "SLURM_LOCALID": ""})
    if "LOCAL_RANK" in says:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SLURM_LOCALID")}
        out = run([sys.executable, "-m", "cpupin", "exec", *args], env=env)
    assert out.returncode == 2, out
    assert says in out.stderr and "Traceback" not in out.stderr


def test_exec_of_a_missing_command_exits_127():
    out = cpupin("exec", "--node", "0", "--memory", "none", "--", "no-such-command-here")
    assert out.returncode == 127 and "no-such-command-here" in out.stderr


def test_topo_and_doctor_show_memory():
    out = cpupin("topo", "--host", "gh200")
    assert "node 0   CPUs 0-71 (72 cores), memory" in out.stdout
    assert "node 4   no CPUs, memory" in out.stdout
    out = cpupin("doctor", "--json")
    assert json.loads(out.stdout)["memory_binding"]["possible"] is True


# --- docs/binding.md's recipes, tried ----------------------------------------


def venv_env():
    """PATH with this interpreter's scripts first (cpupin, torchrun)."""
    bindir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def test_torchrun_launches_each_rank_through_cpupin_exec(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun comes with torch (pip install torch==2.13.0)")
    # This machine has no GPU: the ranks answer for the DGX H100 (--dry-run
    # --host), each into a file of its own (two ranks share torchrun's
    # stdout), then run for real bound to node 0.
    base = [torchrun, "--standalone", "--no-python", "--nproc-per-node", "2"]
    dry = (
        "exec cpupin exec --local-rank --host dgx-h100 --dry-run --json -- python "
        f'> {tmp_path}/rank-"$LOCAL_RANK".json'
    )
    out = run([*base, "sh", "-c", dry], venv_env())
    assert out.returncode == 0, out.stderr
    devices = [
        json.loads((tmp_path / f"rank-{rank}.json").read_text())["device"] for rank in (0, 1)
    ]
    assert devices == ["0000:18:00.0", "0000:2a:00.0"]
    # One write a rank, under PIPE_BUF: atomic, whatever the other rank does.
    code = (
        "import os; from cpupin import _native; "
        "os.write(1, b'policy=%d;' % _native.get_mempolicy()[0])"
    )
    # torchrun's own parser would take --node for its --nnodes: through sh.
    real = f'exec cpupin exec --node 0 --memory bind -- {sys.executable} -c "{code}"'
    out = run([*base, "sh", "-c", real], venv_env())
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split(";"))[1:] == ["policy=2", "policy=2"]  # MPOL_BIND, both


SPAWNED = """
import json, multiprocessing as mp, os, sys
import cpupin

def worker(q):
    b = cpupin.bind_process(node=0, memory="bind")   # first thing in the worker
    from cpupin import _native
    pin = cpupin.pin_step_thread(sorted(b.cpus)[-1:])  # then pin: inside the bound mask
    q.put([b.as_dict(), _native.get_mempolicy()[0], sorted(os.sched_getaffinity(0))])

def wrapped(q):
    from cpupin import _native
    q.put([_native.get_mempolicy()[0], os.environ.get("CPUPIN_PROCESS_CPUS")])

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,)); p.start(); first = q.get(); p.join()
    if len(sys.argv) > 1:
        mp.set_executable(sys.argv[1])
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=wrapped, args=(q,)); p.start(); second = q.get(); p.join()
    else:
        second = None
    print(json.dumps([first, second]))
"""


def test_spawned_workers_bind_themselves_or_start_bound_through_a_wrapper(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SPAWNED)
    wrapper = tmp_path / "bound-python"
    # docs/binding.md's wrapper, with --node 0 for --device on this GPU-less machine.
    wrapper.write_text(f'#!/bin/sh\nexec cpupin exec --node 0 -- {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    out = run([sys.executable, str(script), str(wrapper)], venv_env())
    assert out.returncode == 0, out.stderr
    (binding_, mode, mask), (wrapped_mode, wrapped_cpus) = json.loads(out.stdout)
    assert binding_["memory"] == {"policy": "bind", "nodes": [0]} and mode == 2
    assert mask == sorted(binding_["cpus"])[-1:]  # the step pin validated inside the node
    assert wrapped_mode == 1 and wrapped_cpus  # preferred, with the bound mask passed on


BINDING_DOC = (Path(__file__).resolve().parents[2] / "docs" / "binding.md").read_text()

WORKER = """
import json, os, sys
import cpupin
from cpupin import _native

def say(value):  # one write a line: under PYTHONUNBUFFERED, print writes the newline apart
    sys.stdout.write(json.dumps(value) + "\\n")
    sys.stdout.flush()

def worker_main(index):
    say([index, _native.get_mempolicy()[0], os.environ.get("CPUPIN_PROCESS_CPUS"),
         os.environ.get("WORKER_DEVICE")])

if __name__ == "__main__":
    n_workers = 2
RECIPE
    tracker = resource_tracker._resource_tracker._pid
    with open(f"/proc/{tracker}/environ", "rb") as f:
        say(b"CPUPIN_PROCESS_CPUS=" in f.read())
"""


def test_the_readmes_bound_python_recipe_runs_without_path(tmp_path):
    """docs/binding.md's wrapper and spawn loop as written, but for two changes:
    the interpreter is this one, and --node 0 stands for --device (this
    machine has no GPU). PATH names nothing: the absolute paths carry it.
    Each worker starts bound with its own WORKER_DEVICE; the resource
    tracker, started first through the same wrapper, runs unbound."""
    wrapper_text = re.search(
        r"```sh\n(#!/bin/sh\n# /opt/serve/bound-python.*?)```", BINDING_DOC, re.S
    )
    recipe = re.search(r"```py\n(import multiprocessing, os\n.*?)```", BINDING_DOC, re.S)
    assert wrapper_text and recipe
    wrapper = tmp_path / "bound-python"
    text = wrapper_text.group(1).replace("/opt/serve/venv/bin/python", sys.executable)
    wrapper.write_text(text.replace('--device "$WORKER_DEVICE"', "--node 0"))
    wrapper.chmod(0o755)
    body = recipe.group(1).replace("/opt/serve/bound-python", str(wrapper))
    script = tmp_path / "serve.py"
    script.write_text(WORKER.replace("RECIPE", textwrap.indent(body, "    ")))
    env = {k: v for k, v in os.environ.items() if k not in ("CPUPIN_PROCESS_CPUS", "WORKER_DEVICE")}
    env["PATH"] = "/nonexistent"
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]  # in any order
    workers = [line for line in lines if isinstance(line, list)]
    (tracker_bound,) = [line for line in lines if isinstance(line, bool)]
    assert sorted(w[0] for w in workers) == [0, 1]
    for index, mode, cpus, device in workers:
        assert device == str(index) and mode == 1 and cpus  # bound: preferred policy, mask passed
    assert tracker_bound is False


def test_the_docs_torchrun_line_for_a_host_without_gpus_runs_as_written(tmp_path):
    """docs/binding.md's second torchrun line, run as written by the real
    torchrun (train.py a script that says where each rank runs)."""
    import re
    import shlex

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun comes with torch (pip install torch==2.13.0)")
    readme = (Path(__file__).resolve().parents[2] / "docs" / "binding.md").read_text()
    (line,) = [m for m in re.findall(r"^torchrun .*$", readme, re.MULTILINE) if "--node 0" in m]
    # Each rank writes a file of its own: two ranks share torchrun's stdout.
    (tmp_path / "train.py").write_text(
        "import json, os\n"
        "rank = os.environ['LOCAL_RANK']\n"
        "with open(f'rank-{rank}.json', 'w') as f:\n"
        "    json.dump([rank, sorted(os.sched_getaffinity(0)), "
        "os.environ.get('CPUPIN_PROCESS_CPUS')], f)\n"
    )
    out = subprocess.run(
        shlex.split(line), cwd=tmp_path, env=venv_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = sorted(json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    from cpupin.host.topology import read_host
    from cpupin.process.mask import process_cpus

    node0 = sorted(read_host("/").nodes[0].cpus & process_cpus())
    assert [r[0] for r in ranks] == ["0", "1"]
    assert all(r[1] == node0 and r[2] for r in ranks)


def test_exec_without_a_target_suggests_one_that_works_on_this_host(capsys):
    assert main(["exec", "--", "true"]) == 2
    err = capsys.readouterr().err
    from cpupin.host.topology import read_host

    if read_host("/").gpus:
        assert "cpupin exec --local-rank" in err
    else:
        assert "cpupin exec --node 0 -- python serve.py (this host has no GPU)" in err
    assert main(["exec", "--host", "dgx-h100", "--dry-run", "--", "true"]) == 2
    assert "cpupin exec --local-rank" in capsys.readouterr().err


BINDING_MODES = ("node", "socket", "exclusive", "cache", "keep")


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_the_host_a_binding_reads_binds_as_the_whole_host(name, tmp_path):
    """bind_process reads the host without what no binding looks at (idle
    states, core classes, the hypervisor flag, cache domains unless
    cpus='cache'): every binding of every node and GPU, in every mode, is
    the one the whole host gives, and the parts it reads are the same."""
    from cpupin.host.shapes import build_tree
    from cpupin.host.topology import read_host_for_binding

    root = build_tree(HOSTS[name], tmp_path)
    whole = read_host(root)
    for caches in (False, True):
        brief = read_host_for_binding(root, caches=caches)
        for part in ("cpus", "nodes", "gpus", "smt", "cpuset", "quota", "memory_nodes", "cgroup"):
            assert getattr(brief, part) == getattr(whole, part), part
        assert [c.cpus for c in brief.cores] == [c.cpus for c in whole.cores]
        assert [c.package for c in brief.cores] == [c.package for c in whole.cores]
        assert (brief.caches, brief.cache_level) == (
            (whole.caches, whole.cache_level) if caches else ((), None)
        )
        mask = whole.default_mask()
        targets = [{"node": n.id} for n in whole.nodes] + [
            {"device": g.address} for g in whole.gpus
        ]
        for mode in BINDING_MODES if caches else [m for m in BINDING_MODES if m != "cache"]:
            for target in targets:
                decided = []
                for host in (whole, brief):
                    try:
                        decided.append(decide_binding(host, mask, cpus=mode, **target))
                    except (PlanError, ValueError) as exc:
                        decided.append(str(exc))
                assert decided[0] == decided[1], (mode, target)
