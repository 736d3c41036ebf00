"""Every subcommand and flag, fed what a tired operator or a script gone wrong
types: the command exits 0 or 2 with one message, never a traceback, and
never hangs (an alarm fails a run that does)."""

import contextlib
import io
import os
import signal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpupin.cli import main
from cpupin.host.shapes import HOSTS

JUNK = st.sampled_from(
    [
        "",
        " ",
        "-1",
        "0",
        "1",
        "2",
        "abc",
        "1e400",
        "nan",
        "inf",
        "-inf",
        "0x10",
        "1_000",
        "99999999999999999999",
        "4194304",
        "3.5",
        " 7",
        "\u0663",
        "0-",
        "0-3",
        "5000",
        "0,1",
        "any,any",
        "0,9999",
        "\x00",
        "../../etc",
        "-" * 50,
        "9" * 5000,
    ]
) | st.text(max_size=30)

HOST = st.sampled_from(sorted(HOSTS)) | JUNK
ROOT = st.sampled_from(["/", "/no/such/dir", "/dev/null", "/proc/self", ""]) | JUNK
PID = st.sampled_from([str(os.getpid()), "1"]) | JUNK


@st.composite
def argvs(draw):
    command = draw(
        st.sampled_from(
            ["topo", "plan", "threads", "audit", "top", "handoff", "doctor", "ps", "exec", "bogus"]
        )
    )
    argv = [command]

    def maybe(*flag):
        if draw(st.booleans()):
            argv.extend(flag)

    def where(required=False):
        choice = draw(st.sampled_from(["host", "root"] if required else ["host", "root", None]))
        if choice == "host":
            argv.extend(["--host", draw(HOST)])
        elif choice == "root":
            argv.extend(["--root", draw(ROOT)])

    if command == "topo":
        where()
    elif command == "plan":
        where()
        maybe("--mask", draw(st.sampled_from(["0-7", "0-3,112-115", "1"]) | JUNK))
        maybe("--setting", draw(st.sampled_from(["off", "auto", "0", "5"]) | JUNK))
        for _ in range(draw(st.integers(0, 2))):
            flag = draw(st.sampled_from(["--gpu", "--device"]))
            good = "0000:18:00.0" if flag == "--gpu" else "1"
            argv.extend([flag, draw(st.just(good) | JUNK)])
        maybe("--all-gpus")
    elif command in ("threads", "audit"):
        if command == "audit" or draw(st.booleans()):
            argv.append(draw(PID))
        if command == "audit":
            maybe("--fail-on-narrow")
        else:
            maybe("--tree")
    elif command == "top":
        argv.append(draw(PID.filter(lambda p: p != "self")))
        # A run that is valid must end: one sample of at most 10 ms.
        argv.extend(["--count", draw(st.just("1") | JUNK.filter(_not_a_small_count))])
        argv.extend(["--interval", draw(st.just("0.01") | JUNK.filter(_not_seconds))])
    elif command == "handoff":
        maybe("--cpus", draw(JUNK))
        maybe("--matrix")
        maybe("--plot", "/nonexistent-dir/x.png")
        maybe("--spin")
        maybe("--python")
        argv.extend(["--rounds", draw(st.sampled_from(["5", "0", "-5", "x", "1000001"]))])
        maybe("--idle-us", draw(st.sampled_from(["0", "10", "-1", "1e9", "x"])))
    elif command == "doctor":
        where(required=True)
        # A valid interval is 0 here: a fuzz run must not sleep.
        maybe("--irq-interval", draw(st.just("0") | JUNK.filter(_not_seconds)))
        maybe("--pid", draw(PID))  # with --host or --root: refused, exit 2
    elif command == "ps":
        argv.extend(["--interval", draw(st.just("0.01") | JUNK.filter(_not_seconds))])
        maybe("--lock-dir", draw(st.sampled_from(["/tmp", "/nonexistent", "/dev/null"]) | JUNK))
        maybe("--prometheus")
    elif command == "exec":
        # Always a dry run: a real one would replace this process.
        target = draw(st.sampled_from(["--gpu", "--device", "--node", "--local-rank", None]))
        if target == "--local-rank":
            argv.append(target)
        elif target is not None:
            argv.extend([target, draw(st.sampled_from(["0", "0000:18:00.0"]) | JUNK)])
        cpus = ["node", "socket", "exclusive", "cache", "keep", "0-3", "0-3,200", "99999"]
        maybe("--cpus", draw(st.sampled_from(cpus) | JUNK))
        maybe("--memory", draw(st.sampled_from(["preferred", "bind", "interleave", "none"]) | JUNK))
        where()
        maybe("--mask", draw(st.sampled_from(["0-7"]) | JUNK))
        argv.append("--dry-run")
        if draw(st.booleans()):
            argv.extend(["--", draw(st.sampled_from(["python", "true"]) | JUNK)])
    if command not in ("bogus",):
        maybe("--json")
    if draw(st.integers(0, 9)) == 0 and command != "exec":
        argv.insert(draw(st.integers(0, len(argv))), draw(JUNK))
    return argv


def _not_a_small_count(text):
    return not (text.strip().isascii() and text.strip().isdigit() and len(text.strip()) < 12)


def _not_seconds(text):
    try:
        return not float(text) <= 3600
    except (ValueError, OverflowError):
        return True


class Hang(Exception):
    pass


def run(argv, guard=10):
    """(exit code, stdout, stderr) of the command line run in this process;
    a guard of ``guard`` seconds (not a measure) fails a run that hangs."""

    def fire(signum, frame):
        raise Hang(f"{argv} ran past {guard} s")

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(guard)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: --help, or a bad argument
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, out.getvalue(), err.getvalue()


@settings(
    max_examples=int(os.environ.get("CPUPIN_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(argv=argvs())
def test_any_command_line_exits_0_or_2_with_no_traceback(argv):
    code, out, err = run(argv)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    assert "internal error" not in err, (argv, err)
    narrow = argv[0] == "audit" and "--fail-on-narrow" in argv
    assert code in ((0, 2, 3) if narrow else (0, 2)), (argv, code, err)
    if code == 2:
        assert err.strip(), argv


def test_an_internal_error_is_one_line_with_where_to_report(monkeypatch):
    from cpupin import cli
    from cpupin.cli import topo

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(topo, "run", broken)  # registered afresh by each main()
    code, out, err = run(["topo"])
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "internal error: KeyError" in err and cli.REPORT in err and "CPUPIN_DEBUG=1" in err
    monkeypatch.setenv("CPUPIN_DEBUG", "1")
    try:
        run(["topo"])
    except KeyError:
        pass
    else:
        raise AssertionError("CPUPIN_DEBUG=1 lets the exception through")
