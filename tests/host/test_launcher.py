"""How the process got its CPUs: cpuset, affinity, quota, the Kubernetes QoS
class, and the warning when the CPUs lie away from the GPU."""

import json
import re
import shlex
import sys
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.cli import main
from cpupin.host.launcher import explain_cpus, launcher_of, qos_class
from cpupin.host.shapes import HOSTS, build_tree
from cpupin.host.topology import read_host
from tests.support.helpers import run

H100 = HOSTS["dgx-h100"]  # two nodes of 56 cores, siblings at +112
POD = "/kubepods.slice/kubepods-{}.slice/kubepods-{}-pod1f2e.slice/cri-containerd-ab12.scope"
GUARANTEED = "/kubepods.slice/kubepods-pod1f2e.slice/cri-containerd-ab12.scope"


@pytest.mark.parametrize(
    "path, qos, who",
    [
        (POD.format("burstable", "burstable"), "Burstable", "kubernetes"),
        (POD.format("besteffort", "besteffort"), "BestEffort", "kubernetes"),
        (GUARANTEED, "Guaranteed", "kubernetes"),
        ("/kubepods/burstable/pod1f2e/ab12", "Burstable", "kubernetes"),
        ("/kubepods/pod1f2e/ab12", "Guaranteed", "kubernetes"),
        ("/slurm/uid_1000/job_42/step_0/user/task_0", None, "slurm"),
        ("/system.slice/slurmstepd.scope/job_42/step_0", None, "slurm"),
        ("/system.slice/docker-ab12.scope", None, "docker"),
        ("/docker/ab12", None, "docker"),
        ("/user.slice/user-0.slice/session-3.scope", None, "systemd"),
        ("/", None, None),
        (None, None, None),
    ],
)
def test_qos_class_and_launcher_from_the_cgroup_path(path, qos, who):
    assert qos_class(path) == qos
    assert launcher_of(path) == who


@given(st.text(max_size=300))
def test_any_path_gives_an_answer_and_never_raises(path):
    assert qos_class(path) in (None, "Guaranteed", "Burstable", "BestEffort")
    assert launcher_of(path) in (None, "kubernetes", "slurm", "docker", "systemd")


def host_of(tmp_path, **changes):
    return read_host(build_tree(replace(H100, **changes), tmp_path))


def test_a_guaranteed_pod_with_a_cpuset_names_kubernetes_static_policy(tmp_path):
    host = host_of(tmp_path, cgroup_path=GUARANTEED, cpuset="4-7,116-119")
    origin = explain_cpus(host, host.default_mask())
    assert origin.source == "cpuset" and origin.launcher == "kubernetes"
    assert origin.qos == "Guaranteed"
    assert "allows 8 of the host's 224 CPUs (4-7,116-119)" in origin.lines[0]
    assert "static CPU manager" in origin.lines[0]


def test_a_burstable_pod_with_a_quota_roams(tmp_path):
    host = host_of(
        tmp_path, cgroup_path=POD.format("burstable", "burstable"), cpu_max="400000 100000"
    )
    origin = explain_cpus(host, host.cpus)
    assert origin.source == "quota" and origin.qos == "Burstable"
    assert "quota of 4 CPU(s)" in origin.lines[0] and "roam over all 224 CPUs" in origin.lines[0]
    assert "default 'none' CPU manager policy" in origin.lines[0]
    assert any("only a Guaranteed pod" in line for line in origin.lines)


def test_a_slurm_step_and_a_narrower_affinity(tmp_path):
    host = host_of(tmp_path, cgroup_path="/slurm/uid_0/job_7/step_0", cpuset="0-27,112-139")
    origin = explain_cpus(host, frozenset(range(0, 8)))
    assert origin.source == "affinity" and origin.launcher == "slurm"
    assert "Slurm" in origin.lines[0] and "narrower still: 8 CPUs (0-7)" in origin.lines[1]


def test_cpus_on_another_node_than_the_gpu_warn_and_say_what_to_ask_for(tmp_path):
    host = host_of(tmp_path, cpuset="0-27")
    gpu = host.gpus[4]  # node 1
    origin = explain_cpus(host, host.default_mask(), [(gpu.address, 1)])
    (warning,) = origin.warnings
    assert f"GPU {gpu.address} is on node 1" in warning and "on node 0" in warning
    assert "Topology Manager" in warning and "--gpu-bind=closest" in warning
    assert not explain_cpus(host, host.default_mask(), [(host.gpus[0].address, 0)]).warnings


def test_a_hostile_cgroup_path_is_shown_printable_and_short(tmp_path):
    root = build_tree(H100, tmp_path)
    (tmp_path / "proc/self/cgroup").write_text("0::/kubepods/\x1b[31mred\x07" + "x" * 9000 + "\n")
    host = read_host(root)
    assert host.cgroup is not None and host.cgroup.isprintable() and len(host.cgroup) <= 4096
    origin = explain_cpus(host, host.cpus)
    assert all(line.isprintable() and len(line) < 400 for line in origin.lines)


def test_doctor_and_exec_say_where_the_cpus_came_from(tmp_path, capsys):
    root = build_tree(replace(H100, cgroup_path=GUARANTEED, cpuset="56-59"), tmp_path)
    assert main(["doctor", "--root", root]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpus     the cgroup's cpuset allows 4 of the host's 224 CPUs", out, re.M)
    assert re.search(r"^         a Kubernetes pod of QoS class Guaranteed$", out, re.M)
    assert main(["doctor", "--root", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["cpus_from"]
    assert data["source"] == "cpuset" and data["qos"] == "Guaranteed"
    argv = ["exec", "--root", root, "--gpu", "0000:18:00.0", "--dry-run"]
    assert main([*argv, "--", "x"]) == 0
    out = capsys.readouterr().out
    assert "warn   GPU 0000:18:00.0 is on node 0, and none of the process's CPUs are" in out
    assert main([*argv, "--json", "--", "x"]) == 0
    assert json.loads(capsys.readouterr().out)["cpus_from"]["warnings"]


def test_doctor_on_this_machine_says_where_its_cpus_came_from(capsys):
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["cpus_from"]
    assert data["source"] in ("host", "cpuset", "affinity", "quota") and data["lines"]


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_plan_on_a_host_without_gpus_suggests_a_command_that_works(tmp_path, cores):
    """The suggestion is run as given and must plan, or say why none can."""
    spec = replace(HOSTS["h100-vm"], gpus=(), cores_per_node=cores, threads=1)
    root = build_tree(spec, tmp_path)
    # The default setting is off: nothing is pinned, no error, and the same
    # suggestion; auto is an error that makes it too.
    out = run([sys.executable, "-m", "cpupin", "plan", "--root", root])
    assert out.returncode == 0 and "has no GPU" in out.stdout
    auto = run([sys.executable, "-m", "cpupin", "plan", "--root", root, "--setting", "auto"])
    assert auto.returncode == 2 and "has no GPU" in auto.stderr
    if cores == 1:
        assert "widen the mask" in out.stdout and "widen the mask" in auto.stderr
        return
    suggested = re.search(r"as in (cpupin plan [^(]+?) \(", out.stdout).group(1)
    assert suggested in auto.stderr
    again = run([sys.executable, "-m", *shlex.split(suggested), "--root", root])
    assert again.returncode == 0, again.stderr
    assert "step 0 on" in again.stdout


def test_a_binding_whose_gpu_node_the_mask_misses_says_what_to_ask_the_launcher_for(tmp_path):
    """What a real cpupin exec prints (the binding's reason) carries the same
    advice as the doctor's warning."""
    from cpupin.plan.binding import decide_binding

    host = host_of(tmp_path)
    got = decide_binding(host, frozenset(range(8)), device=host.gpus[4].address)
    assert got.cpus == set(range(8)) and "the mask is kept" in got.reason
    assert "Topology Manager" in got.reason and "--gpu-bind=closest" in got.reason
    by_node = decide_binding(host, frozenset(range(8)), node=1)
    assert "Topology Manager" not in by_node.reason  # no GPU named: no launcher to blame
