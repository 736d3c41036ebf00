"""The plan in Kubernetes' and the NRI balloons policy's terms: plan --emit
k8s|nri-balloons against the schema of what each reads, golden files of the
shipped hosts, random hosts, and verify in containers laid out as the
kubelet's static CPU manager lays them out."""

import copy
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cpupin import PlanError
from cpupin.host.shapes import HOSTS, build_tree, host_named
from cpupin.host.topology import cuda_gpus
from cpupin.plan.k8s import (
    balloons_policy,
    check_k8s_rank,
    k8s_manifest,
    k8s_plan,
    parse_quantity,
    to_yaml,
)
from cpupin.plan.placement import place
from tests.support.launchers import SHIPPED, cpupin
from tests.support.specs import spec_host
from tests.support.strategies import host_specs, masks

GOLDEN = Path(__file__).parent.parent / "data" / "k8s"

# --- What the NRI balloons policy reads --------------------------------------
#
# The fields, types and enums cpupin emits, as the policy's CRD
# (containers/nri-plugins, config/crd/bases/config.nri_balloonspolicies.yaml,
# group config.nri, version v1alpha1) declares them; written here as a JSON
# schema of our own. The CRD itself keeps unknown fields out by pruning them
# silently, so this schema refuses any field it does not list: a misspelt
# field fails here instead of vanishing on the cluster.

_STRINGS = {"type": "array", "items": {"type": "string"}}
_BALLOON_TYPE = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "namespaces": _STRINGS,
        "minCPUs": {"type": "integer"},
        "maxCPUs": {"type": "integer"},
        "minBalloons": {"type": "integer"},
        "maxBalloons": {"type": "integer"},
        "allocatorPriority": {"enum": ["high", "normal", "low", "none"]},
        "preferCloseToDevices": _STRINGS,
        "cpuClass": {"type": "string"},
        "irqMode": {"enum": ["", "sink", "isolate"]},
        "preferSpreadOnPhysicalCores": {"type": "boolean"},
        "hideHyperthreads": {"type": "boolean"},
        "pinMemory": {"type": "boolean"},
        "shareIdleCPUsInSame": {
            "enum": ["", "system", "package", "die", "numa", "l2cache", "core", "thread"]
        },
    },
}
BALLOONS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "config.nri/v1alpha1"},
        "kind": {"const": "BalloonsPolicy"},
        "metadata": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}},
        },
        "spec": {
            "type": "object",
            "required": ["reservedResources"],
            "additionalProperties": False,
            "properties": {
                "reservedResources": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                },
                "availableResources": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                },
                "pinCPU": {"type": "boolean"},
                "pinMemory": {"type": "boolean"},
                "balloonTypes": {"type": "array", "items": _BALLOON_TYPE},
                "control": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cpu": {
                            "type": "object",
                            "required": ["classes"],
                            "additionalProperties": False,
                            "properties": {
                                "classes": {
                                    "type": "object",
                                    "additionalProperties": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {"disabledCstates": _STRINGS},
                                    },
                                }
                            },
                        }
                    },
                },
            },
        },
    },
}

# --- What the kubelet and a pod spec read -----------------------------------

_QTY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"}
KUBELET_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "cpuManagerPolicy", "reservedSystemCPUs"],
    "properties": {
        "apiVersion": {"const": "kubelet.config.k8s.io/v1beta1"},
        "kind": {"const": "KubeletConfiguration"},
        "cpuManagerPolicy": {"enum": ["none", "static"]},
        "cpuManagerPolicyOptions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"full-pcpus-only": {"enum": ["true", "false"]}},
        },
        "topologyManagerPolicy": {
            "enum": ["none", "best-effort", "restricted", "single-numa-node"]
        },
        "topologyManagerScope": {"enum": ["container", "pod"]},
        "reservedSystemCPUs": {
            "type": "string",
            "pattern": r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$",
        },
    },
}
_AMOUNTS = {
    "type": "object",
    "required": ["cpu", "memory"],
    "additionalProperties": False,
    "properties": {
        # Whole CPUs: the static CPU manager gives CPUs of their own only then.
        "cpu": {"type": "string", "pattern": "^[1-9][0-9]*$"},
        "memory": _QTY,
        "nvidia.com/gpu": {"const": "1"},
    },
}
CONTAINERS_SCHEMA = {
    "type": "object",
    "required": ["containers"],
    "additionalProperties": False,
    "properties": {
        "containers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "resources"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                    "env": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "value"],
                            "properties": {
                                "name": {"type": "string"},
                                "value": {"type": "string"},
                            },
                        },
                    },
                    "resources": {
                        "type": "object",
                        "required": ["requests", "limits"],
                        "additionalProperties": False,
                        "properties": {"requests": _AMOUNTS, "limits": _AMOUNTS},
                    },
                },
            },
        }
    },
}


def cpus_of(text):
    from cpupin.cpulist import parse_cpulist

    return parse_cpulist(text)


def check_manifest(host, k, text):
    """The manifest reads as YAML, each document against its schema, and it
    says what the plan says: a Guaranteed container a rank."""
    kubelet, pod = list(yaml.safe_load_all(text))[-2:]
    jsonschema.validate(kubelet, KUBELET_SCHEMA)
    jsonschema.validate(pod, CONTAINERS_SCHEMA)
    assert cpus_of(kubelet["reservedSystemCPUs"]) == k.reserved
    assert len(pod["containers"]) == len(k.plan.ranks)
    for rank, (c, b) in enumerate(zip(pod["containers"], k.plan.ranks, strict=True)):
        assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed
        assert int(c["resources"]["requests"]["cpu"]) == len(b.cpus)
        assert ("nvidia.com/gpu" in c["resources"]["requests"]) == (b.device is not None)
        assert c["env"] == [{"name": "LOCAL_RANK", "value": str(rank)}]
    return kubelet, pod


def check_balloons(host, k, text):
    """The policy reads as YAML and against the balloons CRD's schema, and
    it says what the plan says."""
    (policy,) = list(yaml.safe_load_all(text))
    jsonschema.validate(policy, BALLOONS_SCHEMA)
    spec = policy["spec"]
    assert spec["reservedResources"] == {"cpu": "cpuset:" + to_list(k.reserved)}
    ranks = [t for t in spec["balloonTypes"] if t["name"].startswith("cpupin-rank-")]
    assert [t["name"] for t in ranks] == [f"cpupin-rank-{r}" for r in range(len(k.plan.ranks))]
    for t, b in zip(ranks, k.plan.ranks, strict=True):
        assert t["minCPUs"] == t["maxCPUs"] == len(b.cpus)
        assert t["minBalloons"] == t["maxBalloons"] == 1
        want = [f"/sys/bus/pci/devices/{b.device}"] if b.device else None
        assert t.get("preferCloseToDevices") == want
    sizes = sum(t["minCPUs"] for t in ranks) + len(k.reserved)
    assert sizes <= len(k.plan.mask | k.reserved)
    assert spec["balloonTypes"][-1]["name"] == "shared"
    return policy


def to_list(cpus):
    from cpupin.cpulist import format_cpulist

    return format_cpulist(cpus)


# --- Golden files and the shipped hosts --------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("emit", ["k8s", "nri-balloons"])
def test_plan_emit_prints_the_golden_yaml_of_each_shipped_host(name, emit):
    """tests/data/k8s/HOST-EMIT.yaml, as reviewed; and each is valid against
    its schema and says what the plan says."""
    extra = ["--rank-memory", "64Gi"] if emit == "k8s" else ["--wake-latency", "2"]
    out = cpupin("plan", "--emit", emit, "--host", name, "--mode", "exclusive", *extra)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GOLDEN / f"{name}-{emit}.yaml").read_text()
    host = host_named(name)
    k = k8s_plan(host, host.cpus, len(cuda_gpus(host)), mode="exclusive")
    if emit == "k8s":
        check_manifest(host, k, out.stdout)
    else:
        check_balloons(host, k, out.stdout)


def test_dgx_h100_keeps_one_core_off_the_step_cores_and_aligns_each_rank():
    host = host_named("dgx-h100")
    k = k8s_plan(host, host.cpus, 8, mode="exclusive")
    steps = place(host, host.cpus, [g.address for g in cuda_gpus(host)], "auto").cpus
    assert k.reserved == {111, 223} and not k.reserved & steps
    assert k.full_cores
    kubelet, _pod = check_manifest(host, k, k8s_manifest(host, k, "64Gi"))
    assert kubelet["topologyManagerPolicy"] == "single-numa-node"
    assert kubelet["cpuManagerPolicyOptions"] == {"full-pcpus-only": "true"}
    for b in k.plan.ranks:
        assert {host.node_of(c) for c in b.cpus} == {b.node}


def test_the_balloons_cpu_class_disables_the_states_slower_than_the_hold():
    host = host_named("dgx-h100")  # POLL 0, C1 1, C1E 2, C6 290 µs
    k = k8s_plan(host, host.cpus, 8, mode="exclusive")
    for us, states in ((0, ["C1", "C1E", "C6"]), (2, ["C6"]), (290, None)):
        policy = check_balloons(host, k, balloons_policy(host, k, us))
        classes = policy["spec"].get("control", {}).get("cpu", {}).get("classes")
        if states is None:
            assert classes is None
            assert all("cpuClass" not in t for t in policy["spec"]["balloonTypes"])
        else:
            assert classes == {"cpupin-step": {"disabledCstates": states}}
            assert all(
                t["cpuClass"] == "cpupin-step"
                for t in policy["spec"]["balloonTypes"]
                if t["name"] != "shared"
            )


def test_the_schema_test_can_fail():
    """The schemas refuse a wrong enum, a wrong type and an unknown field."""
    host = host_named("gh200")
    k = k8s_plan(host, host.cpus, 1)
    (policy,) = yaml.safe_load_all(balloons_policy(host, k, 0))
    jsonschema.validate(policy, BALLOONS_SCHEMA)
    for path, value in (
        (("balloonTypes", 0, "irqMode"), "isolated"),
        (("balloonTypes", 0, "minCPUs"), "71"),
        (("balloonTypes", 0, "minCpus"), 71),
        (("pinCPU",), "true"),
    ):
        bad = copy.deepcopy(policy)
        where = bad["spec"]
        for step in path[:-1]:
            where = where[step]
        where[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, BALLOONS_SCHEMA)


def test_ranks_that_would_share_cpus_are_a_plan_kubernetes_cannot_express():
    out = cpupin("plan", "--emit", "k8s", "--host", "dgx-h100", "--rank-memory", "8Gi")
    assert out.returncode == 2
    assert "ranks 0 and 1 both want CPU" in out.stderr and "--mode exclusive" in out.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--emit", "k8s", "--host", "gh200"], "--emit k8s needs --rank-memory SIZE"),
        (["--emit", "k8s", "--host", "gh200", "--rank-memory", "lots"], "--rank-memory 'lots'"),
        (["--emit", "k8s", "--host", "gh200", "--rank-memory", "0Gi"], "--rank-memory '0Gi'"),
        (["--emit", "slurm", "--host", "gh200", "--rank-memory", "8Gi"], "goes with --emit k8s"),
        (["--emit", "k8s", "--host", "gh200", "--wake-latency", "2"], "--emit nri-balloons"),
        (["--emit", "nri-balloons", "--host", "gh200", "--batch"], "goes with --emit slurm"),
        (["--emit", "nri-balloons", "--host", "gh200", "--wake-latency", "-1"], "--wake-latency"),
        (["--emit", "nri-balloons", "--host", "gh200", "--mask", "0"], "1 core(s)"),
    ],
)
def test_plan_emit_k8s_refuses_in_one_line_naming_the_value(argv, says):
    out = cpupin("plan", *argv)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and says in out.stderr.splitlines()[-1]


def test_a_memory_quantity_is_kubernetes_spelling_or_refused():
    assert parse_quantity(" 64Gi ") == "64Gi" and parse_quantity("1.5G") == "1.5G"
    for bad in ("", "64GB", "-1Gi", "1e9", "0", "64 Gi", "x" * 100):
        with pytest.raises(ValueError, match="--rank-memory"):
            parse_quantity(bad)


def test_plan_emit_k8s_json_carries_the_yaml_and_the_plan():
    out = cpupin("plan", "--emit", "k8s", "--host", "h100-vm", "--rank-memory", "32Gi", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["launcher"] == "k8s" and data["reserved"] == [36, 37]
    assert data["ranks"][0]["cpus"] == list(range(36)) + [38, 39]
    assert list(yaml.safe_load_all(data["yaml"]))[-1]["containers"][0]["name"] == "rank-0"


@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.text(max_size=12),
            st.integers(),
            st.booleans(),
            st.lists(st.text(max_size=5), max_size=3),
        ),
        max_size=5,
    )
)
def test_the_yaml_writer_reads_back_as_written(value):
    """Every string stays a string (no "yes" read as true, no "0x1" as a
    number), every key and value round-trips through a YAML parser."""
    assert yaml.safe_load(to_yaml({"v": value})) == {"v": value}


# --- Random hosts -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_hosts_plan_containers_of_their_own_and_valid_yaml(data):
    """Every CPU emitted is the host's and the mask's; no two ranks share a
    CPU, nor a rank and the system's core; the system's core holds no step
    CPU; GPU ranks sit on their GPU's node where the mode says so; and both
    documents validate."""
    spec = data.draw(host_specs(max_cores=64))
    host = spec_host(spec)
    mask = data.draw(masks(host))
    gpus = cuda_gpus(host)
    mode = data.draw(st.sampled_from(["node", "exclusive"]))
    if gpus:
        ranks, node = data.draw(st.integers(1, len(gpus))), None
    else:
        ranks, node = (
            data.draw(st.integers(1, 4)),
            data.draw(st.sampled_from([n.id for n in host.nodes])),
        )
    try:
        k = k8s_plan(host, mask, ranks, mode=mode, node=node)
    except PlanError:
        assume(False)
    seen = set(k.reserved)
    assert k.reserved and k.reserved <= mask
    for b in k.plan.ranks:
        assert b.cpus and b.cpus <= mask & host.cpus
        assert not b.cpus & seen
        seen |= b.cpus
    if node is None:
        steps = place(host, mask, [g.address for g in gpus[:ranks]], "auto").cpus
        assert not k.reserved & steps
        for b, g in zip(k.plan.ranks, gpus, strict=False):
            assert b.device == g.address
            # On its GPU's node, or the binding says why not (the node has
            # none of the mask's CPUs, the GPU has no node).
            home = next((n.cpus for n in host.nodes if n.id == g.node), frozenset())
            assert b.cpus <= home or b.reason, (b, g)
    check_manifest(host, k, k8s_manifest(host, k, "1Gi"))
    check_balloons(host, k, balloons_policy(host, k, data.draw(st.integers(0, 500))))


# --- verify in a Kubernetes container ----------------------------------------

H100 = HOSTS["dgx-h100"]
GUARANTEED = "/kubepods.slice/kubepods-pod1f2e.slice/cri-containerd-ab12.scope"
BURSTABLE = (
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e.slice/"
    "cri-containerd-ab12.scope"
)


def container(tmp_path, cgroup, cpuset):
    """A DGX H100 seen from inside a container whose cgroup the kubelet made."""
    return build_tree(replace(H100, cgroup_path=cgroup, cpuset=cpuset), tmp_path)


def verify(root, rank, *extra):
    return cpupin(
        "verify", "--root", root, "--ranks", "8", "--mode", "exclusive", "--rank", str(rank), *extra
    )


def test_verify_agrees_with_exclusive_cpus_the_static_cpu_manager_chose(tmp_path):
    # 14 cores and their siblings on node 0, not the plan's very CPUs: the
    # kubelet picks which; what matters is their count, owner and node.
    root = container(tmp_path, GUARANTEED, "1-14,113-126")
    out = verify(root, 0)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(
        "rank 0: CPUs 1-14 and 113-126 of its own on node 0 (QoS Guaranteed)"
    )


def test_verify_names_the_shared_pool_of_a_burstable_pod(tmp_path):
    root = container(tmp_path, BURSTABLE, "0-223")
    out = verify(root, 0)
    assert out.returncode == 1
    assert "Kubernetes' shared pool (QoS Burstable)" in out.stdout
    assert 'cpu: "28"' in out.stdout


def test_verify_names_a_kubelet_without_the_static_policy(tmp_path):
    # Guaranteed, but every CPU: cpuManagerPolicy none gives no CPU its own.
    root = container(tmp_path, GUARANTEED, "0-223")
    out = verify(root, 0)
    assert out.returncode == 1
    assert "cpuManagerPolicy is not static" in out.stdout


def test_verify_names_cpus_on_another_node_than_the_gpu(tmp_path):
    # Rank 4's GPU is on node 1; its CPUs came from node 0 (a DRA GPU, or no
    # Topology Manager).
    root = container(tmp_path, GUARANTEED, "15-28,127-140")
    out = verify(root, 4)
    assert out.returncode == 1
    assert "plan wants them on node 1 (GPU 0000:9a:00.0's)" in out.stdout
    assert "DRA GPU is not aligned" in out.stdout


def test_verify_names_the_wrong_count(tmp_path):
    root = container(tmp_path, GUARANTEED, "1-7,113-119")
    out = verify(root, 0, "--json")
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["launcher"] == "k8s" and data["has"]["qos"] == "Guaranteed"
    (line,) = data["findings"]
    assert 'asks for cpu: "28"' in line


def test_verify_exact_compares_the_very_cpus_even_in_a_pod(tmp_path):
    root = container(tmp_path, GUARANTEED, "1-14,113-126")
    out = verify(root, 0, "--launcher", "exact")
    assert out.returncode == 1 and "plan wants" in out.stdout


def test_check_k8s_rank_takes_the_node_of_the_gpu_the_container_sees():
    host = host_named("dgx-h100")
    k = k8s_plan(host, host.cpus, 8, mode="exclusive")
    node1 = frozenset(range(56, 70)) | frozenset(range(168, 182))
    assert check_k8s_rank(k, 0, node1, "Guaranteed", host, gpu_node=1) == []
    (line,) = check_k8s_rank(k, 0, node1, "Guaranteed", host)
    assert "plan wants them on node 0" in line


def test_verify_nri_agrees_with_a_burstable_pod_in_its_balloon(tmp_path):
    # The balloons policy pins a pod of any QoS class: no Guaranteed needed.
    root = container(tmp_path, BURSTABLE, "1-14,113-126")
    out = verify(root, 0, "--launcher", "nri")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "of its own on node 0 (a balloon): as planned" in out.stdout
    assert verify(root, 0).returncode == 1  # under the kubelet's rules, Burstable is shared


def test_verify_nri_names_the_annotation_of_a_pod_left_in_the_shared_pool(tmp_path):
    root = container(tmp_path, BURSTABLE, "0-110,112-222")
    out = verify(root, 3, "--launcher", "nri", "--json")
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["launcher"] == "nri"
    (line,) = data["findings"]
    assert "the shared pool" in line
    assert "balloon.balloons.resource-policy.nri.io: cpupin-rank-3" in line
