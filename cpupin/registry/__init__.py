"""The host's registry, in the lock directory every server shares: the
record format (``_record``), the writer of this process's record
(``writer``), the hostile reader of everyone's (``reader``), the removal of
what dead processes left (``prune``), the lock per GPU (``lock``), and what
a record says of a process's pools (``_pool_names``, ``_torch_thread``)."""
