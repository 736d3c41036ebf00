"""plan_server and child_env: the startup path of a runtime's API server."""

import json
import logging
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import PlanError, child_env, plan_server, resolve_devices
from cpupin.act.server import parse_visible_devices
from cpupin.host.shapes import HOSTS, build_tree, host_named

GPU7 = "0000:fa:00.0"  # the second GPU of node 3 on xeon6-b300
MASK = set(range(96, 104)) | set(range(224, 232))


@pytest.fixture(scope="module")
def b300_root(tmp_path_factory):
    return build_tree(HOSTS["xeon6-b300"], tmp_path_factory.mktemp("b300"))


def test_off_pins_nothing_and_takes_no_lock(b300_root, tmp_path):
    plan = plan_server("off", [GPU7], root=b300_root, mask=MASK, lock_dir=tmp_path, environ={})
    assert not plan.pinned and plan.claim is None
    assert list(tmp_path.iterdir()) == []
    assert "CPUPIN_STEP_THREAD_CORE" not in plan.child_env({})
    assert not plan.stood_aside


def test_auto_places_claims_and_sizes_the_pools(b300_root, tmp_path):
    plan = plan_server("auto", [GPU7], root=b300_root, mask=MASK, lock_dir=tmp_path, environ={})
    try:
        assert plan.pinned and plan.claim
        assert plan.placement.step_cpus == ((97, 225),) and plan.placement.result_cpu == 102
        assert plan.cpu_plan.pinned == {97, 225, 102}
        assert plan.cpu_plan.pool_size() == 13
        assert "CPUPIN_STEP_THREAD_CORE" not in plan.child_env({})
    finally:
        plan.claim.close()


SECOND_SERVER = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from cpupin import plan_server
p = plan_server("auto", [{gpu!r}], root={root!r}, mask={mask!r}, lock_dir={lock!r}, environ={{}})
print(json.dumps({{"pinned": p.pinned, "reason": p.placement.reason,
                  "child": p.child_env({{}}).get("CPUPIN_STEP_THREAD_CORE")}}))
"""


def second_server(root, lock_dir):
    code = SECOND_SERVER.format(gpu=GPU7, root=str(root), mask=sorted(MASK), lock=str(lock_dir))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout), out.stderr


def test_a_second_server_on_the_gpu_stands_aside_and_its_workers_too(b300_root, tmp_path):
    first = plan_server("auto", [GPU7], root=b300_root, mask=MASK, lock_dir=tmp_path, environ={})
    try:
        result, stderr = second_server(b300_root, tmp_path)
        assert not result["pinned"]
        # The holder's pid comes from its record in the lock file.
        assert f"another server (pid {os.getpid()}) holds GPU {GPU7}" in result["reason"]
        assert str(tmp_path / f"cpupin-gpu-{GPU7}.lock") in result["reason"]
        assert result["child"] == "off"
        assert "cpupin auto" in stderr and GPU7 in stderr  # the warning
    finally:
        first.claim.close()
    result, _ = second_server(b300_root, tmp_path)
    assert result["pinned"] and result["child"] is None


@pytest.mark.parametrize("var", ["GOMP_CPU_AFFINITY", "KMP_AFFINITY"])
def test_openmp_affinity_makes_auto_pin_nothing(b300_root, tmp_path, var, caplog):
    with caplog.at_level(logging.WARNING, logger="cpupin"):
        plan = plan_server(
            "auto", [GPU7], root=b300_root, mask=MASK, lock_dir=tmp_path, environ={var: "0-3"}
        )
    assert not plan.pinned and var in plan.placement.reason and plan.claim is None
    assert var in caplog.text
    assert plan.stood_aside and plan.child_env({})["CPUPIN_STEP_THREAD_CORE"] == "off"
    # The module-level child_env passes the process mask alone, whatever the
    # last plan decided: no hidden state.
    assert "CPUPIN_STEP_THREAD_CORE" not in child_env({})
    assert "CPUPIN_PROCESS_CPUS" in child_env({})


def test_the_setting_comes_from_the_environment_when_none_is_given(b300_root, tmp_path):
    plan = plan_server(
        None,
        ["w0"],
        root=b300_root,
        mask=MASK,
        lock_dir=tmp_path,
        environ={"CPUPIN_STEP_THREAD_CORE": "97"},
    )
    assert plan.placement.step_cpus == ((97, 225),) and plan.claim is None
    with pytest.raises(PlanError, match="step_thread_core 5 is outside the process mask"):
        plan_server(5, ["w0"], root=b300_root, mask=MASK, lock_dir=tmp_path, environ={})


def test_devices_by_index_through_cuda_visible_devices():
    host = host_named("dgx-h100")
    assert resolve_devices([0, "1"], host, {}) == ("0000:18:00.0", "0000:2a:00.0")
    assert resolve_devices([0, 1], host, {"CUDA_VISIBLE_DEVICES": "7,5"}) == (
        "0000:db:00.0",
        "0000:ab:00.0",
    )
    assert resolve_devices(["00000000:9A:00.0"], host, {}) == ("0000:9a:00.0",)


@pytest.mark.parametrize(
    "entries, env, says",
    [
        ([8], {}, r"past the host's 8 NVIDIA GPU\(s\)"),
        ([2], {"CUDA_VISIBLE_DEVICES": "0,1"}, r"makes 2 device\(s\) visible"),
        ([0], {"CUDA_VISIBLE_DEVICES": "-1"}, r"makes 0 device\(s\) visible"),
        ([1], {"CUDA_VISIBLE_DEVICES": "3,9,1"}, r"makes 1 device\(s\) visible"),
        ([0], {"CUDA_VISIBLE_DEVICES": "2,2"}, r"makes 0 device\(s\) visible"),
        (["gpu0"], {}, "neither a PCI address"),
        ([-1], {}, "negative"),
        ([1.5], {}, "1.5"),
    ],
)
def test_devices_that_cannot_be_resolved_name_the_entry(entries, env, says):
    with pytest.raises(PlanError, match=says):
        resolve_devices(entries, host_named("dgx-h100"), env)


def test_a_gpu_uuid_without_pynvml_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(PlanError, match="pynvml"):
        resolve_devices(
            [0],
            host_named("dgx-h100"),
            {"CUDA_VISIBLE_DEVICES": "GPU-8d3f2a10-0000-0000-0000-000000000000"},
        )


# --- cpupin plan ----------------------------------------------------------------


def test_a_bad_setting_from_the_environment_is_named_as_such(b300_root, tmp_path):
    with pytest.raises(PlanError, match=r"CPUPIN_STEP_THREAD_CORE='bogus': "):
        plan_server(
            None,
            ["w0"],
            root=b300_root,
            lock_dir=tmp_path,
            environ={"CPUPIN_STEP_THREAD_CORE": "bogus"},
        )


# --- CUDA device indexes, as CUDA counts them ----------------------------------

_ENTRY = st.one_of(
    st.integers(-3, 12).map(str),
    st.sampled_from(
        ["", " 3", "4 ", "+2", "-0", "1gpu", "0x1", "a", "GPU-ab12", "MIG-9", " GPU-1"]
    ),
    st.text(alphabet="0123456789+- aGPUMI", max_size=6),
)


def _torch_parse(text):
    """torch's own reading of CUDA_VISIBLE_DEVICES (it mirrors the CUDA
    runtime's), the oracle; None where torch itself fails on the text."""
    torch = pytest.importorskip("torch", reason="torch's parser is the oracle")
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = text
    try:
        return torch.cuda._parse_visible_devices()
    except ValueError:
        return None
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


@settings(max_examples=300)
@given(st.lists(_ENTRY, min_size=1, max_size=6).map(",".join))
def test_cuda_visible_devices_is_read_as_torch_reads_it(text):
    expected = _torch_parse(text)
    if expected is None:
        return  # torch raises on a bare sign; cpupin reads it as no number
    assert parse_visible_devices(text) == expected


@given(st.text(max_size=200))
def test_cuda_visible_devices_never_raises_and_gives_devices_once(text):
    got = parse_visible_devices(text)
    assert len(got) == len(set(got))
    assert all(n >= 0 for n in got if isinstance(n, int))


def test_an_integrated_gpu_is_not_a_cuda_device(tmp_path):
    """A workstation's Intel GPU at 00:02.0 sorts before every NVIDIA GPU in
    PCI order: CUDA device 4 of a DGX H100 with one is still the fifth
    NVIDIA GPU, on node 1."""
    import dataclasses

    from cpupin.host.shapes import HOSTS, build_tree
    from cpupin.host.topology import read_host
    from cpupin.plan.binding import gpu_node

    spec = HOSTS["dgx-h100"]
    igpu = dataclasses.replace(spec.gpus[0], address="0000:00:02.0", vendor=0x8086)
    root = build_tree(dataclasses.replace(spec, gpus=(igpu, *spec.gpus)), tmp_path / "t")
    host = read_host(str(root))
    assert len(host.gpus) == 9 and host.gpus[0].vendor == "intel"
    (address,) = resolve_devices([4], host, {})
    assert address == "0000:9a:00.0" and gpu_node(host, address)[0] == 1
    assert resolve_devices([0], host, {"CUDA_VISIBLE_DEVICES": "4"}) == (address,)


def test_rocm_counts_amds_gpus_through_hip_visible_devices():
    host = host_named("amd-8gpu")
    amd = [g.address for g in host.gpus if g.vendor == "amd"]
    assert len(amd) == 8
    assert resolve_devices([0], host, {"HIP_VISIBLE_DEVICES": "3"}) == (amd[3],)
    # HIP honours CUDA_VISIBLE_DEVICES too, where HIP_VISIBLE_DEVICES is unset.
    assert resolve_devices([1], host, {"CUDA_VISIBLE_DEVICES": "5,6"}) == (amd[6],)
