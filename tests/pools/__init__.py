"""Pools sized to the usable CPUs, and the census (cpupin/pools/), with real quotas."""
