"""Changes to the process and to the host: a process bound to its GPU's
node (``binding``), a server's plan with its GPU claims and holds
(``server``), wake-latency holds (``wake``) and IRQ moves (``irq_steer``).
Each says what it did, and what it could not."""
