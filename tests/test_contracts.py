"""Which functions exist and what they do where thread affinity is missing."""

import ast
import errno
import importlib.util
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import cpupin

ROOT = Path(__file__).resolve().parent.parent

NATIVE_API = [
    "gettid",
    "getcpu",
    "get_affinity",
    "set_affinity",
    "schedstat",
    "thread_stats",
    "parse_cpulist",
    "format_cpulist",
    "parse_cpumask",
    "process_cpus",
    "set_process_cpus",
    "online_cpus",
]


def test_the_public_api_is_exported():
    for name in NATIVE_API + ["SchedStat", "ThreadStat", "UnsupportedPlatform"]:
        assert name in cpupin.__all__
        assert getattr(cpupin, name) is not None
    assert set(cpupin.__all__) <= set(dir(cpupin))


def test_only_native_imports_the_compiled_module():
    for path in (ROOT / "cpupin").rglob("*.py"):
        if path.name != "_native.py":
            assert "_cpupin" not in path.read_text(), path


def test_linux_has_affinity():
    assert cpupin.HAVE_AFFINITY is sys.platform.startswith("linux")


STUB_SCRIPT = """
import cpupin
assert not cpupin.HAVE_AFFINITY
assert cpupin.parse_cpulist("0-3") == {0, 1, 2, 3}
for call in (cpupin.getcpu, cpupin.get_affinity, lambda: cpupin.set_affinity({0}),
             cpupin.schedstat, cpupin.thread_stats, cpupin.process_cpus):
    try:
        call()
    except cpupin.UnsupportedPlatform as exc:
        assert "Linux" in str(exc) and isinstance(exc, OSError), exc
    else:
        raise AssertionError(call)
assert cpupin.gettid() > 0
print("ok")
"""


def load_build():
    spec = importlib.util.spec_from_file_location("cpupin_build", ROOT / "csrc" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def run_variant(tmp_path, script, **options):
    """Compile the extension with ``make_ffi(**options)`` beside a copy of the
    package under tmp_path, and run ``script`` against it."""
    package = tmp_path / "cpupin"
    shutil.copytree(
        ROOT / "cpupin", package, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.c")
    )
    load_build().make_ffi(**options).compile(tmpdir=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path)},
        check=False,
    )
    return out.stdout.strip(), out.stderr


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@needs_cc
def test_without_affinity_import_works_and_calls_raise_unsupportedplatform(tmp_path):
    out, err = run_variant(tmp_path, STUB_SCRIPT, stubs=True)
    assert out == "ok", err


GIL_SCRIPT = """
import threading
from cpupin import _native
box = []
t = threading.Thread(target=lambda: box.append(_native.holds_gil())); t.start(); t.join()
print(_native.holds_gil(), box[0])
"""


def test_calls_keep_the_gil_in_every_thread():
    """From inside a call: cffi's wrappers would drop the GIL; ours keep it."""
    from cpupin import _native

    box = []
    t = threading.Thread(target=lambda: box.append(_native.holds_gil()))
    t.start()
    t.join()
    assert _native.holds_gil() is True and box == [True]


@needs_cc
def test_the_gil_check_sees_a_build_that_drops_it(tmp_path):
    """The control: built with cffi's default, the same check says False."""
    out, err = run_variant(tmp_path, GIL_SCRIPT, release_gil=True)
    assert out == "False False", err


ERRNO_SCRIPT = """
import threading
from cpupin import _native
def failing_call():
    # No task has a pid past the kernel's largest (2**22): the open fails
    # with ENOENT in C, and the call returns -ENOENT.
    _native.ffi.errno = 0
    out = _native.ffi.new("unsigned long long[3]")
    rc = _native.lib.cpupin_schedstat(2**22 + 7, 2**22 + 7, out)
    return f"{rc < 0}:{_native.ffi.errno}"
box = []
t = threading.Thread(target=lambda: box.append(failing_call())); t.start(); t.join()
print(failing_call(), box[0])
"""


def test_calls_leave_cffis_saved_errno_alone():
    """cffi saves errno after each call in a block per thread, allocated at a
    thread's first call (3.5 µs of every new thread's start): ours skip it,
    since every function returns ``-errno`` itself and nothing reads
    ``ffi.errno``."""
    out = subprocess.run([sys.executable, "-c", ERRNO_SCRIPT], capture_output=True, text=True)
    assert out.stdout.split() == ["True:0", "True:0"], out.stderr


@needs_cc
def test_the_errno_check_sees_a_build_that_saves_it(tmp_path):
    """The control: built with cffi's default, the failing call's ENOENT is
    saved where ``ffi.errno`` reads it."""
    out, err = run_variant(tmp_path, ERRNO_SCRIPT, release_gil=True)
    assert out.split() == [f"True:{errno.ENOENT}"] * 2, err


def test_the_redefinition_precedes_every_cffi_wrapper(tmp_path):
    """cffi writes the set_source text first and its wrappers after it; the
    macros that keep the GIL must be redefined before the first wrapper."""
    path = tmp_path / "generated.c"
    load_build().make_ffi().emit_c_code(str(path))
    text = path.read_text()
    redefined = text.index("#define Py_BEGIN_ALLOW_THREADS {")
    first_wrapper = text.index("_cffi_f_cpupin_")
    assert redefined < first_wrapper
    assert text.count("#define Py_BEGIN_ALLOW_THREADS {") == 1
    assert redefined < text.index("#define _cffi_save_errno() ((void)0)") < first_wrapper


def _imports(path):
    """The cpupin modules a file imports, anywhere in it (top or function)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    out.add(".".join((*base, node.module)))
                else:
                    out.update(".".join((*base, alias.name)) for alias in node.names)
            elif node.module and node.module.startswith("cpupin"):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cpupin"))
    return out


def test_no_module_imports_one_that_imports_it_back():
    modules = {}
    for path in (ROOT / "cpupin").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        # "from cpupin import x" names a module x or a name in __init__.
        deps = set()
        for dep in _imports(path):
            deps.add(dep if dep in modules else dep.rsplit(".", 1)[0])
        graph[name] = {d for d in deps if d in modules and d != name and d != "cpupin"}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    assert {name for name in graph if name in reach(name)} == set()
    assert "cpupin.host.cgroup" not in graph["cpupin.host.cgroup"] and graph["cpupin.cli.topo"]


LIGHT_IMPORT = """
import sys
import cpupin
heavy = ["logging", "concurrent.futures", "dataclasses", "argparse", "typing", "inspect",
         "cpupin.host.topology", "cpupin.registry.reader", "cpupin.cli", "cpupin.measure.sampling",
         "cpupin.host.shapes", "cpupin.plan.binding", "cpupin.act.server"]
print(sorted(m for m in heavy if m in sys.modules))
from cpupin.cli import build_parser
build_parser("exec")
print(sorted(m for m in sys.modules if m.startswith("cpupin.cli.")))
"""


def test_import_cpupin_loads_only_what_pinning_needs():
    """What ``import cpupin`` costs is what it loads (timed in
    bench/startup.py): pinning and the process mask, not the topology, the
    registry's reader, the CLI or the standard library's logging,
    dataclasses, typing, argparse and concurrent.futures. ``cpupin exec`` loads its own
    subcommand's module alone."""
    out = subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, check=True
    )
    loaded, cli = out.stdout.splitlines()
    assert loaded == "[]", loaded
    assert cli == "['cpupin.cli._args', 'cpupin.cli._parser', 'cpupin.cli.bind']", cli


def test_every_public_name_resolves_and_none_is_shadowed_by_a_module():
    import importlib
    import pkgutil

    import cpupin

    for info in pkgutil.walk_packages(cpupin.__path__, "cpupin."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)  # importing a submodule sets an attribute
    for name in cpupin.__all__:
        value = getattr(cpupin, name)
        assert not isinstance(value, type(cpupin)), f"cpupin.{name} is a module"
    assert callable(cpupin.census) and callable(cpupin.ThreadPool)


#: Every name of the public surface before the package had parts: each must
#: still import from ``cpupin`` (docs/architecture.md: the layout is not API).
PUBLIC_BEFORE_THE_PARTS = """
HAVE_AFFINITY Binding Census Pool PoolLimits Step StepClock census cpu_plan limit_pools
pool_env usable_cpus bind_process decide_binding Claim HandoffResult Core CoreClass CpuOrigin
CpuPlan IrqOnPin explain_cpus read_irqs Gpu Host IdleState Node PlanError Placement Quota Pin
ServerPlan Thread ThreadInfo ThreadPool Queue Sampler ThreadSample WorkerPlacement child_env
claim_gpus parse_pci_address parse_setting pin_current_thread pin_step_thread pinned_threads
refresh_process_cpus register_warmup stray_threads place plan_server read_host resolve_devices
sample_threads setting_from_env SchedStat ThreadStat UnsupportedPlatform __version__
format_cpulist get_affinity getcpu gettid online_cpus parse_cpulist parse_cpumask process_cpus
schedstat set_affinity set_process_cpus thread_stats HoldRefused WakeHold hold_wake_latency
NodeMemory memory_by_node Drift PinGuard check_pins guard_pins
""".split()


#: Names added to the public surface since, each with the issue that added it.
ADDED_SINCE = {
    "apply_thread_limits": "issue 36: OpenMP keeps limit_pools()'s limit per thread",
}


def test_the_public_surface_is_the_one_before_the_parts():
    """The same names, and those added since, each importable from the
    package in a fresh process (a lazy name that pointed at a moved module
    would fail only there)."""
    assert sorted(cpupin.__all__) == sorted(PUBLIC_BEFORE_THE_PARTS + list(ADDED_SINCE))
    code = (
        "import cpupin\nfor n in cpupin.__all__:\n    exec(f'from cpupin import {n}')\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_module_paths_the_guides_name_still_import():
    """docs/pinning.md's cpupin.hosts and cpupin.handoff, the README's
    cpupin.metrics, and vLLM's entry point, as the installed metadata has it."""
    from importlib.metadata import entry_points

    from cpupin.hosts import host_named

    assert host_named("dgx-h100").gpus
    assert callable(cpupin.handoff.handoff)
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cpupin"]
    assert plugin.value == "cpupin.integrations.vllm:register" and callable(plugin.load())
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from cpupin.metrics import ThreadCollector

    assert ThreadCollector.__module__ == "cpupin.measure.metrics"
