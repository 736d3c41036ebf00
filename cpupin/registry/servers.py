"""The vLLM servers among the host's records: a server an API server, with
its engine cores and workers, and the orphans a killed API server leaves.
Pure: what ``cpupin ps`` groups by."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["VLLM_ROLES", "server_groups", "server_port"]

#: The roles the vLLM plugin records, in a server's order.
VLLM_ROLES = ("vllm-api-server", "vllm-engine-core", "vllm-worker")


def server_groups(processes: Iterable[Mapping[str, object]]) -> list[dict[str, object]]:
    """The vLLM servers among the host's process records (each a mapping
    with ``pid``, ``role``, ``server_pid`` and ``live``): a server an API
    server, with its engine cores and workers, in that order. A member whose
    API server is gone (its record dead or missing) is an orphan: vLLM's
    shutdown never reached it, and it still holds its CPUs and memory."""
    live = [p for p in processes if p.get("live") and p.get("role") in VLLM_ROLES]
    apis = {p["pid"] for p in live if p.get("role") == "vllm-api-server"}
    groups: dict[object, dict[str, object]] = {}
    order = {role: n for n, role in enumerate(VLLM_ROLES)}
    for p in sorted(live, key=lambda p: (order[str(p["role"])], p["pid"])):
        key = p["pid"] if p.get("role") == "vllm-api-server" else p.get("server_pid")
        group = groups.setdefault(
            key,
            {"api_pid": key, "api_live": key in apis, "members": [], "orphans": []},
        )
        members = group["members"]
        assert isinstance(members, list)
        members.append(p["pid"])
        if key not in apis:
            orphans = group["orphans"]
            assert isinstance(orphans, list)
            orphans.append(p["pid"])
    return list(groups.values())


def server_port(argv: list[str]) -> int | None:
    """The port a vLLM server's command line gives (``--port N`` or
    ``--port=N``); ``None`` when it gives none (vLLM's default, 8000)."""
    for i, word in enumerate(argv):
        text = word[len("--port=") :] if word.startswith("--port=") else None
        if word == "--port" and i + 1 < len(argv):
            text = argv[i + 1]
        if text is not None:
            return int(text) if text.isascii() and text.isdigit() and len(text) <= 5 else None
    return None
