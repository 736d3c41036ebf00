import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings

# The fixtures every part's tests share, from tests/support/.
from tests.support.captures import unpacked  # noqa: F401

settings.register_profile("default", max_examples=200, deadline=None)
settings.register_profile(
    "ci", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)


def pytest_configure(config):
    """The suite's own lock directory: a test never reads or writes the
    records, locks and journals of the host's other processes in /tmp
    (another suite, a server), and they never see the suite's. A test
    about the default directory asks for it by name. Each pytest-xdist
    worker has one of its own: the workers' tests never see each other's."""
    made = os.environ.get("_CPUPIN_SUITE_LOCKS")
    if not os.environ.get("CPUPIN_LOCK_DIR") or (
        os.environ.get("PYTEST_XDIST_WORKER") and os.environ["CPUPIN_LOCK_DIR"] == made
    ):
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        config._cpupin_locks = tempfile.mkdtemp(prefix="cpupin-suite-locks-", dir=base)
        os.environ["CPUPIN_LOCK_DIR"] = config._cpupin_locks
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            os.environ["_CPUPIN_SUITE_LOCKS"] = config._cpupin_locks


def pytest_unconfigure(config):
    where = getattr(config, "_cpupin_locks", None)
    if where:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_affinity():
    """Every test leaves the calling thread's mask as it found it."""
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


@pytest.fixture(autouse=True)
def _host_alone(request):
    """Under pytest-xdist, a test of the "host" group (it reads or sets the
    host's PM QoS or interrupts) runs while no other worker runs a test:
    any test may start a process that holds the wake latency (the doctor
    does, measuring). A lock file the workers share: the host's tests take
    it exclusively, every other test shared."""
    where = os.environ.get("_CPUPIN_SUITE_LOCKS")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not where or not os.path.isdir(where):
        yield
        return
    marker = request.node.get_closest_marker("xdist_group")
    alone = marker is not None and "host" in (*marker.args, *marker.kwargs.values())
    fd = os.open(os.path.join(where, "host.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@pytest.fixture
def two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs in the mask")
    return cpus[:2]


@pytest.fixture(scope="session")
def fast_dir():
    """A context manager for a fresh folder, in memory where /dev/shm allows
    (a host tree is thousands of small files; this disk makes them slowly)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

    @contextmanager
    def make():
        path = tempfile.mkdtemp(prefix="cpupin-test-", dir=base)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    return make


# --- no skip in CI ----------------------------------------------------------
# Every test can run in CI, which installs what each needs (.ci/run): there, a
# skip hides a check that did not happen, so it fails the run, as
# threadpoolctl's CI does. Elsewhere a skip says what to install.

_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("CI"):
        _skipped.append(f"{report.nodeid}: {report.longrepr[-1] if report.longrepr else ''}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _skipped:
        terminalreporter.section("skipped under CI=true (each fails the run)")
        for line in _skipped:
            terminalreporter.write_line(line)
