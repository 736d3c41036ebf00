"""Reading the host (cpupin/host/): topology against hwloc, launchers, IRQs, memory by node."""
