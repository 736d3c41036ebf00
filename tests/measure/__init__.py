"""Sampling, the step clock, the handoff and the doctor (cpupin/measure/)."""
