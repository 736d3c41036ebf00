"""The host's registry (cpupin/registry/): records, their readers, the lock per GPU."""
