"""``cpupin exec``'s quick reading of its usual command line, held to
argparse's own reading of the same words: whatever quick_args accepts,
argparse accepts too and reads the same; whatever argparse refuses, or
reads differently, quick_args leaves to argparse."""

import ast
import contextlib
import io
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin.cli import bind, build_parser, main

OPTIONS = [
    "--gpu",
    "--device",
    "--node",
    "--cpus",
    "--memory",
    "--wake-latency",
    "--local-rank",
    "--no-pools",
    # what quick_args leaves to argparse
    "--dry-run",
    "--json",
    "--root",
    "--host",
    "--mask",
    "--nod",
    "--no-p",
    "-h",
    "--help",
    "--bogus",
    "-n",
]
VALUES = [
    "0",
    "1",
    "7",
    "65535",
    "65536",
    "-1",
    " 3",
    "3 ",
    "\u0663",
    "x",
    "",
    "0000:17:00.0",
    "node",
    "socket",
    "exclusive",
    "cache",
    "keep",
    "0-1",
    "0,1",
    "1-0",
    "any",
    "preferred",
    "bind",
    "interleave",
    "none",
    "Preferred",
    "2000000",
    "--",
    "-x",
]
COMMAND = st.lists(st.sampled_from(["true", "python", "-c", "--", "--node", "1"]), max_size=3)


def _word(option, value, joined):
    return [f"{option}={value}"] if joined else [option, value]


@st.composite
def command_lines(draw):
    words = []
    for _ in range(draw(st.integers(0, 4))):
        option = draw(st.sampled_from(OPTIONS))
        if draw(st.booleans()) and option not in ("--local-rank", "--no-pools", "-h", "--help"):
            words += _word(option, draw(st.sampled_from(VALUES)), draw(st.booleans()))
        else:
            words.append(option)
    if draw(st.integers(0, 9)):  # mostly with the -- that opens the command
        words.append("--")
    return words + draw(COMMAND)


def argparse_reading(words):
    """argparse's namespace for ``cpupin exec WORDS``, or None where it
    refuses them (it exits, as it does for help)."""
    parser = build_parser("exec")
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return vars(parser.parse_args(["exec", *words]))
        except SystemExit:
            return None


@settings(max_examples=600, deadline=None)
@given(command_lines())
def test_what_quick_args_reads_argparse_reads_the_same(words):
    quick = bind.quick_args(words)
    if quick is None:
        return
    assert vars(quick) == argparse_reading(words), words


@pytest.mark.parametrize(
    "words",
    [
        ["--node", "0", "--", "true"],
        ["--node=3", "--", "python", "-c", "pass"],
        ["--local-rank", "--cpus", "exclusive", "--", "python", "serve.py"],
        ["--device", "1", "--memory", "bind", "--no-pools", "--", "x"],
        ["--gpu", "0000:17:00.0", "--cpus=0-3,8", "--", "x"],
        ["--node", "0", "--wake-latency", "0", "--", "x"],
        ["--", "x"],
    ],
)
def test_the_usual_lines_are_read_quickly_and_alike(words):
    """The test above proves nothing if quick_args gave up on everything."""
    quick = bind.quick_args(words)
    assert quick is not None
    assert vars(quick) == argparse_reading(words)


@pytest.mark.parametrize(
    "words",
    [
        ["--node", "0", "true"],  # no --: argparse's REMAINDER rules
        ["--node", "0", "--node", "1", "--", "x"],
        ["--node", "0", "--device", "1", "--", "x"],
        ["--nod", "0", "--", "x"],
        ["--node", "-1", "--", "x"],
        ["--node", "x", "--", "x"],
        ["--memory", "Bind", "--", "x"],
        ["--cpus", "0-", "--", "x"],
        ["--dry-run", "--node", "0", "--", "x"],
        ["--help"],
        ["--node"],
        ["--node", "0"],
    ],
)
def test_anything_else_is_left_to_argparse(words):
    assert bind.quick_args(words) is None


#: Modules exec's usual start does without (each 0.5-10 ms at a start:
#: docs/architecture.md, "What a start costs").
HEAVY = (
    "argparse", "dataclasses", "enum", "functools", "inspect", "json", "logging", "re",
    "resource", "signal", "threading", "typing", "warnings",
)  # fmt: skip


def test_exec_reads_its_usual_line_without_argparse(tmp_path):
    """The point of it: the usual exec imports none of the heavy modules
    beyond what Python's own start imported (a dry run, which is
    argparse's, does import argparse)."""
    import subprocess

    probe = (
        "import os, sys\n"
        "before = set(sys.modules)\n"
        "from cpupin.cli import main\n"
        "def stop(*a):\n"
        f"    print(sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before))\n"
        "    sys.stdout.flush(); os._exit(0)\n"
        "os.execve = stop\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for words, expected in (
        (["exec", "--node", "0", "--", "true"], []),
        (["exec", "--nod", "0", "--", "true"], ["argparse"]),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe, *words], capture_output=True, text=True, cwd=tmp_path
        )
        got = ast.literal_eval(out.stdout.strip() or "None")
        if expected:
            assert got is not None and set(expected) <= set(got), (words, out.stdout, out.stderr)
        else:
            assert got == expected, (words, out.stdout, out.stderr)


def test_a_refused_value_gets_argparses_message():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(["exec", "--node", "x", "--", "true"])
    assert exit_.value.code == 2
    assert "--node runs from 0 to 65535" in err.getvalue()


EXECVPE = """
import os, sys
from cpupin.cli import bind
how, path, command = sys.argv[1:4]
env = dict(os.environ)
if path == "-":
    env.pop("PATH", None)
else:
    env["PATH"] = path
argv = [command, "-c", "print('ran', __import__('sys').argv[0])"]
try:
    if how == "os":
        os.execvpe(command, argv, env)
    else:
        bind._execvpe(argv, env)
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def test_exec_searches_path_as_os_execvpe_does(tmp_path):
    """exec's own PATH search (os.get_exec_path would import warnings at
    every start) against os.execvpe itself, on the same folders."""
    py = tmp_path / "runs"
    py.mkdir()
    (py / "py").symlink_to(sys.executable)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "py").write_text("#!/bin/sh\n")  # there, but not executable
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (f"{py}", "py"),
        (f"{locked}:{py}", "py"),  # a refusal, then one that runs: it runs
        (f"{locked}", "py"),  # only the refusal: EACCES
        (f"{tmp_path}/none:{a_file}:{py}", "py"),  # missing and not a folder, skipped
        (f"{tmp_path}/none", "py"),
        ("", "py"),
        ("-", "py"),
        (f"{py}", f"{py}/py"),
        (f"{py}", f"{locked}/py"),
        (f"{py}", "./py"),
        (f"::{py}", "py"),
    ]
    for path, command in cases:
        got = [
            subprocess.run(
                [sys.executable, "-c", EXECVPE, how, path, command],
                capture_output=True,
                text=True,
                cwd=py,
            ).stdout
            for how in ("os", "ours")
        ]
        assert got[0] == got[1], (path, command, got)
        assert got[0], (path, command)
