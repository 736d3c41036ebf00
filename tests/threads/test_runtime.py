"""The example runtime as a user runs it: real processes, real pins."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpupin
from cpupin.host.shapes import GpuSpec, HostSpec, build_tree

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = [sys.executable, str(ROOT / "examples" / "runtime.py")]

pytestmark = pytest.mark.skipif(
    cpupin.process_cpus() != {0, 1}, reason="written for a process mask of CPUs 0-1"
)


def proc_threads(pid):
    """{name: mask} of a process's threads, read from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        mask = next(
            line.split(":")[1].strip()
            for line in status.splitlines()
            if line.startswith("Cpus_allowed_list")
        )
        out.setdefault(name, set()).add(mask)
    return out


def run_with_look(args, tmp_path):
    """Run the runtime; while its worker lingers, read the step threads'
    masks from /proc; return (report, masks, stderr)."""
    done = tmp_path / "looked"
    proc = subprocess.Popen(
        [*RUNTIME, *args, "--json", "--linger-file", str(done)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while "worker 0 pid" not in line:
            line = proc.stderr.readline()
            assert line, "the runtime exited before starting its worker"
        pid = int(line.split()[-1])
        wanted = {"worker0-main", "worker0-gpu", "worker0-plan"}
        masks = {}
        for _ in range(6000):  # the worker imports, pins, runs its steps, then lingers
            masks = proc_threads(pid)
            if wanted <= masks.keys() and Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.02)
        masks = proc_threads(pid)
        done.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        done.touch()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out), masks, err


@pytest.mark.parametrize(
    "setting, step_mask, result_mask", [("off", "0-1", "0-1"), ("0", "0", "1")]
)
def test_the_runtime_runs_and_pins_as_the_plan_says(tmp_path, setting, step_mask, result_mask):
    report, masks, _ = run_with_look(["--setting", setting, "--steps", "300"], tmp_path)
    for key in ("steps_per_s", "itl_ms", "threads", "stray"):
        assert key in report
    assert set(report["itl_ms"]) >= {"p50", "p95", "p99"} and report["steps_per_s"] > 0
    for thread in report["threads"]:
        assert {"process", "name", "cpu_ms_per_s", "wait_ms_per_s", "mask"} <= set(thread)
    for name in ("worker0-main", "worker0-gpu", "worker0-plan"):
        assert masks[name] == {step_mask}, masks
    assert report["pinned"] == (setting != "off")
    if setting == "0":
        assert report["workers"] == [{"device": "0", "cpus": [0]}] and report["result_cpu"] == 1
    names = {(t["process"], t["name"]): t["mask_list"] for t in report["threads"]}
    assert names[("api-server", "api-result")] == result_mask
    assert names[("worker0", "worker0-detok")] == "0-1"  # the pool starts on the process mask
    assert report["stray"] == []


def test_auto_on_a_host_without_gpus_pins_nothing_and_says_why():
    out = subprocess.run(
        [*RUNTIME, "--setting", "auto", "--steps", "50", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["pinned"] is False and "no GPU" in report["reason"]
    assert "no GPU" in out.stderr  # the warning


def test_a_cpu_number_that_cannot_be_honoured_fails_at_startup():
    out = subprocess.run(
        [*RUNTIME, "--setting", "0", "--devices", "a,b"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 2
    assert "step_thread_core 0 leaves no allowed CPU for worker 1 in 0-1" in out.stderr


def test_the_runtime_prints_the_plan_of_a_shipped_host():
    out = subprocess.run(
        [*RUNTIME, "--host", "xeon6-b300", "--devices", "0000:fa:00.0", "--setting", "auto"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["workers"] == [[97, 225]]


# --- the lock between copies ---------------------------------------------------------


@pytest.fixture
def one_gpu_tree(tmp_path):
    """This machine's two CPUs with one GPU, so that auto can pin for real."""
    spec = HostSpec("two-cpus-one-gpu", cores_per_node=2, gpus=(GpuSpec("0000:01:00.0", 0),))
    return build_tree(spec, tmp_path / "host")


def copy_args(tree, lock_dir, *extra):
    return [
        *RUNTIME,
        "--root",
        str(tree),
        "--setting",
        "auto",
        "--devices",
        "0000:01:00.0",
        "--lock-dir",
        str(lock_dir),
        "--steps",
        "50",
        "--json",
        *extra,
    ]


def start_holder(tree, lock_dir):
    holder = subprocess.Popen(
        copy_args(tree, lock_dir, "--hold", "300"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = holder.stderr.readline()
    assert line.startswith("runtime: pinned"), line
    return holder


def test_a_second_copy_stands_aside_until_the_first_is_killed(one_gpu_tree, tmp_path):
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    holder = start_holder(one_gpu_tree, lock_dir)
    try:
        second = subprocess.run(
            copy_args(one_gpu_tree, lock_dir),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        report = json.loads(second.stdout)
        assert report["pinned"] is False
        assert re.search(r"another server \(pid \d+\) holds GPU 0000:01:00.0", report["reason"])
        assert str(lock_dir / "cpupin-gpu-0000:01:00.0.lock") in second.stderr  # the warning
        assert {t["mask_list"] for t in report["threads"]} == {"0-1"}  # its workers pin nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    third = subprocess.run(
        copy_args(one_gpu_tree, lock_dir), capture_output=True, text=True, timeout=300, check=True
    )
    report = json.loads(third.stdout)
    assert report["pinned"] is True and report["workers"][0]["cpus"] == [0]
    assert report["result_cpu"] == 1


# --- the host's view: cpupin ps and audit on a running runtime ----------------------


def ps_json(lock_dir, interval):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpupin",
            "ps",
            "--json",
            "--interval",
            interval,
            "--lock-dir",
            str(lock_dir),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_ps_and_audit_see_the_runtimes_pins_from_outside(one_gpu_tree, tmp_path):
    """A server under auto with one worker (this machine's two CPUs fit one
    pinned worker and the result CPU): ps lists the server's record and both
    processes' pins; audit passes --fail-on-narrow on the worker until a
    thread is pinned by hand."""
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    done = tmp_path / "looked"
    proc = subprocess.Popen(
        [*copy_args(one_gpu_tree, lock_dir), "--linger-file", str(done)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cpupin_cmd = [sys.executable, "-m", "cpupin"]
    try:
        line = ""
        while "worker 0 pid" not in line:
            line = proc.stderr.readline()
            assert line, "the runtime exited before starting its worker"
        worker = int(line.split()[-1])
        view = {}
        for _ in range(3000):  # until the worker's three step pins are registered
            view = ps_json(lock_dir, "0.05")
            pins = {p["pid"]: p["pins"] for p in view["processes"] if p["live"]}
            if len(pins.get(worker, [])) == 3 and proc.pid in pins:
                break
            time.sleep(0.05)
        (server,) = view["servers"]
        assert server["live"] and server["pid"] == proc.pid and server["setting"] == "auto"
        assert server["workers"] == [{"device": "0000:01:00.0", "cpus": [0]}]
        assert server["result_cpu"] == 1
        roles = {p["pid"]: sorted(x["role"] for x in p["pins"]) for p in view["processes"]}
        assert roles[worker] == ["step", "step", "step"] and roles[proc.pid] == ["result"]
        worker_view = next(p for p in view["processes"] if p["pid"] == worker)
        assert {t["name"] for t in worker_view["threads"]} == {
            "worker0-main",
            "worker0-gpu",
            "worker0-plan",
        }
        assert all(t["on_its_pin"] and t["cpus"] == [0] for t in worker_view["threads"])
        audit = [*cpupin_cmd, "audit", str(worker), "--fail-on-narrow"]
        passed = subprocess.run(audit, capture_output=True, text=True, check=False)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "3 registered pin(s)" in passed.stdout
        # A thread moved by hand, behind cpupin's back: off its registered pin.
        loose = min(p["tid"] for p in worker_view["pins"])
        os.sched_setaffinity(loose, {1})
        failed = subprocess.run(audit, capture_output=True, text=True, check=False)
        assert failed.returncode == 3 and f"({loose})" in failed.stdout
        assert "1 narrower thread(s) not registered" in failed.stdout
        done.touch()
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    finally:
        done.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The processes are gone: their records went with them; the lock file's
    # record stays, stale, since nobody holds the lock.
    view = ps_json(lock_dir, "0.01")
    assert view["processes"] == []
    assert [s["live"] for s in view["servers"]] == [False]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_runtime_holds_its_locks_while_it_holds(one_gpu_tree, tmp_path):
    """--hold keeps the server, and its claim, after the run: a second
    server on the same GPU stands aside, naming the holder."""
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    proc = subprocess.Popen(
        [*copy_args(one_gpu_tree, lock_dir), "--hold", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if "runtime: holding" in line:
                break
        else:
            raise AssertionError("the runtime never held")
        plan = cpupin.plan_server(
            "auto", ["0000:01:00.0"], root=one_gpu_tree, lock_dir=lock_dir, environ={}
        )
        assert not plan.pinned and f"(pid {proc.pid})" in plan.placement.reason
    finally:
        proc.kill()
        proc.wait()
