"""Pure decisions: the CPU plan of a host and a quota (``cpuplan``), where a
server's threads go (``placement``), and a process's binding (``binding``).
A plan is a function of what :mod:`cpupin.host` read: no I/O here."""
