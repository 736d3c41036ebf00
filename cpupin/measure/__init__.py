"""What the threads did: samples of CPU time and run-queue wait
(``sampling``), the step clock (``stepclock``), the handoff benchmark
(``handoff``), the doctor's verdicts (``doctor``) and the Prometheus
collectors (``metrics``)."""
