"""The map of the parts in docs/architecture.md is true of the code: each
part imports exactly the parts its row names, and only parts above it."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cpupin"
MAP = ROOT / "docs" / "architecture.md"
FACES = {"__init__.py", "__main__.py", "hosts.py", "metrics.py"}


def read_map(text):
    """The table's rows, in order: (part, the parts it may import)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[A-Za-z_]+(/|\.py)`", cells[0]):
            rows.append((cells[0].strip("`"), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def part_of(path):
    """The part a file of the package belongs to: its folder, or the file
    itself at the package's top."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] + "/" if len(rel.parts) > 1 else rel.name


def module_file(dotted):
    """The file of a module ``cpupin.x.y``, or ``None`` for a name."""
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported_files(path):
    """Every module of the package that ``path`` imports, at its top or
    inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import"
            if not (node.module or "").startswith("cpupin"):
                continue
            for alias in node.names:
                target = module_file(f"{node.module}.{alias.name}") or module_file(node.module)
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(module_file(a.name) for a in node.names if a.name.startswith("cpupin"))
    return found - {None}


def actual_imports():
    """Each part to the parts its modules import."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        part = part_of(path)
        if part in FACES:
            continue
        deps = out.setdefault(part, set())
        for target in imported_files(path):
            if target.name == "_cpupin.py":
                continue
            other = part_of(target)
            if other != part:
                deps.add(other)
    return out


def test_the_map_reads_as_a_table_of_every_part():
    rows = read_map(MAP.read_text())
    listed = [part for part, _ in rows]
    on_disk = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    on_disk |= {p.name for p in PACKAGE.glob("*.py")} - FACES
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == on_disk


def test_each_row_names_only_parts_above_it():
    rows = read_map(MAP.read_text())
    order = {part: i for i, (part, _) in enumerate(rows)}
    for part, allowed in rows:
        for dep in allowed:
            if dep in FACES:
                continue
            assert dep in order, f"{part} names {dep}, which is not a part"
            assert order[dep] < order[part], f"{part} names {dep}, a part below it"


def test_each_part_imports_exactly_what_its_row_names():
    rows = dict(read_map(MAP.read_text()))
    for part, deps in actual_imports().items():
        assert deps == set(rows[part]), (part, sorted(deps), sorted(rows[part]))


def test_a_parts_init_holds_its_docstring_alone():
    for init in PACKAGE.glob("*/**/__init__.py"):
        if init.parent.name == "cli":
            continue  # the command's parser and main(): a front end's face
        tree = ast.parse(init.read_text())
        body = tree.body
        assert body and isinstance(body[0], ast.Expr), f"{init} has no docstring"
        assert len(body) == 1 or init.parent.parent.name == "integrations", init


@pytest.mark.parametrize(
    "text, problem",
    [
        ("| `host/` | x | `plan/` |\n| `plan/` | y | `host/` |", "below"),
        ("| `host/` | x | `nowhere/` |", "not a part"),
    ],
)
def test_the_check_fails_on_a_map_that_lies(text, problem):
    """The row check itself catches a part that names one below it and one
    that does not exist."""
    rows = read_map(text)
    order = {part: i for i, (part, _) in enumerate(rows)}
    errors = []
    for part, allowed in rows:
        for dep in allowed:
            if dep not in order:
                errors.append("not a part")
            elif order[dep] >= order[part]:
                errors.append("below")
    assert problem in errors


def test_the_tests_mirror_the_parts_and_share_only_through_support():
    """Each folder of tests/ is a part of the package (or support/, trust/,
    data/), and no test module imports another test module."""
    tests = ROOT / "tests"
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    for folder in tests.iterdir():
        if folder.is_dir() and folder.name not in ("__pycache__", ".hypothesis"):
            assert folder.name in parts | {"support", "trust", "data"}, folder
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
                assert node.module.startswith("tests.support"), f"{path}: {node.module}"


def test_every_file_and_module_the_map_names_exists():
    """The map's files (`act/wake.py`) and the modules its rows name in
    parentheses (`_sysfs`) are in the package, so the map cannot point at a
    file that moved."""
    text = MAP.read_text()
    for path in re.findall(r"`([a-z_]+/[a-z_/]*[a-z_]+\.py)`", text):
        where = ROOT / path if path.startswith(("tests/", "bench/")) else PACKAGE / path
        assert where.is_file(), path
    for part, _ in read_map(text):
        if not part.endswith("/"):
            continue
        row = next(line for line in text.splitlines() if line.startswith(f"| `{part}`"))
        for module in re.findall(r"\(`([a-z_]+)`", row):
            assert (PACKAGE / part / f"{module}.py").is_file() or (
                PACKAGE / part / module
            ).is_dir(), f"{part}{module}"
