"""The exceptions cpupin raises besides ``ValueError`` and ``OSError``."""

from __future__ import annotations

import errno
import os

__all__ = ["PlanError", "UnsupportedPlatform", "excerpt", "printable"]


def excerpt(text: object, size: int = 40) -> str:
    """A short, printable quotation of ``text`` for a message: at most
    ``size`` characters, anything unprintable escaped, ``...`` when cut.
    Whatever cpupin read from outside is quoted back only this way."""
    if isinstance(text, int) and not isinstance(text, bool):
        # str() of a huge int raises (Python's digit limit); hex never does.
        shown = str(text) if text.bit_length() <= 64 else f"{text:#x}"
        return shown[:size] + ("..." if len(shown) > size else "")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str):
        text = repr(text)
    body = repr(text[:size])
    return body + ("..." if len(text) > size else "")


def _escape(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str, size: int | None = None) -> str:
    """``text`` safe to write to a terminal or a text file: control
    characters (escape sequences, carriage returns, newlines), invisible
    direction marks, unassigned code points and bytes that were not UTF-8
    become visible ``\\xNN``/``\\uNNNN`` escapes, and the result always
    encodes as UTF-8. With ``size``, at most that many characters of
    ``text`` are kept (``…`` marks a cut). Idempotent: text already made
    printable (a registry field) passes unchanged. Thread names, file names
    and record fields read from outside are printed only through this (or
    :func:`excerpt`)."""
    if not isinstance(text, str):
        text = str(text)
    cut = size is not None and len(text) > size
    if cut:
        text = text[: max(size or 0, 1) - 1]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _escape(c) for c in text)
    return text + ("…" if cut else "")


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


class PlanError(ValueError):
    """A setting or device list that cannot be honoured at startup.

    Raised for a bad ``step_thread_core`` value and for a CPU number the mask
    cannot honour, with a message that names the value and what to do.
    ``auto`` never raises it: a rule it cannot meet pins nothing instead.
    """
