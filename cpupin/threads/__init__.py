"""Threads that start on the process mask, and pins: ``cpupin.Thread``,
``ThreadPool``, ``Queue`` and ``pin_current_thread`` (``thread``, the one
module under ``cpupin/`` allowed a bare ``threading.Thread`` or
``ThreadPoolExecutor``), a pin found off its CPUs (``_drift``), and the pin
guard (``guard``)."""
