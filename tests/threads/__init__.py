"""Threads on the process mask, pins and the guard (cpupin/threads/, cpupin/process/)."""
