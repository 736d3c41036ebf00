"""The README's promises, and those of the pages it sends readers to in
docs/: each Python block runs as written, on its own, as a reader copies it
(nothing it uses comes from an earlier block), and every console sample is
what its command prints now (numbers aside: they are measured)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README} | {
    f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))
}
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PROGRAMS = {name: BLOCK.findall(text) for name, text in PAGES.items() if BLOCK.search(text)}
PYTHON_BLOCKS = BLOCK.findall(README)
SAMPLES = [
    sample
    for text in PAGES.values()
    for sample in re.findall(
        r"^```text\n\$ (cpupin [^\n]*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL
    )
]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def test_the_readme_opens_with_the_two_commands():
    first = re.search(r"^```sh\n(.*?)^```", README, re.MULTILINE | re.DOTALL).group(1)
    lines = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert lines == ["pip install . && cpupin doctor", "pip install -e '.[test]' && pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-e '.[test]'" in ci and "\npytest" in ci


def test_the_readme_starts_with_what_pays_on_every_host():
    """Pools, the step's delay and the host's view come before pinning, and
    the README stays short: reference material lives in docs/."""
    sections = re.findall(r"^## (.*)$", README, re.MULTILINE)
    assert [s.split(" ", 1)[0] for s in sections[:3]] == ["1.", "2.", "3."], sections
    assert "Pools" in sections[0] and "step" in sections[1] and "host" in sections[2]
    pinning = next(i for i, s in enumerate(sections) if s.startswith("Pinning"))
    assert pinning > 2
    assert len(README.splitlines()) < 450


def test_every_page_the_readme_names_exists_and_every_page_is_named():
    named = set(re.findall(r"\((docs/[\w.-]+\.md)\)", README))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert named == pages, named ^ pages
    for text in PAGES.values():
        for target in re.findall(r"\]\(((?!https?:)[^)#]+)\)", text):
            where = ROOT / target if not target.startswith("../") else None
            assert where is None or where.exists() or (ROOT / "docs" / target).exists(), target


#: Each block, named by its page and the line it opens on.
BLOCKS = {
    f"{name}:{text[: m.start()].count(chr(10)) + 1}": m.group(1)
    for name, text in PAGES.items()
    for m in BLOCK.finditer(text)
}


def run_block(block, tmp_path):
    """``block`` run alone as a program, as a reader who copied it would."""
    program = tmp_path / "block.py"
    program.write_text(block)
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    env.pop("CPUPIN_STEP_THREAD_CORE", None)
    return subprocess.run(
        [sys.executable, str(program)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


@pytest.mark.parametrize("where", sorted(BLOCKS))
def test_every_python_block_runs_alone_as_written(where, tmp_path):
    block = BLOCKS[where]
    out = run_block(block, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    if "def serve(" not in block:
        return
    # The tour's server pinned its worker and its result thread on this host,
    # unless the mask has one CPU: then it says nothing was pinned, and why.
    if len(os.sched_getaffinity(0)) > 1:
        assert re.search(r"workers on \d+(-\d+|,\d+)?, results on \d+", out.stdout), out.stdout
    else:
        assert "nothing pinned: " in out.stdout, out.stdout


def test_a_block_that_leans_on_an_earlier_one_fails_alone(tmp_path):
    """The check can fail: a block that uses a name an earlier block
    imported (the README's fault before each block had its own import)."""
    out = run_block("limits = cpupin.limit_pools()\n", tmp_path)
    assert out.returncode != 0 and "NameError" in out.stderr


def test_the_readme_and_the_tour_have_programs():
    assert len(PYTHON_BLOCKS) >= 4 and len(PROGRAMS["docs/pinning.md"]) >= 2


def masked(text):
    return [NUMBER.sub("#", line.rstrip()) for line in text.strip("\n").splitlines()]


#: The labels of ``cpupin doctor``'s lines on this machine: what they say
#: varies by host (idle states, a VM or not, how many kinds of CPU pair the
#: mask allows, which notes apply), their order and form do not.
DOCTOR_LINE = re.compile(
    r"^(cpupin doctor: this machine|host     \S.*|idle     \S.*|mask     \S.*|memory   \S.*|"
    r"cpus     \S.*|warning  \S.*|irqs     \S.*|  IRQ +\d+ \S.*|"
    r"pools    \d+ usable CPU\(s\); \S.*|         \S.*|"
    r"handoff  one way, median \(p99\) of the quietest run, and the spread of the medians "
    r"across runs, measured on this machine \(load [\d.]+, \d+ task\(s\) running on \d+ "
    r"CPU\(s\)\):|"
    r"  [a-zA-Z ]+ (busy|idle|held) +CPUs [\d,]+: +[\d.]+ µs \([\d.]+ µs\); "
    r"runs [\d.]+ to [\d.]+ µs|note     \S.*|"
    r"hold     \S.*|verdict  (auto|off|hold|unknown): .*|why      \S.*)$"
)


def doctor_shape(text):
    """A doctor's report reduced to what holds on every host: each line's
    label, with the repeated handoff and note lines counted once."""
    lines = text.strip("\n").splitlines()
    for line in lines:
        assert DOCTOR_LINE.match(line), line
    lines = [line for line in lines if not line.startswith(" " * 9)]  # a line's continuation
    # Which IRQs land on pinned CPUs, and whether a GPU warning applies, vary.
    lines = [line for line in lines if not line.startswith(("  IRQ", "warning  "))]
    labels = [line[:9] if not line.startswith("  ") else "  pair" for line in lines]
    labels = [label for label in labels if label != "note     "]  # which apply varies
    return [label for i, label in enumerate(labels) if i == 0 or label != labels[i - 1]]


@pytest.mark.parametrize("command, sample", SAMPLES, ids=[c for c, _ in SAMPLES])
def test_every_console_sample_is_what_the_command_prints(command, sample):
    """A sample of this machine (the doctor's) is compared by the form of
    each line, since its content depends on the host that runs the test; a
    sample of a shipped host, with its numbers masked, exactly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUPIN_")}
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", *shlex.split(command)[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=ROOT,  # a --root names a tree of the repository's
    )
    assert out.returncode == 0, out.stderr
    if "--host" not in command and "--root" not in command:
        assert doctor_shape(out.stdout) == doctor_shape(sample), out.stdout
        return
    assert masked(out.stdout) == masked(sample)


def test_the_samples_cover_the_doctor_and_a_plan():
    assert {c.split()[1] for c, _ in SAMPLES} >= {"doctor", "plan"}
