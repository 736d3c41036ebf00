"""The host shapes cpupin ships, by the module path the guides name
(``from cpupin.hosts import host_named``); they live in
:mod:`cpupin.host.shapes`."""

from __future__ import annotations

from cpupin.host.shapes import HOSTS, GpuSpec, HostSpec, PciSpec, build_tree, host_named

__all__ = ["HOSTS", "GpuSpec", "HostSpec", "PciSpec", "build_tree", "host_named"]
