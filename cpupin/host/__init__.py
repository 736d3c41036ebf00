"""Reading the host as hostile input: sysfs through a reader confined to a
root (``_sysfs``), facts about a task in ``/proc`` (``_proc``), cgroups, the
topology, the host shapes cpupin ships (``shapes``), why a process has the
CPUs it has (``launcher``), device IRQs, memory by NUMA node, CPU throttling
and PM QoS values. Imports only the vocabulary and the C door."""
