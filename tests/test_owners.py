"""Who may cancel which request of mm_llm (``mmserve.serving.owners``), without an engine: the live
attacks are in test_attacks.py."""

from __future__ import annotations

import pytest

from mmserve.errors import InputError
from mmserve.serving.owners import MAX_ID_BYTES, MIN_KEY_BYTES, Owner, Owners, owner_of

KEY, OTHER_KEY = b"k" * MIN_KEY_BYTES, b"o" * MIN_KEY_BYTES


def own(request_id: str, key: bytes) -> Owner:
    owner = owner_of(request_id, key)
    assert owner is not None
    return owner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_cancel_needs_the_id_and_the_key():
    owners = Owners()
    victim = own("1", KEY)
    assert owners.add(victim, "engine-1")
    assert owners.cancel(own("1", OTHER_KEY)) == []  # the id alone: nothing
    assert owners.cancel(own("2", KEY)) == []  # the key alone: nothing
    assert owners.cancel(victim) == ["engine-1"]


def test_requests_that_share_an_id_never_cancel_each_other():
    owners = Owners()
    mine, theirs = own("1", KEY), own("1", OTHER_KEY)
    assert owners.add(mine, "engine-a") and owners.add(theirs, "engine-b")
    assert owners.cancel(theirs) == ["engine-b"]
    owners.remove(theirs, "engine-b")
    assert owners.cancel(mine) == ["engine-a"]


def test_an_early_cancel_reaches_only_its_owners_later_request():
    clock = Clock()
    owners = Owners(early_cancel_s=60, clock=clock)
    assert owners.cancel(own("7", OTHER_KEY)) == []  # a hostile cancel for an id not in use
    assert owners.add(own("7", KEY), "engine-1")  # another client's request with that id runs
    assert owners.cancel(own("8", KEY)) == []  # the owner's own cancel that overtakes its request
    assert not owners.add(own("8", KEY), "engine-2")  # ... cancels it when it arrives
    assert owners.cancel(own("9", KEY)) == []
    clock.now = 61
    assert owners.add(own("9", KEY), "engine-3")  # remembered for 60 s only


def test_early_cancels_are_bounded():
    owners = Owners(max_early_cancels=3)
    for k in range(10):
        owners.cancel(own(str(k), KEY))
    assert owners.add(own("0", KEY), "engine-0")  # the oldest went first
    assert not owners.add(own("9", KEY), "engine-9")


def test_a_request_without_a_key_is_nobodys_to_cancel():
    owners = Owners()
    assert owner_of("1", None) is None and owners.add(None, "engine-1") and len(owners) == 0


@pytest.mark.parametrize(
    "request_id, key, message",
    [
        ("1", b"short", r"cancel_key: expected 16 to 128 bytes \(a random token\), found 5"),
        ("1", b"k" * 129, r"found 129"),
        ("", KEY, r"cancel_key: the request has no id"),
        ("x" * (MAX_ID_BYTES + 1), KEY, r"request id: expected at most 256 bytes, found 257"),
    ],
)
def test_bounds(request_id, key, message):
    with pytest.raises(InputError, match=message):
        owner_of(request_id, key)
