"""Who owns a request of ``mm_llm``, and so who may cancel it: the one place that knows.

Triton request ids are the client's own choice: load tools number them ``1``, ``2``, ..., two
clients may use the same, and any client may name any id. So an id alone proves nothing. A request
that wants to be cancellable carries a ``cancel_key`` of its client's making (a random token), and
a ``cancel`` control request cancels the requests in flight whose id **and** key it repeats
(``Owner``): no client can cancel another's request, and two requests that share an id never
cancel each other. A request without a key can't be cancelled by a control request at all (its
client still cancels it by cancelling its own gRPC stream, which ``mm_llm`` polls).

A cancel may overtake its request (sent beside an ``mm_ensemble`` request while ``preprocess``
runs): a cancel that finds nothing is remembered for ``EARLY_CANCEL_S``, by id and key, and the
request is answered ``CANCELLED`` when it arrives. Only that same owner's request: another
client's later request with the same id is untouched. Every cancel is answered alike, found or
not, so a cancel tells no client whether an id is in use.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

from mmserve.errors import InputError

MIN_KEY_BYTES = 16
"""The shortest ``cancel_key``: a key that can be guessed protects nothing."""
MAX_KEY_BYTES = 128
MAX_ID_BYTES = 256
"""The longest Triton request id ``mm_llm`` takes (it names the request in the engine and the logs)."""
EARLY_CANCEL_S = 60.0
"""How long a cancel for a request not in flight (yet) is remembered."""
MAX_EARLY_CANCELS = 4096
"""At most this many are remembered (the oldest go first): a flood of cancels costs bounded memory."""


@dataclass(frozen=True)
class Owner:
    """A request's id and a digest of its ``cancel_key``: what a cancel must repeat."""

    request_id: str
    key_digest: bytes


def request_id_of(request_id: str) -> str:
    """The Triton request id, bounded (``InputError`` past ``MAX_ID_BYTES``)."""
    if len(request_id.encode("utf-8", "replace")) > MAX_ID_BYTES:
        raise InputError(f"request id: expected at most {MAX_ID_BYTES} bytes, found {len(request_id.encode())}")
    return request_id


@overload
def owner_of(request_id: str, key: bytes, *, field: str = ...) -> Owner: ...


@overload
def owner_of(request_id: str, key: bytes | None, *, field: str = ...) -> Owner | None: ...


def owner_of(request_id: str, key: bytes | None, *, field: str = "cancel_key") -> Owner | None:
    """The owner of a request with ``request_id`` and ``key`` (the ``cancel_key`` input's bytes;
    None: not cancellable by a control request). ``InputError`` for a key out of bounds or a
    request without an id to cancel it by."""
    if key is None:
        return None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InputError(
            f"{field}: expected {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes (a random token), found {len(key)}"
        )
    if not request_id:
        raise InputError(f"{field}: the request has no id; a cancel names a request by its id and {field}")
    return Owner(request_id_of(request_id), hashlib.sha256(key).digest())


class Owners:
    """The requests in flight by owner, and the cancels that came before their request.

    Not thread-safe: ``LLMService`` calls it under its own lock. ``clock``: for tests."""

    def __init__(
        self,
        *,
        early_cancel_s: float = EARLY_CANCEL_S,
        max_early_cancels: int = MAX_EARLY_CANCELS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._requests: dict[Owner, set[str]] = {}  # owner -> the engine ids of its requests in flight
        self._early: collections.OrderedDict[Owner, float] = collections.OrderedDict()  # owner -> expiry
        self.early_cancel_s, self.max_early_cancels, self._clock = early_cancel_s, max_early_cancels, clock

    def add(self, owner: Owner | None, engine_id: str) -> bool:
        """Record a request in flight; False (nothing recorded) if its owner cancelled it before it came."""
        if owner is None:
            return True
        self._expire()
        if self._early.pop(owner, None) is not None:
            return False
        self._requests.setdefault(owner, set()).add(engine_id)
        return True

    def remove(self, owner: Owner | None, engine_id: str) -> None:
        """The request ended."""
        if owner is None:
            return
        ids = self._requests.get(owner)
        if ids is not None:
            ids.discard(engine_id)
            if not ids:
                del self._requests[owner]

    def cancel(self, owner: Owner) -> list[str]:
        """The engine ids of ``owner``'s requests in flight; none: the cancel is remembered for
        its request, in case it has not arrived yet."""
        ids = self._requests.get(owner)
        if ids:
            return sorted(ids)
        self._expire()
        self._early[owner] = self._clock() + self.early_cancel_s
        self._early.move_to_end(owner)
        while len(self._early) > self.max_early_cancels:
            self._early.popitem(last=False)
        return []

    def _expire(self) -> None:
        now = self._clock()
        while self._early and next(iter(self._early.values())) < now:
            self._early.popitem(last=False)

    def __len__(self) -> int:
        """Owners with requests in flight (for tests)."""
        return len(self._requests)
