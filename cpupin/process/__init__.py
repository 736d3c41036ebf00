"""What a process may use: this process's own mask, recorded at import
(``mask``), and another process's mask, environment and record, read from
outside (``outside``)."""
