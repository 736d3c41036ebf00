"""plan_server and child_env: the startup path of a runtime's API server."""

import json
import logging
import os
import subprocess
import sys

import pytest

from cpupin import PlanError, child_env, plan_server, resolve_devices
from cpupin.hosts import HOSTS, build_tree, host_named

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
        ([8], {}, r"past the host's 8 GPU\(s\)"),
        ([2], {"CUDA_VISIBLE_DEVICES": "0,1"}, "lists 2"),
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
