"""Multimodal serving on Triton + vLLM with preprocessing before the engine."""

import locale as _locale

# Triton's Python-backend stub embeds an interpreter that never applies the environment's locale,
# so files opened without an encoding would be read as ASCII (torch reads its UTF-8 kernel templates
# that way and fails). Every Triton model here imports this package first: switch to UTF-8 then.
if _locale.getpreferredencoding(False).lower() in ("ascii", "ansi_x3.4-1968"):
    try:
        _locale.setlocale(_locale.LC_CTYPE, "C.UTF-8")
    except _locale.Error:
        pass
