"""cpupin's Prometheus collectors, by the module path the guides name
(``from cpupin.metrics import ThreadCollector``); they live in
:mod:`cpupin.measure.metrics`. They need ``prometheus_client``
(``pip install 'cpupin[prometheus]'``)."""

from __future__ import annotations

from cpupin.measure.metrics import ProcessesCollector, ServerStepsCollector, ThreadCollector

__all__ = ["ProcessesCollector", "ServerStepsCollector", "ThreadCollector"]
