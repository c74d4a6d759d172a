"""How the class of an error travels to clients on Triton 2.51 (no heavy imports: the client uses it).

Triton 2.51 drops the error code on the paths decoupled models answer on (gRPC stream responses
carry only a message; the HTTP generate endpoints answer 400 for any model error), so the models
start every error message with its class, ``[UNAVAILABLE] the engine failed ...``. Triton's own
answers about a model being unloaded or loaded carry no tag: ``TRITON_UNAVAILABLE`` recognizes them.
"""

from __future__ import annotations

import re

CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL")
TAG = re.compile(r"\[(" + "|".join(CODES) + r")\] ")
"""The tag in a message; not always at its start (Triton's ensemble prefixes "in ensemble '...', ")."""
TRITON_UNAVAILABLE = ("unknown model", "has no available versions", "is not ready", "unloading",
                      "Server is stopping")
"""What Triton says (code INTERNAL or NOT_FOUND) of a model that is not loaded or being (un)loaded."""


def tagged(code: str, message: str) -> str:
    return f"[{code}] {message}"


def code_of(message: str) -> str | None:
    """The class of an error message: its tag, ``UNAVAILABLE`` for Triton's own "model not
    available" answers, else None."""
    tag = TAG.search(message)
    if tag:
        return tag.group(1)
    if any(marker in message for marker in TRITON_UNAVAILABLE):
        return "UNAVAILABLE"
    return None
