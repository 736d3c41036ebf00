"""Whether pinning pays on this host: the host's idle states, the measured
cost of a handoff to a running core and to an idle one, and a verdict.

The verdict rests on the measured handoff to an idle core: pinning a
server's step threads to one core's hardware threads turns every handoff
into one to a running core, so it pays when a handoff to an idle core costs
much more (a deep C-state: 130-175 µs against 4-5 µs on the reference host)
and costs throughput when it does not (a VM without deep idle states: 22 µs
against 11 µs). The idle states explain the number; a VM's guest sees only
what its hypervisor shows, so there the measurement, not sysfs, decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cpupin.host.topology import Host, IdleState
from cpupin.measure.handoff import HandoffResult, handoff, pair_kinds

__all__ = [
    "IDLE_PENALTY_NS",
    "IDLE_STATE_US",
    "Diagnosis",
    "diagnose",
    "measure_hold",
    "load_text",
    "measure_host",
    "read_load",
]

#: Pinning pays when a handoff to an idle core costs this much more than one
#: to the same core while it runs: the cost of leaving a deep idle state.
#: Measured hosts sit far either side of it: a 2-socket B300 host with C6 at
#: 170 µs waits 130-175 µs for an idle core against 4-5 µs for a running one
#: (pinning paid), and an H100 cloud VM with no idle state deeper than 1 µs
#: wakes an idle vCPU within about 15 µs of a running one (pinning cost
#: throughput); 50 µs lies well between the two.
IDLE_PENALTY_NS = 50_000

#: Without a measurement (a shipped host), an enabled idle state this deep
#: or deeper predicts that pinning pays: a C6-class state.
IDLE_STATE_US = 100

#: How long the sender waits before each handoff in the idle measurement:
#: long enough for the receiver's core to enter any state up to this depth.
IDLE_WAIT_US = 200


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer."""

    verdict: str
    """``"auto"`` (turn pinning on), ``"hold"`` (keep pinning off, hold the
    step CPUs' wake latency instead), ``"off"`` (neither) or ``"unknown"``
    (the host was too busy to judge: the spread across the measurement's
    runs could turn the verdict either way)."""
    why: str
    deepest_idle_state: IdleState | None
    handoff: dict[str, HandoffResult] = field(default_factory=dict)
    """Pair kind (``same CPU busy``, ``other core idle`` ...) to its result."""
    measured_on: str = "this machine"
    notes: tuple[str, ...] = ()
    hold: str = ""
    """What holding the wake latency does to the idle handoff (the ``held``
    measurement), or why it was not measured; empty for a shipped host."""
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Each measured kind's lowest and highest median (its wake median for
    an idle handoff) across its runs, in ns."""
    load: dict[str, float] | None = None
    """The host's load while it measured (:func:`read_load`); ``None`` for
    a shipped host."""

    def as_dict(self) -> dict[str, object]:
        deepest = self.deepest_idle_state
        return {
            "verdict": self.verdict,
            "why": self.why,
            "deepest_idle_state": (
                {"name": deepest.name, "latency_us": deepest.latency_us} if deepest else None
            ),
            "handoff_ns": {
                kind: {
                    "cpus": list(r.cpus),
                    "median_ns": r.median_ns,
                    "p99_ns": r.p99_ns,
                    "wake_median_ns": r.wake_median_ns,
                    "idle_us": r.idle_us,
                    "rounds": r.rounds,
                }
                for kind, r in self.handoff.items()
            },
            "measured_on": self.measured_on,
            "notes": list(self.notes),
            "hold": self.hold or None,
            "spread_ns": {k: [round(lo), round(hi)] for k, (lo, hi) in self.spread.items()},
            "load": self.load,
        }


#: Times each handoff is measured; the doctor keeps the quietest (the one
#: with the lowest median: noise only ever adds) and says when they disagree.
REPEATS = 3
#: Repeats whose medians differ by more than this factor are noisy.
NOISY = 2.0


def measure_host(
    host: Host,
    mask: frozenset[int],
    rounds: int = 2000,
    idle_rounds: int = 300,
    *,
    repeats: int = REPEATS,
    noise: list[str] | None = None,
    spread: dict[str, tuple[float, float]] | None = None,
) -> dict[str, HandoffResult]:
    """Handoffs to a running core (back to back) and to an idle one (after
    :data:`IDLE_WAIT_US`), for each kind of pair the mask allows, each
    measured ``repeats`` times, interleaved; the quietest of each is kept.
    Where its repeats disagree by more than :data:`NOISY` times, a line
    goes to ``noise`` (the first measurement right after an install, or on a
    busy host, can be ten times the next); ``spread`` receives each kind's
    lowest and highest median across its runs."""
    runs: dict[str, list[HandoffResult]] = {}
    kinds = [(k, c) for k, c in pair_kinds(host, mask).items() if k != "unpinned"]
    for _ in range(max(1, repeats)):
        for kind, cpus in kinds:
            runs.setdefault(f"{kind} busy", []).append(
                handoff(cpus, rounds=rounds, warmup=rounds // 10)
            )
            runs.setdefault(f"{kind} idle", []).append(
                handoff(cpus, rounds=idle_rounds, warmup=idle_rounds // 10, idle_us=IDLE_WAIT_US)
            )
    out = {}
    for name, results in runs.items():
        out[name] = min(results, key=lambda r: _idle_cost(r))
        costs = sorted(_idle_cost(r) for r in results)
        if spread is not None:
            spread[name] = (costs[0], costs[-1])
        if noise is not None and costs[0] > 0 and costs[-1] > NOISY * costs[0]:
            noise.append(
                f"{name}: medians of {_us(costs[0])} to {_us(costs[-1])} over {len(costs)} "
                "runs, the lowest kept; the host was busy or still warming up: run the doctor "
                "again for a steadier figure"
            )
    return out


#: The hold pays when it removes at least this share of what waking an idle
#: core costs over a handoff on the same CPU, and at least
#: :data:`HOLD_SAVING_NS`: a wake that costs little is not worth idle CPUs
#: that poll.
HOLD_SHARE = 0.5
HOLD_SAVING_NS = 10_000


def measure_hold(
    handoffs: dict[str, HandoffResult],
    idle_rounds: int = 300,
    *,
    repeats: int = REPEATS,
    spread: dict[str, tuple[float, float]] | None = None,
) -> str:
    """Measure the idle handoff again while every CPU's wake latency is held
    at 0 (``/dev/cpu_dma_latency``: the kernel drops it when the descriptor
    closes, however the doctor ends), and add it to ``handoffs`` as
    ``<kind> held``. Returns why it was not measured, or empty."""
    from cpupin.act.wake import HoldRefused, hold_wake_latency

    kind = _idle_kind(handoffs)
    if kind is None:
        return "not measured: no idle handoff to another core to compare"
    cpus = handoffs[kind].cpus
    try:
        hold = hold_wake_latency(None, 0, mechanism="dma")
    except HoldRefused as exc:
        return f"not measured: {exc.strerror}"
    try:
        runs = [
            handoff(cpus, rounds=idle_rounds, warmup=idle_rounds // 10, idle_us=IDLE_WAIT_US)
            for _ in range(max(1, repeats))
        ]
    finally:
        hold.release()
    handoffs[kind.replace(" idle", " held")] = min(runs, key=_idle_cost)
    if spread is not None:
        costs = sorted(_idle_cost(r) for r in runs)
        spread[kind.replace(" idle", " held")] = (costs[0], costs[-1])
    return ""


def read_load(root: str = "/") -> dict[str, float] | None:
    """The host's load now: the 1-minute load average and the tasks
    running (``/proc/loadavg``, ``procs_running`` of ``/proc/stat``), against
    its online CPUs; ``None`` where unreadable."""
    from cpupin.host._sysfs import Reader

    with Reader(root) as r:
        avg = r.text("proc/loadavg", 256)
        stat = r.text("proc/stat", 1 << 20, head=True)
        online = r.cpus("sys/devices/system/cpu/online")
    try:
        load1 = float((avg or "").split()[0])
    except (IndexError, ValueError):
        return None
    running = next(
        (
            int(line.split()[1])
            for line in (stat or "").splitlines()
            if line.startswith("procs_running ") and line.split()[1].isdigit()
        ),
        None,
    )
    return {
        "load1": min(load1, 1e6),
        "running": float(running) if running is not None else -1.0,
        "cpus": float(len(online)) if online else -1.0,
    }


def _idle_kind(handoffs: dict[str, HandoffResult]) -> str | None:
    return next(
        (
            k
            for k in (
                "other core idle",
                "same L3 idle",
                "other L3 idle",
                "SMT sibling idle",
                "other node idle",
            )
            if k in handoffs
        ),
        None,
    )


def _us(ns: float | None) -> str:
    return "?" if ns is None else f"{ns / 1000:.0f} µs" if ns >= 10_000 else f"{ns / 1000:.1f} µs"


def _idle_cost(result: HandoffResult) -> float:
    return result.wake_median_ns if result.wake_median_ns is not None else result.median_ns


def diagnose(
    host: Host,
    handoffs: dict[str, HandoffResult] | None,
    measured_on: str = "this machine",
    noise: list[str] | None = None,
    hold_unmeasured: str = "",
    spread: dict[str, tuple[float, float]] | None = None,
    load: dict[str, float] | None = None,
) -> Diagnosis:
    """The verdict for ``host``: from ``handoffs`` when given, else from its
    idle states alone; ``noise`` (from :func:`measure_host`) joins the notes.
    A ``<kind> held`` handoff (:func:`measure_hold`) judges the hold:
    where pinning does not pay but the hold removes most of an idle wake's
    cost, the verdict is ``hold``; ``hold_unmeasured`` says why it is
    missing. ``spread`` (each kind's lowest and highest median across its
    runs) tests the verdict: where the measurement's own spread could turn
    it, no verdict is given (``unknown``: rerun on a quiet host); ``load``
    is reported beside it. Pure."""
    diagnosis = _diagnose(host, handoffs, measured_on, noise)
    if not handoffs:
        return diagnosis
    diagnosis = _judge_hold(diagnosis, handoffs, hold_unmeasured)
    diagnosis = replace(diagnosis, spread=dict(spread or {}), load=load)
    return _within_noise(diagnosis, handoffs, spread or {}, load)


def load_text(load: dict[str, float] | None) -> str:
    if not load:
        return "load unknown"
    running = f", {load['running']:.0f} task(s) running" if load["running"] >= 0 else ""
    cpus = f" on {load['cpus']:.0f} CPU(s)" if load["cpus"] > 0 else ""
    return f"load {load['load1']:.2f}{running}{cpus}"


def _within_noise(
    d: Diagnosis,
    handoffs: dict[str, HandoffResult],
    spread: dict[str, tuple[float, float]],
    load: dict[str, float] | None,
) -> Diagnosis:
    """``d``, or no verdict where the runs' spread could turn it: the wake
    penalty at the runs' extremes falls on both sides of
    :data:`IDLE_PENALTY_NS`, or the hold pays at one extreme and not the
    other."""
    kind = _idle_kind(handoffs)
    busy_kind = kind.replace("idle", "busy") if kind else None
    if kind is None or kind not in spread or busy_kind not in spread:
        return d
    idle_lo, idle_hi = spread[kind]
    busy_lo, busy_hi = spread[busy_kind]
    turns = (idle_lo - busy_hi >= IDLE_PENALTY_NS) != (idle_hi - busy_lo >= IDLE_PENALTY_NS)
    what = (
        f"the wake's cost over a running core ranged {_us(idle_lo - busy_hi)} to "
        f"{_us(idle_hi - busy_lo)} across runs, either side of the {_us(IDLE_PENALTY_NS)} "
        "that decides"
    )
    held = kind.replace(" idle", " held")
    same = spread.get("same CPU busy")
    if not turns and held in spread and same is not None:
        held_lo, held_hi = spread[held]
        low = _pays(idle_lo, held_hi, same[1])
        high = _pays(idle_hi, held_lo, same[0])
        if low != high:
            turns = True
            what = (
                f"the hold saved {_us(max(idle_lo - held_hi, 0))} to {_us(idle_hi - held_lo)} "
                "across runs, either side of what decides"
            )
    if not turns:
        return d
    return replace(
        d,
        verdict="unknown",
        why=(
            f"host too busy to judge: rerun on a quiet host ({what}; {load_text(load)} while "
            f"it measured); the quietest runs alone said {d.verdict}: {d.why}"
        ),
    )


def _pays(idle: float, held: float, same: float) -> bool:
    """Whether holding the wake latency pays, as :func:`_judge_hold` rules."""
    wake = idle - same
    saved = idle - held
    return wake > 0 and saved >= HOLD_SHARE * wake and saved >= HOLD_SAVING_NS


def _judge_hold(d: Diagnosis, handoffs: dict[str, HandoffResult], unmeasured: str) -> Diagnosis:
    kind = _idle_kind(handoffs)
    same = handoffs.get("same CPU busy")
    held = handoffs.get(kind.replace(" idle", " held")) if kind else None
    if kind is None or same is None or held is None:
        return replace(d, hold=unmeasured or "not measured")
    idle = _idle_cost(handoffs[kind])
    now = _idle_cost(held)
    wake = idle - same.median_ns
    pays = _pays(idle, now, same.median_ns)
    how = (
        "CPUPIN_WAKE_LATENCY_US=0 with a plan that pins, cpupin exec --wake-latency 0, "
        "or cpupin.hold_wake_latency(step CPUs)"
    )
    text = (
        f"an idle handoff costs {_us(idle)}, and {_us(now)} while the wake latency is held "
        f"at 0 µs: the hold {'removes' if pays else 'does not remove'} most of an idle "
        f"wake's cost ({_us(max(wake, 0))} over a handoff on the same CPU)"
    )
    if not pays:
        return replace(d, hold=f"does not pay: {text}")
    if d.verdict == "off":
        why = (
            f"{d.why}; but {text}, at the price of idle CPUs that poll: hold the step and "
            f"result CPUs' wake latency ({how})"
        )
        return replace(d, verdict="hold", why=why, hold=f"pays: {text}")
    return replace(
        d,
        hold=f"pays: {text}; it needs no pinned core, only CPUs that poll when idle ({how})",
    )


def _diagnose(
    host: Host,
    handoffs: dict[str, HandoffResult] | None,
    measured_on: str,
    noise: list[str] | None,
) -> Diagnosis:
    deepest = host.deepest_idle_state()
    notes = list(noise or [])
    if host.hypervisor:
        notes.append(
            "a virtual machine: its guest sees only the idle states the hypervisor "
            "shows, so the measured handoff, not sysfs, decides"
        )
    state = (
        f"deepest idle state {deepest.name} at {deepest.latency_us} µs"
        if deepest
        else "no idle states listed"
    )
    if not handoffs:
        deep = deepest is not None and deepest.latency_us >= IDLE_STATE_US
        verdict = "auto" if deep else "off"
        why = (
            f"{state}; not measured: a handoff to an idle core should cost about that "
            f"much more than one on the same core, so pinning "
            f"{'should pay' if deep else 'would save nothing and queue threads'}; run "
            "`cpupin doctor` on the host itself to measure"
        )
        return Diagnosis(verdict, why, deepest, {}, "nowhere", tuple(notes))
    same = handoffs.get("same CPU busy")
    idle_kind = _idle_kind(handoffs)
    if same is None or idle_kind is None:
        return Diagnosis(
            "off",
            f"{state}; one CPU in the mask: no other core to hand off to, "
            "so there is nothing to pin apart",
            deepest,
            handoffs,
            measured_on,
            tuple(notes),
        )
    idle = handoffs[idle_kind]
    busy = handoffs[idle_kind.replace("idle", "busy")]
    notes += _pair_notes(handoffs, same, busy)
    verdict, why = _judge_wake(state, deepest, idle_kind, idle, busy, same)
    return Diagnosis(verdict, why, deepest, handoffs, measured_on, tuple(notes))


def _pair_notes(
    handoffs: dict[str, HandoffResult], same: HandoffResult, busy: HandoffResult
) -> list[str]:
    """What the pairs show besides the wake: a slow wake of a running core,
    and the cost of crossing an L3."""
    notes = []
    if busy.median_ns >= 5 * same.median_ns and busy.median_ns - same.median_ns >= 10_000:
        notes.append(
            f"waking another core costs {_us(busy.median_ns)} even while it runs, "
            f"{busy.median_ns / same.median_ns:.0f}x a handoff on the same CPU: a workload whose "
            "step threads fit on one CPU may still gain from a CPU number here; measure it "
            "(examples/runtime.py and bench/runtime.py, in cpupin's source distribution: "
            "pip download --no-binary :all: --no-deps cpupin)"
        )
    near, far = handoffs.get("same L3 busy"), handoffs.get("other L3 busy")
    if near is not None and far is not None:
        notes.append(
            f"a handoff to a running core under another L3 costs {_us(far.median_ns)} against "
            f'{_us(near.median_ns)} under the same one (docs/placement.md, "Cache domains")'
        )
    return notes


def _judge_wake(
    state: str,
    deepest: IdleState | None,
    idle_kind: str,
    idle: HandoffResult,
    busy: HandoffResult,
    same: HandoffResult,
) -> tuple[str, str]:
    """The verdict, and why: whether waking an idle core costs enough more
    than handing off to a running one for pinning to pay."""
    # What a deep idle state costs: the same pair, its receiver idle or busy.
    penalty = _idle_cost(idle) - busy.median_ns
    numbers = (
        f"a handoff to an idle core ({idle_kind.replace(' idle', '')}) costs "
        f"{_us(_idle_cost(idle))} against {_us(busy.median_ns)} to a running one and "
        f"{_us(same.median_ns)} on the same CPU"
    )
    if penalty >= IDLE_PENALTY_NS:
        verdict = "auto"
        why = (
            f"{state}; {numbers}: waking an idle core costs {_us(penalty)} a handoff, "
            "which pinning the step threads to one core saves"
        )
    else:
        verdict = "off"
        deep = deepest is not None and deepest.latency_us >= IDLE_STATE_US
        # A negative difference is noise between two small figures: said as
        # such, never shown as a wake of 0.
        gap = (
            f"an idle core wakes within {_us(penalty)} of a running one"
            if penalty > 0
            else "an idle core woke no slower than a running one (the difference is noise)"
        )
        why = f"{state}; {numbers}: {gap}, so pinning saves little and queues threads" + (
            " (a deep state is listed but the wake did not show it)" if deep else ""
        )
    return verdict, why
