"""A real vLLM server (the CPU build) with and without cpupin, in one run.

Starts ``vllm serve`` (through its Python module) on 127.0.0.1 with a tiny
Llama made here (``examples/vllm/tiny_llama.py``: random weights, a
tokenizer trained locally, nothing downloaded), sends ``--requests``
completions of ``--max-tokens`` tokens at ``--concurrency``, and stops it.
The cases, interleaved round by round so that a slow stretch of the machine
hits all of them alike:

- ``alone``: vLLM with cpupin's plugin not loaded (``VLLM_PLUGINS=''``);
- ``observe``: the plugin's default (records, a StepClock on every step);
- ``auto``: ``CPUPIN_VLLM=auto`` (threads and processes kept off the
  OpenMP CPUs, pools through vLLM's own variables);
- ``auto-held``: ``auto`` with ``CPUPIN_WAKE_LATENCY_US=0``: the API server
  holds the server's CPUs' wake latency (root, a host with cpuidle);
- ``exec``: started through ``cpupin exec --node 0`` (plugin not loaded),
  ``exec-no-pools``, the same with ``--no-pools``, and ``exec-before``: what
  ``exec`` passed before it set only the variables that narrow (every pool
  variable at the usable CPUs, here the whole mask), run unconstrained only.

``--quota N`` runs every case a second time inside a cgroup with a quota of
N CPUs, which it makes for the run and removes (root; cgroup v1's cpu
controller or v2's). Without it no cgroup is made. ``--busy N`` runs every
setting a second time beside N busy processes (Python loops, unpinned, at
the server's own priority, started before the setting's first server and
stopped after its last): a host where other work runs. ``widened`` is 1
where the worker's record says ``auto`` widened its confinement, ``moved``
the threads its record says ``auto`` moved. A case whose premise fails
(no ``VLLM::Worker`` process found; the plugin not loaded in ``observe``
or ``auto``, loaded in another)
stops the run with exit 1 and the end of that server's log: CI runs
``alone`` against ``auto`` with it.

Prints the environment, then per case and setting the median over the
rounds (and the spread, min-max) of tokens/s, request latency p50/p99, the
worker's step thread's run-queue wait (ms per second of load, from its
schedstat) and, where the plugin times steps, the step wait p99.

    python bench/vllm.py --python /path/to/vllm-venv/bin/python [--rounds 3] [--quota 1]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _env import describe, enter_cgroup, quota_cgroup  # noqa: E402

CASES = ("alone", "observe", "auto", "auto-held", "exec", "exec-no-pools", "exec-before")


def server_env(case: str, lock_dir: str) -> dict[str, str]:
    """The environment of a case's server (the variables vLLM-CPU needs
    here: an offline hub, a 1 GiB KV cache, the loopback address)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOGGING_LEVEL="WARNING",
        CPUPIN_LOCK_DIR=lock_dir,
        PYTHONUNBUFFERED="1",
    )
    env.pop("CPUPIN_VLLM", None)
    if case in ("alone", "exec", "exec-no-pools", "exec-before"):
        env["VLLM_PLUGINS"] = ""
    if case == "exec-before":
        # cpupin exec's pool variables before they were set only where they narrow
        sys.path.insert(0, str(ROOT))
        from cpupin.pools.limits import POOL_VARS

        usable = str(len(os.sched_getaffinity(0)))
        env.update({name: usable for name in POOL_VARS if name != "RAYON_NUM_THREADS"})
        env["RAYON_NUM_THREADS"] = str(max(1, int(usable) // 2))
        env["CPUPIN_POOL_VARS"] = ",".join(sorted(POOL_VARS))
    elif case in ("auto", "auto-held"):
        env["CPUPIN_VLLM"] = "auto"
    env.pop("CPUPIN_WAKE_LATENCY_US", None)
    if case == "auto-held":
        env["CPUPIN_WAKE_LATENCY_US"] = "0"
    return env


def server_argv(python: str, model: str, port: int, case: str) -> list[str]:
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--dtype",
        "float32",
        "--disable-log-stats",
    ]
    if case.startswith("exec"):
        cpupin = str(Path(python).with_name("cpupin"))
        extra = ["--no-pools"] if case == "exec-no-pools" else []
        argv = [cpupin, "exec", "--node", "0", *extra, "--", *argv]
    return argv


def request(port: int, body: dict[str, object], timeout: float = 120) -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
        out: dict[str, object] = json.loads(data)
        return out
    finally:
        conn.close()


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def load(port: int, model: str, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    """Send the requests; tokens/s and latency percentiles (ms)."""
    prompts = [f"the cpu core {i} thread pin step" for i in range(requests)]

    def one(prompt: str) -> tuple[float, int]:
        start = time.perf_counter()
        out = request(
            port,
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        usage = out["usage"]
        assert isinstance(usage, dict)
        return time.perf_counter() - start, int(usage["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    return {
        "tokens_per_s": sum(r[1] for r in results) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "seconds": elapsed,
    }


def descendants(pid: int) -> list[int]:
    out = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def worker_of(pid: int) -> int | None:
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read().startswith(b"VLLM::Worker"):
                    return child
        except OSError:
            continue
    return None


def wait_ns(pid: int) -> int:
    """The run-queue wait of a process's main thread so far (its schedstat)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def worker_record(python: str, lock_dir: str) -> dict[str, object]:
    """The worker's record as ``cpupin ps --json`` shows it (empty when none)."""
    cpupin = str(Path(python).with_name("cpupin"))
    out = subprocess.run(
        [cpupin, "ps", "--json", "--interval", "0.05", "--lock-dir", lock_dir],
        capture_output=True,
        text=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": lock_dir},
    )
    try:
        listed = json.loads(out.stdout)
    except ValueError:
        return {}
    for proc in listed.get("processes", []):
        if proc.get("role") == "vllm-worker" and proc.get("live"):
            found: dict[str, object] = proc
            return found
    return {}


def step_wait_p99(record: dict[str, object]) -> float | None:
    """The step wait p99 (µs) a worker's record carries."""
    for steps in record.get("steps", []) or []:  # type: ignore[attr-defined]
        if steps.get("wait_p99_us") is not None:
            return float(steps["wait_p99_us"])
    return None


def port_free(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.connect()
    except OSError:
        return True
    finally:
        conn.close()
    return False


def run_case(
    args: argparse.Namespace, case: str, cgroup: str | None, port: int
) -> dict[str, float]:
    if not port_free(port):
        raise SystemExit(f"port {port} is taken (a server left running?): stop it, or --port")
    lock_dir = tempfile.mkdtemp(prefix="cpupin-bench-vllm-")
    env = server_env(case, lock_dir)
    log = open(Path(lock_dir, "server.log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        server_argv(args.python, args.model, port, case),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=enter_cgroup(cgroup) if cgroup else None,
        start_new_session=True,
    )
    try:
        wait_ready(port, proc)
        load(port, args.model, args.concurrency, args.concurrency, 8)  # warm up
        worker = worker_of(proc.pid)
        if worker is None:
            # Every case has one: without it no premise below is checked.
            raise RuntimeError(f"case {case}: no VLLM::Worker process under the server")
        before = wait_ns(worker)
        result = load(port, args.model, args.requests, args.concurrency, args.max_tokens)
        result["worker_wait_ms_per_s"] = (wait_ns(worker) - before) / 1e6 / result["seconds"]
        record = worker_record(args.python, lock_dir)
        plugin = case in ("observe", "auto", "auto-held")
        if plugin != bool(record):
            # The case's premise does not hold: its figures would mislead.
            why = (
                "published no record: cpupin's plugin did not load"
                if plugin
                else "published a record: cpupin's plugin loaded"
            )
            raise RuntimeError(f"case {case}: the worker {why}")
        p99 = step_wait_p99(record)
        if p99 is not None:
            result["step_wait_p99_us"] = p99
        if case.startswith("auto"):
            notes = record.get("notes", []) or []
            said = any(str(n).startswith("confinement widened") for n in notes)  # type: ignore[attr-defined]
            result["widened"] = float(said)
            acts = record.get("auto") or {}
            result["moved"] = float(acts.get("moved", 0))  # type: ignore[attr-defined]
        return result
    except BaseException:
        log.flush()
        tail = Path(lock_dir, "server.log").read_bytes()[-3000:].decode(errors="replace")
        print(f"--- the end of the {case} server's log:\n{tail}", file=sys.stderr)
        raise
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        subprocess.run(["rm", "-rf", lock_dir], check=False)


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
    """``count`` busy processes for the block: other work on the host."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the vLLM venv's python")
    parser.add_argument("--model", default="", help="a model directory (default: made here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--quota", type=float, default=None, help="also in a quota of N CPUs")
    parser.add_argument("--quota-only", action="store_true", help="skip the unconstrained run")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument(
        "--busy", type=int, default=0, help="also beside N busy processes (0: quiet only)"
    )
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"no case {sorted(unknown)}: choose from {', '.join(CASES)}")
    print(describe())
    print(f"vllm        {args.python}")
    print()
    made = None
    if not args.model:
        made = tempfile.mkdtemp(prefix="cpupin-tiny-llama-")
        subprocess.run(
            [args.python, str(ROOT / "examples/vllm/tiny_llama.py"), made],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        args.model = made
    if args.quota_only and not args.quota:
        parser.error("--quota-only needs --quota N")
    if args.busy < 0:
        parser.error(f"--busy {args.busy}: a number of processes, 0 or more")
    quotas: list[float | None] = [] if args.quota_only else [None]
    quotas += [args.quota] if args.quota else []
    settings = [(q, b) for q in quotas for b in ([0, args.busy] if args.busy else [0])]
    try:
        for quota, busy in settings:
            name = "unconstrained" if quota is None else f"quota of {quota:g} CPU(s)"
            name += f", {busy} busy" if busy else ", quiet"
            samples: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
            # A cgroup is made only for a quota asked for (--quota).
            group = quota_cgroup(quota) if quota is not None else contextlib.nullcontext(None)
            with group as cg, busy_neighbours(busy):
                if quota is not None and cg is None:
                    print(f"{name}: skipped (needs root and a cgroup cpu controller)")
                    continue
                for r in range(args.rounds):
                    for case in cases:
                        if case == "exec-before" and quota is not None:
                            continue
                        result = run_case(args, case, cg[0] if quota and cg else None, args.port)
                        samples[case].append(result)
                        print(
                            f"  round {r + 1} {name:20} {case:14} "
                            + json.dumps({k: round(v, 1) for k, v in result.items()}),
                            flush=True,
                        )
            print(f"\n{name}: median (min-max) over {args.rounds} rounds")
            print(
                f"  {'case':14} {'tokens/s':>22} {'p50 ms':>22} {'p99 ms':>22} "
                f"{'worker wait ms/s':>22} {'step wait p99 µs':>22} {'widened':>8} {'moved':>6}"
            )
            for case in cases:
                rows = samples[case]
                if not rows:
                    continue

                def col(key: str, rows: list[dict[str, float]] = rows) -> str:
                    values = [row[key] for row in rows if key in row]
                    return f"{spread(values):>22}" if values else f"{'-':>22}"

                widened = [row["widened"] for row in rows if "widened" in row]
                moved = [row["moved"] for row in rows if "moved" in row]
                print(
                    f"  {case:14} {col('tokens_per_s')} {col('p50_ms')} {col('p99_ms')} "
                    f"{col('worker_wait_ms_per_s')} {col('step_wait_p99_us')} "
                    f"{(f'{sum(widened):.0f}/{len(widened)}' if widened else '-'):>8} "
                    f"{(f'{statistics.median(moved):.0f}' if moved else '-'):>6}"
                )
            base = (
                statistics.median(s["tokens_per_s"] for s in samples.get("alone", []))
                if (samples.get("alone"))
                else None
            )
            if base:
                for case in (c for c in cases if samples[c]):
                    tps = statistics.median(s["tokens_per_s"] for s in samples[case])
                    p99 = statistics.median(s["p99_ms"] for s in samples[case])
                    base_p99 = statistics.median(s["p99_ms"] for s in samples["alone"])
                    print(
                        f"  {case:14} {tps / base:.3f}x alone's tokens/s, "
                        f"{p99 / base_p99:.3f}x its request p99"
                    )
            print()
    finally:
        if made:
            subprocess.run(["rm", "-rf", made], check=False)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except RuntimeError as exc:  # a server that failed, or a case whose premise did not hold
        raise SystemExit(f"bench/vllm.py: {exc}") from None
