"""What the Triton Python-backend stub's embedded interpreter lacks; the adapters
(``model_repository/*/1/model.py``) call this first, before torch or vLLM are imported."""

from __future__ import annotations

import locale

_ASCII = ("ascii", "ansi_x3.4-1968")


def use_utf8_locale() -> bool:
    """Switch LC_CTYPE to C.UTF-8 when the process's preferred encoding is ASCII; True if switched.

    The stub embeds an interpreter that never applies the environment's locale (a ``python``
    executable does, and coerces the C locale to UTF-8), so files opened without an encoding would be
    read as ASCII there: torch reads its UTF-8 kernel templates that way and fails. Processes the
    models start (vLLM's engine core) inherit the switch when forked, and apply their own otherwise.
    """
    if locale.getpreferredencoding(False).lower() not in _ASCII:
        return False
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    except locale.Error:
        return False
    return True
