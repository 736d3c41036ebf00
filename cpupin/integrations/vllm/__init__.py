"""cpupin inside vLLM: a ``vllm.general_plugins`` entry point.

vLLM loads its general plugins in every process it starts: the API server,
the engine core, each worker, and short-lived helpers (a model inspection in
a subprocess). :func:`register` finds which one it runs in from what vLLM
itself sets (the process title ``VLLM::EngineCore``/``VLLM::Worker``, the
``multiprocessing`` name ``EngineCore``/``VllmWorker-N``, the module that
runs the API server), never from timing, and does nothing in a helper.

``CPUPIN_VLLM`` chooses what it does:

- ``observe`` (the default): every process writes its registry record with
  its role (``cpupin ps`` lists the server's processes by name); the worker
  times every ``execute_model`` with a :class:`~cpupin.StepClock` and puts
  the clock's figures in its record once a second, from a thread of its own
  on the launcher's CPUs; the API server exports every one of its processes'
  step figures through vLLM's own ``/metrics`` (and ``cpupin ps
  --prometheus`` shows them too). Beside that it changes one thing only,
  and only what cpupin itself set: the library pool variables a
  ``cpupin exec`` or a ``child_env()`` put in the environment are removed
  where vLLM sizes those pools itself (its worker's OpenMP team follows the
  CPUs it binds; torch takes ``MKL_NUM_THREADS`` over that), since vLLM
  takes any value it finds for the user's.
- ``auto``: observe, and apply what cpupin knows. On CUDA hosts each
  worker is bound to its GPU's NUMA node (CPUs within the launcher's mask,
  memory preferred there) just before vLLM initialises the device, and the
  engine core to local rank 0's. On vLLM-CPU, the worker's
  OpenMP team is capped to the CPUs the process can use (a quota: its CPU
  lists are cut to the usable CPUs before the worker starts, since vLLM
  makes ``torch.set_num_threads`` a no-op once it has bound the team); the
  worker's threads that are not OpenMP's (gloo, ZMQ, named Python threads)
  and the engine core and API server are moved off the OpenMP CPUs onto the
  CPUs vLLM reserves for them, and the worker's are checked again once a
  second (threads it starts later inherit the OpenMP pin). Every decision
  is a note in the process's record (``cpupin ps``) and a line in the log.
- ``off``: nothing at all.

Nothing here ever raises into vLLM: a failure is logged once, with why, and
the server runs as it would without cpupin.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """The entry point vLLM calls in each process it starts; never raises.
    The wiring is imported here, so that loading the entry point costs
    vLLM nothing until it calls it."""
    from cpupin.integrations.vllm.wiring import register as wire

    wire()
