"""The exceptions cpupin raises besides ``ValueError`` and ``OSError``."""

from __future__ import annotations

import errno
import os

__all__ = ["UnsupportedPlatform"]


class UnsupportedPlatform(OSError):
    """Thread affinity is not available here (cpupin pins threads on Linux).

    An ``OSError`` with ``errno.ENOSYS``, raised by every affinity call on a
    platform whose extension was built without ``CPUPIN_HAVE_AFFINITY``.
    """

    def __init__(self, what: str) -> None:
        super().__init__(
            errno.ENOSYS,
            f"{os.strerror(errno.ENOSYS)}: cpupin was built without thread affinity on this "
            f"platform, so {what} is not available; cpupin pins threads on Linux only",
        )
