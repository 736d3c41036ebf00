"""Pools sized to the CPUs a process can really use: the usable CPUs and
``limit_pools`` (``limits``), and the census that finds a process's pools
and judges each (``census``)."""
