"""The --json shapes docs/json.md documents, and the comparison of a real output with one."""

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "json.md"


SECTION = re.compile(r"^### `(cpupin [^`]+)`\n(.*?)```json\n(.*?)```", re.MULTILINE | re.DOTALL)


SECTIONS = {command: json.loads(body) for command, _, body in SECTION.findall(DOC.read_text())}


def same_shape(documented, real, where="$"):
    """Keys equal at every level (a map of node ids: any ids); types equal
    (ints and floats alike); a documented null allows anything; a list's
    first items compared."""
    if documented is None:
        return
    if isinstance(documented, dict):
        assert isinstance(real, dict), where
        if documented and all(k.isdigit() for k in documented):  # node id -> CPUs
            first = next(iter(documented.values()))
            for key, value in real.items():
                assert key.isdigit(), (where, key)
                same_shape(first, value, f"{where}.{key}")
        elif documented or not real:  # {} documents a map whose keys vary (handoff_ns)
            assert set(real) == set(documented), (where, set(real) ^ set(documented))
            for key, value in documented.items():
                same_shape(value, real[key], f"{where}.{key}")
        return
    if isinstance(documented, list):
        assert isinstance(real, list), where
        # A pinned thread that has exited carries nulls, as documented: the
        # shape is taken from the first one alive (another test's process
        # may hold a record whose thread just ended).
        alive = [r for r in real if not (isinstance(r, dict) and r.get("alive") is False)]
        if documented and alive:
            same_shape(documented[0], alive[0], f"{where}[0]")
        return
    numbers = (int, float)
    if isinstance(documented, bool):
        assert isinstance(real, bool), where
    elif isinstance(documented, numbers):
        assert isinstance(real, numbers) and not isinstance(real, bool), where
    else:
        assert isinstance(real, type(documented)), (where, real)
