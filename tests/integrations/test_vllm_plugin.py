"""The vLLM plugin's decisions, pure (roles, modes, OpenMP CPU lists, which
threads move, the cap under a quota), and what it leaves in the registry
(roles, notes, step figures, the server that prunes) read back through the
reader, ``cpupin ps`` and Prometheus. The real server is
tests/integrations/test_vllm_server.py."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin import _native
from cpupin.host.shapes import host_named
from cpupin.integrations.vllm import wiring as vllm_plugin
from cpupin.integrations.vllm.decisions import (
    ENV_MODE,
    MODES,
    ROLES,
    cap_lists,
    mode_from_env,
    omp_cpus,
    role_of,
    threads_to_move,
)
from cpupin.measure.stepclock import BUCKETS_S
from cpupin.pools.limits import ENV_POOL_VARS
from cpupin.registry import servers
from cpupin.registry import writer as registry
from cpupin.registry.prune import prune_members
from cpupin.registry.reader import read_registry
from tests.support.helpers import run
from tests.support.specs import spec_host
from tests.support.strategies import host_specs, masks

# --- roles --------------------------------------------------------------------

API = "vllm.entrypoints.openai.api_server"
#: The command line, run as a user runs it.
CPUPIN = [sys.executable, "-m", "cpupin"]


@pytest.mark.parametrize(
    "title, mp_name, main, argv, role",
    [
        # what vLLM 0.32 sets, seen in a real server (tests/integrations/test_vllm_server.py)
        ("/venv/bin/python", "MainProcess", API, ["x"], "vllm-api-server"),
        ("/venv/bin/vllm", "MainProcess", "", ["/venv/bin/vllm", "serve", "m"], "vllm-api-server"),
        ("VLLM::APIServer_1", "ApiServer_1", "", [], "vllm-api-server"),
        ("VLLM::EngineCore", "EngineCore", "", [], "vllm-engine-core"),
        ("python", "EngineCore_DP1", "", [], "vllm-engine-core"),
        ("MYPREFIX::EngineCore_DP0", "x", "", [], "vllm-engine-core"),
        # the worker loads plugins before its title is set: its process name says
        ("/venv/bin/python", "VllmWorker-0", "", [], "vllm-worker"),
        ("VLLM::Worker_TP1_EP1", "VllmWorker-1", "", [], "vllm-worker"),
        # helpers: a model inspected in a subprocess, a resource tracker, a script
        ("/venv/bin/python", "MainProcess", "vllm.model_executor.models.registry", [], None),
        ("/venv/bin/python", "MainProcess", "", ["-c"], None),
        ("/venv/bin/python", "SpawnProcess-3", API, [], None),
        ("/venv/bin/vllm", "MainProcess", "", ["/venv/bin/vllm", "bench"], None),
    ],
)
def test_role_of_reads_what_vllm_sets(title, mp_name, main, argv, role):
    assert role_of(title, mp_name, main, argv) == role


@given(st.text(max_size=40), st.text(max_size=20), st.text(max_size=40), st.lists(st.text()))
def test_role_of_never_raises_and_names_a_role_or_none(title, mp_name, main, argv):
    assert role_of(title, mp_name, main, argv) in (*ROLES, None)


@pytest.mark.parametrize(
    "value, mode",
    [
        (None, "observe"),
        ("", "observe"),
        ("auto", "auto"),
        (" OFF ", "off"),
        ("Observe", "observe"),
    ],
)
def test_mode_from_env_takes_the_three_words(value, mode):
    env = {} if value is None else {ENV_MODE: value}
    assert mode_from_env(env) == (mode, None)


@given(st.text(max_size=60))
def test_a_bad_mode_observes_and_says_what_to_set(value):
    mode, warning = mode_from_env({ENV_MODE: value})
    if value.strip().lower() in MODES or not value.strip():
        assert warning is None
    else:
        assert mode == "observe" and warning is not None
        assert "choose observe, auto, off" in warning and ENV_MODE in warning
        assert "\n" not in warning and len(warning) < 300


# --- OpenMP's CPUs --------------------------------------------------------------


@pytest.mark.parametrize(
    "env, cpus, source",
    [
        ({"GOMP_CPU_AFFINITY": "0"}, {0}, "GOMP_CPU_AFFINITY"),
        ({"GOMP_CPU_AFFINITY": "0 1 2 3"}, {0, 1, 2, 3}, "GOMP_CPU_AFFINITY"),
        ({"GOMP_CPU_AFFINITY": "0-7:2"}, {0, 2, 4, 6}, "GOMP_CPU_AFFINITY"),
        ({"GOMP_CPU_AFFINITY": "4-5,8"}, {4, 5, 8}, "GOMP_CPU_AFFINITY"),
        (
            {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,1,2]"},
            {1, 2, 3},
            "KMP_AFFINITY",
        ),
        ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}, "OMP_PLACES"),
        ({"OMP_PLACES": "{0:4}"}, {0, 1, 2, 3}, "OMP_PLACES"),
        ({"OMP_PLACES": "{0},{5}"}, {0, 5}, "OMP_PLACES"),
    ],
)
def test_omp_cpus_reads_each_runtimes_binding(env, cpus, source):
    assert omp_cpus(env, range(16)) == (frozenset(cpus), source)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OMP_PLACES": "cores", "OMP_PROC_BIND": "false"},
        {"GOMP_CPU_AFFINITY": "x"},
        {"KMP_AFFINITY": "compact"},
        {"GOMP_CPU_AFFINITY": "5-3"},
        {"GOMP_CPU_AFFINITY": "99999999"},
    ],
)
def test_omp_cpus_is_none_where_nothing_binds_to_cpus(env):
    assert omp_cpus(env, range(16)) is None


@given(
    st.dictionaries(
        st.sampled_from(["GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES"]), st.text(max_size=40)
    )
)
def test_omp_cpus_never_raises_on_any_text(env):
    found = omp_cpus(env, range(16))
    assert found is None or all(0 <= c < 65536 for c in found[0])


OMP_TEAM = """
import json, os, sys, threading
import torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
torch.ones(256, 256) @ torch.ones(256, 256)
masks = {}
for tid in os.listdir("/proc/self/task"):
    masks[tid] = sorted(os.sched_getaffinity(int(tid)))
print(json.dumps(sorted({c for m in masks.values() for c in m})))
"""


@pytest.mark.parametrize("value", ["1", "0", "0 1", "1 0", "0-1", "0,1"])
def test_omp_cpus_agrees_with_libgomp_binding_a_real_team(two_cpus, value):
    """libgomp (torch's OpenMP) binds its team to what GOMP_CPU_AFFINITY lists:
    the CPUs its threads end on are the ones omp_cpus reads."""
    pytest.importorskip("torch", reason="needs torch's libgomp (pip install torch==2.13.0)")
    cpus, _ = omp_cpus({"GOMP_CPU_AFFINITY": value}, os.sched_getaffinity(0))
    env = {**os.environ, "GOMP_CPU_AFFINITY": value, "OMP_NUM_THREADS": str(len(cpus))}
    env.pop("OMP_PLACES", None)
    env.pop("OMP_PROC_BIND", None)
    out = run([sys.executable, "-c", OMP_TEAM], env=env)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) == cpus


# --- which threads move -----------------------------------------------------------

threads = st.lists(
    st.tuples(
        st.integers(1, 50),
        st.sampled_from(["VLLM::Worker", "gloo_tcp_loop", "pt_gloo_runloop", "ZMQbg/IO/0", "x"]),
        st.frozensets(st.integers(0, 7), min_size=1),
    ),
    max_size=30,
    unique_by=lambda t: t[0],
)


@given(threads, st.integers(1, 50), st.frozensets(st.integers(0, 7)), st.booleans())
def test_threads_to_move_moves_only_what_touches_openmp_and_spares_the_team(
    listed, main, omp, keep_team
):
    reserved = frozenset(range(8)) - omp
    moved = dict(
        threads_to_move(listed, main_tid=main, omp=omp, reserved=reserved, keep_team=keep_team)
    )
    by_tid = {t: (n, m) for t, n, m in listed}
    main_name = by_tid.get(main, (None,))[0]
    for tid, (name, mask) in by_tid.items():
        if tid in moved:
            assert mask & omp and not mask <= reserved
            if keep_team:
                assert tid != main and name != main_name
        elif omp and reserved and mask & omp and not mask <= reserved:
            # kept only as the main thread or a possible team member
            assert keep_team and (tid == main or name == main_name)
    if not reserved or not omp:
        assert not moved


@given(
    st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=32, unique=True), max_size=4),
    st.integers(0, 8),
    st.integers(1, 64),
)
def test_cap_lists_fits_the_usable_cpus_and_keeps_vllms_order(lists, reserved, usable):
    capped = cap_lists(lists, reserved, usable)
    assert len(capped) == len(lists)
    for before, after in zip(lists, capped):
        assert after == before[: len(after)] and after
    room = max(len(lists), usable - reserved)
    if sum(map(len, lists)) <= room:
        assert capped == lists
    else:
        assert sum(map(len, capped)) <= max(room, len(lists))


def test_cap_lists_under_a_one_cpu_quota_on_two_cpus_keeps_vllms_single_cpu():
    assert cap_lists([[0]], 1, 1) == [[0]]
    assert cap_lists([[0, 1, 2, 3, 4, 5, 6]], 1, 4) == [[0, 1, 2]]


# --- the record: role, notes, steps, server ------------------------------------

WRITE = """
import json, os, sys
import cpupin
from cpupin.registry import writer as registry
clock = cpupin.StepClock("execute_model")
for _ in range(5):
    with clock.step():
        sum(range(1000))
try:
    import setproctitle
    setproctitle.setproctitle("VLLM::Worker_DP1_TP1")  # what vLLM 0.32 calls a worker
except ImportError:
    pass
registry.describe_process(role="vllm-worker", notes=["moved 3 thread(s)"],
                          steps=[registry.step_figures(clock)],
                          server=tuple(int(x) for x in sys.argv[1].split("-")),
                          auto={"moved": 3, "confined": {1}, "widened": False})
print(clock.steps, os.getpid(), flush=True)
if sys.argv[2] == "killed":
    os._exit(0)          # as SIGKILL: no atexit, the record stays
sys.stdin.read()         # alive until the test closes stdin
"""


def _ready(child):
    """The pid of the process that wrote its record, once it has."""
    steps, pid = child.stdout.readline().split()
    assert steps == "5"
    return int(pid)


def _child(lock_dir, server, how):
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(lock_dir)}
    return subprocess.Popen(
        [sys.executable, "-c", WRITE, server, how],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_role_record_reads_back_with_its_notes_steps_and_server(tmp_path):
    child = _child(tmp_path, "4242-77", "alive")
    try:
        _ready(child)
        found = read_registry(tmp_path)
        (record,) = [r for r in found.records if r.pid == child.pid]
        assert record.live and record.role == "vllm-worker" and not record.pins
        assert record.notes == ("moved 3 thread(s)",) and record.server == (4242, 77)
        (fig,) = record.steps
        assert fig["clock"] == "execute_model" and fig["steps"] == 5
        assert sum(fig["counts"]) == 5 and len(fig["counts"]) == len(BUCKETS_S) + 1
        as_json = record.as_dict()
        assert as_json["role"] == "vllm-worker" and as_json["server_pid"] == 4242
        out = run(
            [
                *CPUPIN,
                "ps",
                "--interval",
                "0.05",
                "--lock-dir",
                str(tmp_path),
            ]
        )
        assert out.returncode == 0, out.stderr
        assert "1 with a role" in out.stdout and "vllm-worker" in out.stdout
        assert "steps execute_model: 5 on tid" in out.stdout and "moved 3 thread(s)" in out.stdout
        listed = json.loads(
            run(
                [
                    *CPUPIN,
                    "ps",
                    "--json",
                    "--interval",
                    "0.05",
                    "--lock-dir",
                    str(tmp_path),
                ]
            ).stdout
        )
        (proc,) = [p for p in listed["processes"] if p["pid"] == child.pid]
        assert proc["role"] == "vllm-worker" and proc["steps"][0]["steps"] == 5
    finally:
        child.communicate("")


def test_prune_members_removes_only_its_killed_members(tmp_path):
    me = f"{os.getpid()}-{registry.start_time(os.getpid())}"
    killed = _child(tmp_path, me, "killed")
    other = _child(tmp_path, "4242-77", "killed")
    alive = _child(tmp_path, me, "alive")
    try:
        for child in (killed, other, alive):
            _ready(child)
        killed.wait(30)
        other.wait(30)
        before = sorted(os.listdir(tmp_path))
        assert len(before) == 3
        server = (os.getpid(), registry.start_time(os.getpid()))
        removed = prune_members(server, str(tmp_path))
        assert [os.path.basename(p) for p in removed] == [
            n for n in before if n.startswith(f"cpupin-proc-{killed.pid}-")
        ]
        assert len(os.listdir(tmp_path)) == 2  # another server's, and a live one
    finally:
        alive.communicate("")
    assert len(os.listdir(tmp_path)) == 1  # the live one removed its own at exit


def test_prune_members_waits_for_a_member_a_group_signal_ends_a_moment_later(tmp_path):
    """One SIGTERM to the whole group: the API server exits while a worker
    is still ending, and a worker a signal kills removes nothing itself."""
    me = f"{os.getpid()}-{registry.start_time(os.getpid())}"
    member = _child(tmp_path, me, "alive")
    _ready(member)
    server = (os.getpid(), registry.start_time(os.getpid()))
    assert prune_members(server, str(tmp_path)) == []  # alive: not its to remove
    killer = threading.Timer(0.3, member.kill)  # SIGKILL: no atexit, the record stays
    killer.start()
    try:
        removed = prune_members(server, str(tmp_path), wait_s=30)
    finally:
        killer.join()
        member.communicate()
    assert [os.path.basename(p) for p in removed] == [
        f"cpupin-proc-{member.pid}-" + p.split("-")[-1] for p in removed
    ]
    assert os.listdir(tmp_path) == []


BAD_FIELDS = st.sampled_from(["role", "notes", "steps", "server", "auto"])
BAD_VALUES = st.one_of(
    st.integers(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.lists(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), max_size=2),
    st.just([1, -1]),
    st.just([{"clock": "x"}]),
    st.just(["x"] * 17),
    st.fixed_dictionaries(
        {
            "moved": st.one_of(st.integers(), st.text(max_size=3), st.none()),
            "confined": st.one_of(st.text(max_size=6), st.lists(st.integers(), max_size=3)),
            "widened": st.one_of(st.booleans(), st.integers(0, 1), st.none()),
        }
    ),
)


@given(BAD_FIELDS, BAD_VALUES)
def test_a_record_with_a_bad_field_is_refused_with_a_reason_never_raises(field, value):
    from cpupin.registry.reader import _process

    pid = os.getpid()
    started = registry.start_time(pid)
    record = {
        "pid": pid,
        "start_time": started,
        "uid": os.geteuid(),
        "time": 1.0,
        "version": 1,
        "pins": [],
        field: value,
    }
    info = os.stat("/proc/self")
    try:
        got = _process("x", record, info, (pid, started), _native.online_cpus())
    except ValueError as exc:
        assert str(exc)
        return
    # accepted: then every field is what a record may hold
    assert isinstance(got.role, str) and len(got.notes) <= 16 and len(got.steps) <= 8
    assert 0 <= got.auto.moved <= 1 << 20 and isinstance(got.auto.widened, bool)
    assert got.auto.confined <= _native.online_cpus()


def test_our_pool_variables_are_dropped_where_vllm_sizes_the_pools(monkeypatch):
    from cpupin.integrations.vllm import wiring as vllm_plugin

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    monkeypatch.setenv(ENV_POOL_VARS, "MKL_NUM_THREADS,OMP_NUM_THREADS,RAYON_NUM_THREADS")
    monkeypatch.setattr(vllm_plugin, "_notes", [])
    vllm_plugin._drop_our_pool_vars()
    assert "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ
    assert os.environ["RAYON_NUM_THREADS"] == "1"  # the tokenizers' pool: not vLLM's to size
    assert os.environ[ENV_POOL_VARS] == "RAYON_NUM_THREADS=1"
    assert any("OMP_NUM_THREADS=2 (set by cpupin) removed" in n for n in vllm_plugin._notes)


def test_the_users_pool_variables_are_never_dropped(monkeypatch):
    from cpupin.integrations.vllm import wiring as vllm_plugin

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv(ENV_POOL_VARS, raising=False)
    monkeypatch.setattr(vllm_plugin, "_notes", [])
    vllm_plugin._drop_our_pool_vars()
    assert os.environ["OMP_NUM_THREADS"] == "3" and not vllm_plugin._notes
    # A value the user put in place of cpupin's, under a name handed down.
    monkeypatch.setenv(ENV_POOL_VARS, "OMP_NUM_THREADS=2")
    vllm_plugin._drop_our_pool_vars()
    assert os.environ["OMP_NUM_THREADS"] == "3" and not vllm_plugin._notes


# --- Prometheus: a server's processes through its own /metrics ------------------


def test_server_steps_collector_exports_its_descendants_records(tmp_path):
    pytest.importorskip("prometheus_client", reason="pip install prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from cpupin.measure.metrics import ServerStepsCollector

    # another server's process: started through a shell that exits, so that
    # it is no descendant of this one
    stranger = subprocess.Popen(
        ["/bin/sh", "-c", '"$1" -c "$0" 4242-77 alive <&0 &', WRITE, sys.executable],
        env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    # a grandchild, as a vLLM worker is the API server's
    shell = subprocess.Popen(
        ["/bin/sh", "-c", '"$1" -c "$0" 1-1 alive; true', WRITE, sys.executable],
        env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = _ready(shell)
        assert grandchild != shell.pid
        orphan = _ready(stranger)
        collectors = CollectorRegistry(auto_describe=False)
        collectors.register(ServerStepsCollector(os.getpid(), str(tmp_path), "tiny"))
        text = generate_latest(collectors).decode()
        # vLLM's own labels, and the place in the server the title gives
        # (where setproctitle, which vLLM brings, is here to set one)
        try:
            import setproctitle  # noqa: F401

            engine, rank = "1", "TP1"
        except ImportError:
            engine, rank = "0", "0"
        labels = f'engine="{engine}",model_name="tiny",rank="{rank}",role="worker"'
        assert f'cpupin_step_wait_seconds_count{{clock="execute_model",{labels}}} 5.0' in text
        assert f"cpupin_vllm_moved_threads{{{labels}}} 3.0" in text
        assert f"cpupin_vllm_confined_cpus{{{labels}}} 1.0" in text
        assert f"cpupin_vllm_confinement_widened{{{labels}}} 0.0" in text
        assert f"cpupin_wake_latency_holds{{{labels}}} 0.0" in text
        # no series per pid or thread
        assert "pid=" not in text and "tid=" not in text, text
        # the same record's figures through cpupin ps --prometheus
        out = run([*CPUPIN, "ps", "--prometheus", "--lock-dir", str(tmp_path)])
        assert (
            f'cpupin_step_seconds_total{{clock="execute_model",pid="{grandchild}"}}' in out.stdout
        )
        # a process that is not the server's is not in the server's /metrics:
        # the only worker there is the grandchild (its moved threads once)
        assert text.count("cpupin_vllm_moved_threads{") == 1, text
        assert orphan != grandchild
    finally:
        shell.communicate("")
        stranger.communicate("")


def test_the_plugin_never_raises_into_vllm(monkeypatch):
    """A failure inside the plugin (here: no vLLM to patch) is logged, and
    register() returns."""
    code = textwrap.dedent(
        """
        import multiprocessing, sys
        multiprocessing.current_process().name = "VllmWorker-0"
        sys.modules["vllm"] = None   # importing vllm fails
        from cpupin.integrations import vllm as vllm_plugin
        vllm_plugin.register()
        vllm_plugin.register()       # loaded twice: once is done
        print("ran")
        """
    )
    out = run([sys.executable, "-c", code], env={**os.environ, "CPUPIN_REGISTRY": "0"})
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr
    assert "the vLLM plugin stands aside" in out.stderr


# --- cpupin exec never slows an engine that binds its own team ---------------

TEAM = "import torch; print(torch.get_num_threads())"


def test_exec_leaves_an_engine_bound_openmp_team_as_the_engine_sized_it():
    """vLLM-CPU binds its worker's team with GOMP_CPU_AFFINITY and sets
    OMP_NUM_THREADS to its CPU count; torch sizes the team from
    MKL_NUM_THREADS when that is set. cpupin exec once passed
    MKL_NUM_THREADS=<usable CPUs> where nothing narrowed them: a team of two
    on one bound CPU, and the server ran at 0.12x (bench/RESULTS.md). Where
    nothing narrows, exec must leave the team as the engine sized it."""
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import cpupin
    from cpupin.pools.limits import POOL_VARS

    cpu = str(min(cpupin.process_cpus()))
    engine = ["env", f"GOMP_CPU_AFFINITY={cpu}", "OMP_NUM_THREADS=1", sys.executable, "-c", TEAM]
    clean = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    clean.pop(ENV_POOL_VARS, None)
    alone = run(engine, env=clean)
    through = run([*CPUPIN, "exec", "--node", "0", "--", *engine], env=clean)
    assert alone.returncode == 0 and through.returncode == 0, alone.stderr + through.stderr
    assert alone.stdout.strip() == "1"
    if cpupin.usable_cpus() == len(cpupin.process_cpus()):
        assert through.stdout.strip() == "1"  # was 2 with MKL_NUM_THREADS=2
    else:  # a quota narrows this machine: the team follows the usable CPUs
        assert int(through.stdout) <= cpupin.usable_cpus()


# --- the outside view of a process an OpenMP binding narrowed -----------------


@pytest.mark.parametrize(
    "raw, env, note",
    [
        (b"A=1\0B=x=y\0", {"A": "1", "B": "x=y"}, ""),
        (b"", None, ""),
        (b"\0" * 300, None, "overwritten by its process title"),
        (b" " * 120 + b"\0" * 80, None, "overwritten by its process title"),
        (b"VLLM::Worker\0\0\0", None, "overwritten by its process title"),
        (b"ker\0PATH=/bin\0", {"PATH": "/bin"}, "part of its environment"),
    ],
)
def test_an_environment_a_title_overwrote_is_never_read_as_no_variables(raw, env, note):
    from cpupin.process.outside import parse_environ

    got, why = parse_environ(raw)
    if raw == b"":
        assert got == {} and why == ""
        return
    assert got == env and note in why


@given(st.binary(max_size=400))
def test_parse_environ_never_raises(raw):
    from cpupin.process.outside import parse_environ

    env, why = parse_environ(raw)
    assert env is None or all("=" not in k for k in env)


BOUND = """
import ctypes, os, sys, threading
import torch                      # libgomp binds this thread now, as in vLLM's worker
torch.ones(64, 64) @ torch.ones(64, 64)
libc = ctypes.CDLL(None)
def named(name, ready):
    libc.prctl(15, name.encode(), 0, 0, 0)   # PR_SET_NAME, as gloo names its loops
    ready.set()
    threading.Event().wait()
events = []
for i in range(3):
    ready = threading.Event()
    threading.Thread(target=named, args=(f"gloo_tcp_loop", ready), daemon=True).start()
    events.append(ready)
for e in events:
    e.wait()
print("ready", flush=True)
sys.stdin.read()
"""


def _bound_child(cpu, omp_threads):
    """A running process of :data:`BOUND`, libgomp bound to ``cpu``."""
    pytest.importorskip("torch", reason="needs torch's libgomp (pip install torch==2.13.0)")
    env = {**os.environ, "GOMP_CPU_AFFINITY": str(cpu), "OMP_NUM_THREADS": str(omp_threads)}
    child = subprocess.Popen(
        [sys.executable, "-c", BOUND],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    return child


def test_threads_sees_a_process_every_thread_of_which_inherited_an_openmp_binding(two_cpus):
    """A process whose threads all inherit libgomp's binding of its first
    thread (vLLM-CPU's worker): its mask is the launcher's, not the widest
    thread's, and ``threads`` says which threads crowd the bound CPU."""
    child = _bound_child(two_cpus[0], 1)
    try:
        assert os.sched_getaffinity(child.pid) == {two_cpus[0]}
        out = run([*CPUPIN, "threads", str(child.pid), "--json"])
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["process_mask"] == sorted(os.sched_getaffinity(0))
        assert got["process_mask_from"].startswith("the launcher's view")
        assert f"GOMP_CPU_AFFINITY='{two_cpus[0]}'" in got["process_mask_from"]
        shared = got["shared_narrow"]
        assert shared["cpus"] == [two_cpus[0]] and shared["threads"] == len(got["threads"])
        assert shared["not_openmp"] == {"gloo_tcp_loop": 3}
        assert "OMP_PLACES" in shared["advice"]
        text = run([*CPUPIN, "threads", str(child.pid)]).stdout
        assert f"share CPU {two_cpus[0]}, 3 of them not OpenMP's: gloo_tcp_loop (3)" in text
        # audit counts them as the strays they are
        audit = run([*CPUPIN, "audit", str(child.pid), "--fail-on-narrow"])
        assert audit.returncode == 3, audit.stdout + audit.stderr
    finally:
        child.communicate("")


def test_a_process_taskset_narrowed_keeps_its_own_mask(two_cpus):
    """No binding variable and a readable environment: a narrow process is
    narrow on purpose (taskset), and its threads are not strays."""
    child = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(two_cpus[0]),
            sys.executable,
            "-c",
            "import sys; print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("GOMP", "KMP", "OMP_P"))},
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        got = json.loads(run([*CPUPIN, "threads", str(child.pid), "--json"]).stdout)
        assert got["process_mask"] == [two_cpus[0]] and got["shared_narrow"] is None
        assert got["process_mask_from"] == "the widest mask among its threads"
    finally:
        child.communicate("")


def test_threads_tree_lists_a_process_and_its_descendants_with_their_parents():
    shell = subprocess.Popen(
        [
            "/bin/sh",
            "-c",
            f'"{sys.executable}" -c "import sys; print(1, flush=True); sys.stdin.read()"; true',
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert shell.stdout.readline().strip() == "1"
        got = json.loads(run([*CPUPIN, "threads", str(shell.pid), "--tree", "--json"]).stdout)
        rows = got["tree"]
        assert rows[0]["pid"] == shell.pid and rows[0]["parent"] is None
        (child,) = rows[1:]
        assert child["parent"] == shell.pid and child["command"].startswith(sys.executable)
        assert child["threads"] == 1 and child["process_mask_list"]
        text = run([*CPUPIN, "threads", str(shell.pid), "--tree"]).stdout
        assert text.splitlines()[1].startswith(f"  {child['pid']} ")
    finally:
        shell.communicate("")


def test_doctor_judges_another_process_and_says_what_crowds_its_bound_cpu(two_cpus):
    child = _bound_child(two_cpus[0], 4)
    try:
        doctor = [*CPUPIN, "doctor", "--pid", str(child.pid)]
        out = run([*doctor, "--irq-interval", "0", "--json"])
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["host"] == f"pid {child.pid} on this machine"
        process = got["process"]
        assert process["mask_from"].startswith("the launcher's view")
        assert process["shared_narrow"]["not_openmp"] == {"gloo_tcp_loop": 3}
        # its OMP_NUM_THREADS=4, read from its environment, not this command's
        assert any(p.startswith("OMP_NUM_THREADS=4") for p in got["pools"]["problems"])
        text = run([*doctor, "--irq-interval", "0"]).stdout
        assert "process  " in text and "advice   " in text
    finally:
        child.communicate("")
    gone = run([*CPUPIN, "doctor", "--pid", str(child.pid)])
    assert gone.returncode == 2 and "no such process" in gone.stderr
    both = run([*CPUPIN, "doctor", "--pid", "1", "--host", "dgx-h100"])
    assert both.returncode == 2 and "leave out --host" in both.stderr


@given(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300), st.integers(0, 300))
def test_a_verdict_counts_the_threads_that_run(threads, usable, host, idle):
    from cpupin.pools.census import FITS, FROM_HOST, verdict

    idle = min(idle, threads)
    got = verdict(threads, usable, {host}, idle)
    if threads <= usable:
        assert got == FITS
    elif threads == host:
        assert got == FROM_HOST  # a size from the host is a fault even asleep
    else:
        assert (got == FITS) == (threads - idle <= usable)


IDLE_POOL = """
import sys, threading, time
stop = threading.Event()
for i in range(5):
    threading.Thread(target=stop.wait, name=f"reaper-{i}", daemon=True).start()
import cpupin
cpupin.registry.writer.describe_process(role="test")
print("ready", flush=True)
sys.stdin.read()
"""


def test_ps_counts_a_sleeping_pool_as_idle_not_oversubscribed(tmp_path):
    """vLLM's engine core has a ZMQ reaper a context, asleep: more threads
    than usable CPUs, none of them running."""
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    child = subprocess.Popen(
        [sys.executable, "-c", IDLE_POOL],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        out = run(
            [
                *CPUPIN,
                "ps",
                "--json",
                "--interval",
                "0.2",
                "--lock-dir",
                str(tmp_path),
            ]
        )
        (proc,) = [p for p in json.loads(out.stdout)["processes"] if p["pid"] == child.pid]
        pools = {p["name"]: p for p in proc["pools"]}
        reaper = pools["reaper"]  # named by its record, as the process names it
        assert reaper["threads"] == 5 and reaper["idle"] == 5 and not reaper["guess"]
        if reaper["threads"] not in cpupin_host_sizes():
            # idle, not oversubscribed: none of its threads wanted a CPU
            assert reaper["verdict"] == "idle" and reaper["remedy"] is None, reaper
            assert reaper["runnable_cpus"] == 0
    finally:
        child.communicate("")


def cpupin_host_sizes():
    from cpupin.pools.census import _host_shape, host_sizes

    return host_sizes(*_host_shape("/"))


# --- the plugin's wiring, against a stand-in for vLLM ------------------------

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/platforms.py": """
class _Platform:
    def is_cuda(self):
        return True
    def is_cpu(self):
        return False
current_platform = _Platform()
""",
    "vllm/plugins/__init__.py": """
plugins_loaded = False
def load_general_plugins():  # vLLM's guard: once a process, as the flag says
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    from cpupin.integrations import vllm as plugin
    plugin.register()
""",
    "vllm/v1/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/worker_base.py": """
calls = []
class WorkerWrapperBase:
    def init_device(self):
        calls.append("init_device")
    def execute_model(self, scheduler_output):
        calls.append("execute_model")
        return scheduler_output
""",
}

FAKE_WORKER = """
import json, multiprocessing, sys, time, types
multiprocessing.current_process().name = "VllmWorker-0"
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
from vllm.v1.worker import worker_base
vllm_plugin.register()
wrapper = worker_base.WorkerWrapperBase()
wrapper.worker = types.SimpleNamespace(local_rank=0)
wrapper.init_device()
for i in range(5):
    assert wrapper.execute_model(i) == i
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    found = [r for r in read_registry().records if r.pid == registry.os.getpid()]
    if found and found[0].steps:
        break
    time.sleep(0.1)
print(json.dumps({"calls": worker_base.calls, "role": found[0].role,
                  "notes": found[0].notes, "steps": found[0].steps[0]["steps"]}))
"""


def test_the_plugin_in_a_gpu_worker_binds_before_init_device_and_times_each_step(tmp_path):
    """The wiring, with a stand-in for vLLM whose platform is CUDA: in auto
    the worker is bound (here, on a host without GPUs, it says why not)
    before vLLM's own init_device runs, and every execute_model is a step
    of the clock, published in the record."""
    for rel, text in FAKE_VLLM.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "CPUPIN_VLLM": "auto",
        "CPUPIN_LOCK_DIR": str(tmp_path),
    }
    out = run([sys.executable, "-c", FAKE_WORKER], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["calls"] == ["init_device"] + ["execute_model"] * 5
    assert got["role"] == "vllm-worker" and got["steps"] == 5
    notes = " | ".join(got["notes"])
    host = cpupin_read_host()
    if not host.gpus:
        assert "worker not bound to CUDA device 0's node" in notes and "name the node" in notes
    else:
        assert "worker bound to CUDA device 0" in notes or "worker not moved" in notes
    assert "times execute_model on tid" in notes


def cpupin_read_host():
    from cpupin.host.topology import read_host

    return read_host("/")


BIND_ON_TREE = """
import json, sys
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
vllm_plugin._state["role"] = "vllm-worker"
vllm_plugin._bind_to_gpu(int(sys.argv[2]), "worker", root=sys.argv[1])
print(json.dumps(vllm_plugin._notes))
"""


@pytest.mark.parametrize("device", [0, 4])
def test_a_gpu_worker_is_bound_to_its_gpus_node_within_the_launchers_mask(device, tmp_path):
    """On a DGX H100's tree: device 0 is on node 0, whose CPUs (0-55,
    112-167) hold this machine's; device 4 is on node 1, which holds none of
    them: the mask is kept, with what to ask the launcher for."""
    from cpupin.host.shapes import HOSTS, build_tree

    root = build_tree(HOSTS["dgx-h100"], tmp_path / "dgx")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "CPUPIN_REGISTRY": "0"}
    out = run([sys.executable, "-c", BIND_ON_TREE, str(root), str(device)], env=env)
    assert out.returncode == 0, out.stderr
    (note,) = json.loads(out.stdout)
    mask = sorted(os.sched_getaffinity(0))
    if device == 0 and max(mask) < 56:
        assert note.startswith("worker bound to CUDA device 0 (0000:") and ", node 0: CPUs" in note
        assert "memory preferred" in note
    elif device == 4 and max(mask) < 56:
        assert note.startswith("worker not moved: ") and "node 1" in note, note


WIDEN_AND_BIND = """
import json, os, sys
from cpupin.act import binding
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
from cpupin.process.mask import set_process_cpus
vllm_plugin._state["role"] = "vllm-worker"
a = int(sys.argv[2])
os.sched_setaffinity(0, {a})  # what the engine core's binding left it
set_process_cpus(frozenset({a}))
if sys.argv[3] == "refuse":
    binding._set_mempolicy = lambda mode, nodes: -1  # the kernel says EPERM
vllm_plugin._bind_to_gpu(0, "worker", root=sys.argv[1])
print(json.dumps({"notes": vllm_plugin._notes, "mask": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.parametrize("memory", ["allowed", "refuse"])
def test_a_gpu_worker_is_widened_to_the_launchers_mask_before_its_binding(
    memory, two_cpus, tmp_path
):
    """The worker inherits the engine core's narrower mask: it takes the
    launcher's back before binding to its GPU's node, and a refused memory
    policy is said as such, not as a worker left where it was."""
    from cpupin.host.shapes import HOSTS, build_tree

    a, b = two_cpus
    if b >= 56:
        pytest.skip("this machine's CPUs are not on the DGX H100 tree's node 0")
    root = build_tree(HOSTS["dgx-h100"], tmp_path / "dgx")
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        "CPUPIN_REGISTRY": "0",
        "CPUPIN_VLLM_MASK": f"{a},{b}",
    }
    out = run([sys.executable, "-c", WIDEN_AND_BIND, str(root), str(a), memory], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["mask"] == [a, b]
    (note,) = got["notes"]
    assert note.startswith("worker bound to CUDA device 0 (0000:"), note
    if memory == "refuse":
        assert "memory none; " in note and "not moved" not in note


ENGINE_ON_TREE = """
import json, sys
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
vllm_plugin._state["role"] = "vllm-engine-core"
vllm_plugin._bind_engine_core(root=sys.argv[1])
print(json.dumps(vllm_plugin._notes))
"""


@pytest.mark.parametrize(
    ("visible", "says"),
    [
        ("0,1,2,3,4,5,6,7", "engine core bound to node(s) 0-1 of its 8 GPU(s): CPUs "),
        ("0,1", "engine core bound to node(s) 0 of its 2 GPU(s): CPUs "),
        ("4,5", "engine core not moved: the launcher's CPUs hold none of its GPUs' node(s) 1"),
    ],
)
def test_the_engine_core_is_bound_to_every_node_of_its_gpus(visible, says, two_cpus, tmp_path):
    """Eight-way tensor parallel on a DGX H100: the engine core spans both
    nodes (it drives ranks on each, and they start from it), not rank 0's."""
    from cpupin.host.shapes import HOSTS, build_tree

    if max(two_cpus) >= 56:
        pytest.skip("this machine's CPUs are not on the DGX H100 tree's node 0")
    root = build_tree(HOSTS["dgx-h100"], tmp_path / "dgx")
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": visible,
        "CPUPIN_REGISTRY": "0",
        "CPUPIN_VLLM_MASK": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
    }
    out = run([sys.executable, "-c", ENGINE_ON_TREE, str(root)], env=env)
    assert out.returncode == 0, out.stderr
    (note,) = json.loads(out.stdout)
    assert note.startswith(says), note


PIN_ON_TREE = """
import json, os, sys
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
from cpupin.registry import writer as registry
from cpupin.threads.pins import pinned_threads
vllm_plugin._state.update(role="vllm-worker", mode="auto")
vllm_plugin._bind_to_gpu(0, "worker", root=sys.argv[1])
vllm_plugin._pin_step_on_gpu(0, root=sys.argv[1])
me = registry.os.getpid()
print(json.dumps({
    "notes": vllm_plugin._notes,
    "mask": sorted(os.sched_getaffinity(0)),
    "pins": {str(t): sorted(c) for t, c in pinned_threads().items()},
    "tid": __import__("threading").get_native_id(),
}))
"""


@pytest.mark.parametrize(
    "host, setting",
    [
        ("gh200", "auto"),
        ("gh200", "off"),
        ("gh200", "0"),
        ("gh200", "1"),  # the result thread needs a CPU above it
        ("gh200", "9999"),
        ("gh200", "soon"),
        ("dgx-h100", "auto"),
        ("dgx-h100", "1"),
    ],
)
def test_a_gpu_workers_step_thread_is_pinned_as_the_setting_says(host, setting, two_cpus, tmp_path):
    """On a host's tree with this machine's two CPUs (both on device 0's
    node): ``auto`` and a CPU number pin the step thread within the node,
    as cpupin's placement does, registered as a step pin; ``off`` (the
    default) leaves it and points at the doctor; a bad setting, a CPU
    outside the mask or with no CPU above it for the result thread, or a
    rule ``auto`` cannot meet (a DGX H100's node 0
    has four GPUs, and two CPUs cannot give each a core) leave it, with the
    reason. Never raises."""
    from cpupin.host.shapes import HOSTS, build_tree

    root = build_tree(HOSTS[host], tmp_path / "tree")
    (tmp_path / "locks").mkdir()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(HOSTS[host].gpus))),
        "CPUPIN_LOCK_DIR": str(tmp_path / "locks"),
        "CPUPIN_STEP_THREAD_CORE": setting,
    }
    out = run([sys.executable, "-c", PIN_ON_TREE, str(root)], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    notes = " | ".join(got["notes"])
    assert "worker bound to CUDA device 0" in notes, notes
    if setting == "0" or (setting, host) == ("auto", "gh200"):
        assert "step thread pinned to CPU" in notes, notes
        pin = got["pins"][str(got["tid"])]
        assert got["mask"] == pin and len(pin) == 1  # the oracle: the kernel's mask
        if setting == "0":
            assert pin == [0]
        assert f"CPU {pin[0]} for CUDA device 0" in notes
    else:
        assert "step thread not pinned: " in notes and got["pins"] == {}, notes
        assert got["mask"] == [0, 1]
        if setting == "off":
            assert "cpupin doctor" in notes
        elif setting == "auto":
            assert "4 GPU(s)" in notes
        else:
            assert setting in notes  # the reason names the value


@given(st.frozensets(st.integers(0, 300), min_size=1, max_size=64), st.integers(-2, 70))
def test_quota_cpus_keeps_the_quotas_cpus_of_the_mask(mask, capacity):
    got = vllm_plugin.quota_cpus(mask, capacity)
    assert got <= mask and got
    if 1 <= capacity < len(mask):
        assert len(got) == capacity and max(got) < min(mask - got)  # the lowest
    else:
        assert got == mask


def physical_cores(cpus, host):
    """How many physical cores ``cpus`` span: vLLM-CPU's OpenMP threads, one
    a core, before it reserves one for itself."""
    return sum(1 for core in host.cores if set(core.cpus) & cpus)


@pytest.mark.parametrize(("quota", "cores"), [(10, 10), (4, 4), (1, 1), (25, 20)])
def test_a_quota_keeps_one_cpu_a_core_first_where_siblings_sit_side_by_side(quota, cores):
    """The h100-vm numbers a core's two hardware threads side by side: the
    lowest 10 CPUs would be 5 cores, and vLLM-CPU's one OpenMP thread a
    core would run 4 threads where the quota pays for 9."""
    host = host_named("h100-vm")
    keep = vllm_plugin.quota_cpus(host.cpus, quota, host)
    assert len(keep) == quota and physical_cores(keep, host) == cores
    assert physical_cores(vllm_plugin.quota_cpus(host.cpus, 10), host) == 5  # the lowest


def test_a_quota_takes_the_priority_cores_first():
    host = host_named("xeon6-pct")  # a class of priority cores among the others
    keep = vllm_plugin.quota_cpus(host.cpus, 6, host)
    ranks = {core.rank for core in host.cores if set(core.cpus) & keep}
    assert ranks == {0} and physical_cores(keep, host) == 6


@given(st.data())
def test_a_quota_on_a_random_host_spans_as_many_cores_as_it_can(data):
    host = spec_host(data.draw(host_specs(max_cores=32)))
    mask = data.draw(masks(host))
    capacity = data.draw(st.integers(1, len(mask)))
    keep = vllm_plugin.quota_cpus(mask, capacity, host)
    assert keep <= mask and len(keep) == capacity
    spanned = sum(1 for core in host.cores if set(core.cpus) & mask)
    assert physical_cores(keep, host) == min(capacity, spanned)


@pytest.mark.parametrize(
    ("env", "own", "plan"),
    [
        # TP=2 with vLLM's explicit binding: vLLM reserves nothing; the
        # other rank's CPU is OpenMP's, never a place to move threads to.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, {0}, ({0, 1}, set())),
        # DP=2: this engine's slice is {1}; the binding names both.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, {2, 3}, ({0, 1, 2, 3}, set())),
        # the engine core's word: every rank's CPUs and vLLM's reserved ones
        ({"CPUPIN_VLLM_OMP": "0;1"}, {0}, ({0}, {1})),
        ({"CPUPIN_VLLM_OMP": "0-2;3", "VLLM_CPU_OMP_THREADS_BIND": "auto"}, {1}, ({0, 1, 2}, {3})),
        # reserved CPUs that are a rank's OpenMP CPUs are not reserved
        ({"CPUPIN_VLLM_OMP": "0;1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, None, ({0, 1}, set())),
        # nothing known of OpenMP
        ({}, None, None),
        ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, None, None),
        ({"CPUPIN_VLLM_OMP": "x;y"}, {0}, ({0}, set())),
    ],
)
def test_omp_plan_moves_threads_only_to_what_vllm_reserves(env, own, plan):
    got = vllm_plugin.omp_plan(env, None if own is None else frozenset(own), frozenset(range(4)))
    assert got == (None if plan is None else (frozenset(plan[0]), frozenset(plan[1])))


@given(
    st.dictionaries(
        st.sampled_from(["CPUPIN_VLLM_OMP", "VLLM_CPU_OMP_THREADS_BIND"]),
        st.text(alphabet="0123456789-,;| x", max_size=16),
    ),
    st.none() | st.frozensets(st.integers(0, 15)),
    st.frozensets(st.integers(0, 15), min_size=1),
)
def test_omp_plan_never_reserves_a_ranks_openmp_cpu(env, own, launcher):
    got = vllm_plugin.omp_plan(env, own, launcher)
    if got is not None:
        every, reserved = got
        assert every and every <= launcher and reserved <= launcher and not every & reserved
        if own:
            assert own & launcher <= every


@pytest.mark.parametrize(
    ("lists", "reserved", "launcher", "taken", "want"),
    [
        # two servers on two CPUs: the second's team takes the CPU vLLM
        # reserved, and reserves nothing
        ([[0]], [1], {0, 1}, {0}, ([[1]], [], set())),
        # room beside the reserved CPUs: those stay reserved
        ([[0, 1]], [3], set(range(8)), {0, 1}, ([[2, 4]], [3], set())),
        # two ranks keep their lengths and order
        ([[0], [1, 2]], [7], set(range(8)), {1}, ([[0], [2, 3]], [7], set())),
        # no room: shared, said, unchanged
        ([[0, 1]], [], set(range(8)), {0, 2, 3, 4, 5, 6, 7}, ([[0, 1]], [], {0})),
        # nothing shared: unchanged
        ([[0]], [1], set(range(8)), {5}, ([[0]], [1], set())),
    ],
)
def test_avoid_teams_moves_a_team_off_another_servers_where_there_is_room(
    lists, reserved, launcher, taken, want
):
    got = vllm_plugin.avoid_teams(lists, reserved, frozenset(launcher), frozenset(taken))
    assert got == (want[0], want[1], frozenset(want[2]))


@given(
    st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True), max_size=3),
    st.lists(st.integers(0, 15), max_size=3, unique=True),
    st.frozensets(st.integers(0, 15), min_size=1),
    st.frozensets(st.integers(0, 15)),
)
def test_avoid_teams_never_lands_on_another_team_and_keeps_each_ranks_size(
    lists, reserved, launcher, taken
):
    moved, kept, shared = vllm_plugin.avoid_teams(lists, reserved, launcher, taken)
    assert [len(c) for c in moved] == [len(c) for c in lists]
    team = {c for cpus in moved for c in cpus}
    if shared:
        assert moved == lists and shared == team & taken
    else:
        assert not team & taken
        if moved != lists:
            assert team <= launcher and not team & set(kept)


ENGINE_PLAN = """
import json, os, sys, threading, types
from cpupin.integrations.vllm import wiring
from cpupin.threads.thread import Thread
stop = threading.Event()
helper = Thread(target=stop.wait, name="gloo_helper", daemon=True)
helper.start()
wiring._state.update(role="vllm-engine-core")
lists, reserved = json.loads(sys.argv[1]), json.loads(sys.argv[2])
manager = types.SimpleNamespace(cpu_lists=lists, reserved_cpu_list=reserved)
wiring._after_omp_plan(manager, "auto")
print(json.dumps({"notes": wiring._notes, "helper": sorted(os.sched_getaffinity(helper.native_id)),
                  "plan": os.environ.get("CPUPIN_VLLM_OMP")}))
stop.set()
"""


def test_the_engine_core_of_one_dp_rank_moves_nothing_onto_the_others_openmp_cpu(
    tmp_path, two_cpus
):
    """DP=2 with VLLM_CPU_OMP_THREADS_BIND=0|1: this engine's list is [0],
    vLLM reserves nothing, and CPU 1 is the other engine's OpenMP CPU."""
    a, b = two_cpus
    env = fake_vllm_env(tmp_path, VLLM_CPU_OMP_THREADS_BIND=f"{a}|{b}", CPUPIN_VLLM_MASK=f"{a},{b}")
    out = run([sys.executable, "-c", ENGINE_PLAN, json.dumps([[a]]), "[]"], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["helper"] == sorted({a, b})  # not moved
    assert any(n.startswith("nothing moved: vLLM reserves no CPU") for n in got["notes"])
    assert got["plan"] in (f"{a},{b};", f"{a}-{b};")


def test_the_engine_core_moves_threads_to_what_vllm_reserves(tmp_path, two_cpus):
    a, b = two_cpus
    env = fake_vllm_env(tmp_path, VLLM_CPU_OMP_THREADS_BIND="auto", CPUPIN_VLLM_MASK=f"{a},{b}")
    out = run([sys.executable, "-c", ENGINE_PLAN, json.dumps([[a]]), json.dumps([b])], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["helper"] == [b]
    assert got["plan"] == f"{a};{b}"


def test_server_groups_put_each_member_under_its_api_server_and_mark_orphans():
    procs = [
        {"pid": 30, "role": "vllm-worker", "server_pid": 10, "live": True},
        {"pid": 10, "role": "vllm-api-server", "server_pid": None, "live": True},
        {"pid": 20, "role": "vllm-engine-core", "server_pid": 10, "live": True},
        # a second server whose API server was killed: its engine core and
        # worker are orphans
        {"pid": 50, "role": "vllm-engine-core", "server_pid": 40, "live": True},
        {"pid": 60, "role": "vllm-worker", "server_pid": 40, "live": True},
        {"pid": 40, "role": "vllm-api-server", "server_pid": None, "live": False},
        {"pid": 70, "role": None, "server_pid": None, "live": True},  # not vLLM's
    ]
    groups = servers.server_groups(procs)
    assert groups == [
        {"api_pid": 10, "api_live": True, "members": [10, 20, 30], "orphans": []},
        {"api_pid": 40, "api_live": False, "members": [50, 60], "orphans": [50, 60]},
    ]
    from cpupin.cli.ps import _server_line

    line = _server_line({**groups[1], "command": None, "port": None})
    assert "orphans: API server pid 40 is gone" in line and line.endswith("kill 50 60")


@pytest.mark.parametrize(
    ("argv", "port"),
    [
        (["vllm", "serve", "m", "--port", "8001"], 8001),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--port=9000"], 9000),
        (["vllm", "serve", "m"], None),
        (["vllm", "serve", "--port", "x"], None),
        (["vllm", "serve", "--port"], None),
    ],
)
def test_server_port_reads_the_command_line(argv, port):
    assert servers.server_port(argv) == port


VLLM_REFUSES = """
import json, sys, types
mod = types.ModuleType("vllm.utils.ompmultiprocessing")
class OMPProcessManager:
    def __init__(self, config):
        raise AssertionError("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers.")
mod.OMPProcessManager = OMPProcessManager
for name in ("vllm", "vllm.utils"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm.utils"].ompmultiprocessing = mod
sys.modules["vllm.utils.ompmultiprocessing"] = mod
from cpupin.integrations.vllm import wiring
wiring._wrap_omp_manager("auto")
try:
    OMPProcessManager(None)
except AssertionError as exc:
    print(json.dumps({"error": str(exc), "notes": getattr(exc, "__notes__", [])}))
"""


def test_an_error_of_vllms_that_passes_through_the_plugin_says_it_is_vllms(tmp_path):
    """vLLM refuses --tensor-parallel-size 2 on one node in its OpenMP plan,
    which the plugin wraps: the traceback says the refusal is vLLM's own."""
    out = run(
        [sys.executable, "-c", VLLM_REFUSES], env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["error"].startswith("Not enough allowed NUMA nodes")  # vLLM's, unchanged
    (note,) = got["notes"]
    assert note.startswith("cpupin: this error is vLLM's own, raised in vLLM's OpenMP plan")


FIT_QUOTA = """
import json, os, subprocess, sys, threading
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
from cpupin.threads.thread import Thread
started = threading.Event()
Thread(target=started.wait, daemon=True).start()  # a thread that exists already
vllm_plugin._state.update(role="vllm-api-server")
vllm_plugin._fit_quota(act=sys.argv[1] == "auto")
masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True)
print(json.dumps({"notes": vllm_plugin._notes, "masks": masks, "child": child.stdout.strip(),
                  "env": os.environ.get(vllm_plugin.ENV_MASK)}))
started.set()
"""


@pytest.mark.parametrize("mode", ["auto", "observe"])
def test_a_server_is_confined_to_its_quotas_cpus_before_its_children_start(mode, two_cpus):
    """In a real cgroup with a quota of one CPU and a mask of two: ``auto``
    moves every thread of the API server, and so every child it starts, to
    one CPU (the oracles: the kernel's masks of each thread and of a child);
    ``observe`` moves nothing and says what ``auto`` would do."""
    from tests.support.cgroups import in_cgroup, quota_cgroup

    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_MASK}
    env["CPUPIN_REGISTRY"] = "0"
    with quota_cgroup(100_000) as (path, _):
        out = subprocess.run(
            [sys.executable, "-c", FIT_QUOTA, mode], capture_output=True, text=True,
            timeout=120, check=False, env=env, preexec_fn=in_cgroup(path),
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    notes = " | ".join(got["notes"])
    if mode == "auto":
        first = [two_cpus[0]]
        assert all(m == first for m in got["masks"].values()), got["masks"]
        assert got["child"] == str(first) and got["env"] == str(first[0])
        assert f"server confined to CPU {first[0]} of " in notes and "quota (1 CPU)" in notes
    else:
        assert all(len(m) >= 2 for m in got["masks"].values())
        assert got["child"] != str([two_cpus[0]]) and got["env"] is None
        assert "CPUPIN_VLLM=auto confines the server to CPU" in notes


HOLD_SERVER = """
import json, os, sys
from cpupin.registry import servers
from cpupin.integrations.vllm import wiring as vllm_plugin
vllm_plugin._state.update(role="vllm-api-server", mode="auto")
vllm_plugin._hold_server_cpus()
hold = vllm_plugin._state.get("wake_hold")
path = "/sys/devices/system/cpu/cpu{}/power/pm_qos_resume_latency_us"
values = {c: open(path.format(c)).read().strip() for c in sorted(os.sched_getaffinity(0))
          if os.path.exists(path.format(c))}
print(json.dumps({"notes": vllm_plugin._notes, "held": hold and sorted(hold.cpus),
                  "values": values}))
"""


@pytest.mark.xdist_group("host")  # it holds the host's PM QoS: beside the wake tests, not with
@pytest.mark.parametrize("value", ["0", "x", None])
def test_a_cpu_server_holds_its_cpus_wake_latency_when_asked(value, tmp_path):
    """``CPUPIN_WAKE_LATENCY_US=0`` under auto on vLLM-CPU: the API server
    holds every CPU of the server's mask (the kernel's files say n/a while it
    lives, and their old values come back at its exit); a bad value is a
    note, and unset holds nothing."""
    from tests.support.wake import REAL, machine_refusal

    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_MASK}
    env["CPUPIN_LOCK_DIR"] = str(tmp_path)
    env.pop("CPUPIN_WAKE_LATENCY_US", None)
    if value is not None:
        env["CPUPIN_WAKE_LATENCY_US"] = value
    cpus = sorted(os.sched_getaffinity(0))
    before = {
        c: open(REAL.format(c)).read().strip() for c in cpus if os.path.exists(REAL.format(c))
    }
    out = subprocess.run([sys.executable, "-c", HOLD_SERVER], capture_output=True, text=True,
                         timeout=60, check=False, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    after = {c: open(REAL.format(c)).read().strip() for c in before}
    assert after == before  # its exit put them back
    notes = " | ".join(got["notes"])
    if value is None:
        assert got["held"] is None and "wake latency" not in notes
    elif value == "x":
        assert got["held"] is None and "CPUPIN_WAKE_LATENCY_US='x'" in notes
    elif machine_refusal() is None:
        assert got["held"] == cpus and "held at 0 µs" in notes
        assert all(v == "n/a" for v in got["values"].values())
    else:
        assert got["held"] is None and "not held" in notes


# --- every process vLLM makes, and every bad value said once --------------------

FORKED = """
import json, multiprocessing, os, sys
sys.argv = ["vllm", "serve", "model"]
import vllm.plugins
vllm.plugins.load_general_plugins()  # the API server, before it starts anything
from cpupin.integrations.vllm import wiring
parent = {"role": wiring._state.get("role"), "notes": list(wiring._notes)}
def child(queue):
    vllm.plugins.load_general_plugins()  # as EngineCore.__init__ and init_worker do
    queue.put({"role": wiring._state.get("role"), "notes": list(wiring._notes)})
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(queue,), name=os.environ["CHILD_NAME"])
proc.start()
got = queue.get(timeout=60)
proc.join(60)
print(json.dumps({"parent": parent, "child": got}))
"""


def fake_vllm_env(tmp_path, **extra):
    for rel, text in FAKE_VLLM.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUPIN_")}
    env.update(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        CPUPIN_LOCK_DIR=str(tmp_path),
        **extra,
    )
    return env


@pytest.mark.parametrize(
    "name, role", [("VllmWorker-0", "vllm-worker"), ("EngineCore_DP0", "vllm-engine-core")]
)
def test_a_forked_child_finds_its_own_role(tmp_path, name, role):
    """vLLM forks its engine core and workers where no CUDA context exists
    (its default on Linux), and its own flag would not load the plugins in
    the child again: the child must forget the API server's role and find
    its own when vLLM asks."""
    out = run([sys.executable, "-c", FORKED], env=fake_vllm_env(tmp_path, CHILD_NAME=name))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["parent"]["role"] == "vllm-api-server"
    assert got["child"]["role"] == role
    said = role[5:].replace("-", " ")
    assert got["child"]["notes"][0].startswith(f"cpupin observe in the {said}")
    assert not any("api server" in n for n in got["child"]["notes"]), got["child"]["notes"]


BAD_VALUES = {
    "CPUPIN_WAKE_LATENCY_US": [
        "x",
        "-1",
        "1.5",
        "2000000001",
        " 5 x",
        "0x10",
        "1e3",
        "",
        "١٢",
        "5µs",
    ],
    "CPUPIN_STEP_THREAD_CORE": [
        "x",
        "-1",
        "1.5",
        "auto auto",
        "AUTOMATIC",
        "0x1",
        "1e2",
        "on",
        "cpu3",
        "3-4",
        "3,4",
        "١",
        "99999999999999999999",
    ],
    "CPUPIN_VLLM_MASK": ["x", "0-", "99999", "", "1-0", "a,b"],
    "CPUPIN_POOL_VARS": ["PATH=1", "x", "OMP_NUM_THREADS=1,LD_PRELOAD=/x", "=1"],
    "CPUPIN_VLLM": ["yes", "observe auto", "0"],
}
BAD = [(k, v) for k, values in BAD_VALUES.items() for v in values]


@pytest.mark.parametrize("name, value", BAD)
def test_every_bad_value_is_one_warning_naming_it(name, value):
    from cpupin import _native
    from cpupin.integrations.vllm.decisions import env_warnings

    lines = env_warnings({name: value}, _native.online_cpus())
    if name == "CPUPIN_WAKE_LATENCY_US" and value == "":
        assert lines == []  # empty: unset
        return
    if name == "CPUPIN_STEP_THREAD_CORE":
        from cpupin.errors import PlanError
        from cpupin.plan.placement import setting_from_env

        try:
            setting_from_env({name: value})
        except PlanError:
            pass
        else:
            assert lines == []  # a setting the oracle takes is no warning
            return
    assert len(lines) == 1 and name in lines[0], lines


@pytest.mark.parametrize(
    "env",
    [{}, {"CPUPIN_WAKE_LATENCY_US": "0"}, {"CPUPIN_STEP_THREAD_CORE": "auto"},
     {"CPUPIN_VLLM_MASK": "0"}, {"CPUPIN_POOL_VARS": "OMP_NUM_THREADS=2,MKL_NUM_THREADS=1"},
     {"CPUPIN_VLLM": "AUTO"}],
)  # fmt: skip
def test_good_values_warn_nothing(env):
    from cpupin import _native
    from cpupin.integrations.vllm.decisions import env_warnings

    assert env_warnings(env, _native.online_cpus()) == []


def test_bad_values_are_warned_once_by_the_server_and_it_still_starts(tmp_path):
    """The API server says each bad value once at WARNING (Python's last
    resort handler prints it here, vLLM's own handler in a server); its
    forked child, with the same environment, says nothing again."""
    bad = {"CPUPIN_WAKE_LATENCY_US": "fast", "CPUPIN_STEP_THREAD_CORE": "cpu3",
           "CPUPIN_VLLM_MASK": "0-", "CPUPIN_POOL_VARS": "PATH=1"}  # fmt: skip
    env = fake_vllm_env(tmp_path, CHILD_NAME="VllmWorker-0", **bad)
    out = run([sys.executable, "-c", FORKED], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["child"]["role"] == "vllm-worker"  # started, and found its role
    for name in bad:
        said = [line for line in out.stderr.splitlines() if f"cpupin: {name}=" in line]
        assert len(said) == 1, (name, out.stderr)
