"""The operator's key (``mmserve.operator``), without a server: what may serve as a key, where it
is read from, how it is compared. The server refusing clients without it: test_attacks.py."""

from __future__ import annotations

import pytest

from mmserve import operator, settings


@pytest.mark.parametrize(
    "key, message",
    [
        ("short", r"expected 16 to 256 characters, found 5"),
        ("x" * 20 + "\r\nEvil: 1", r"letters, digits"),
        ("k" * 257, "found 257"),
    ],
)
def test_a_key_that_cant_travel_in_a_header_is_refused(key, message):
    with pytest.raises(operator.OperatorKeyError, match=message):
        operator.check_key(key)


def test_the_key_comes_from_the_environment_else_its_file(tmp_path):
    path = tmp_path / "key"
    assert operator.key_from_environment({settings.OPERATOR_KEY_FILE.name: str(path)}) is None  # not there yet
    key, origin = operator.key_for_this_start({settings.OPERATOR_KEY_FILE.name: str(path)})
    assert origin.startswith("made for this start") and path.read_text().strip() == key
    assert path.stat().st_mode & 0o777 == 0o600
    assert operator.key_from_environment({settings.OPERATOR_KEY_FILE.name: str(path)}) == key
    other = "k" * 32
    both = {settings.OPERATOR_KEY.name: other, settings.OPERATOR_KEY_FILE.name: str(path)}
    assert operator.key_from_environment(both) == other  # the variable first


def test_only_the_key_itself_is_the_operator():
    key = operator.new_key()
    assert operator.is_operator(key, key.encode()) and operator.is_operator(key, key)
    for given in (None, b"", key[:-1].encode(), (key + "x").encode(), b"\xff" * 40):
        assert not operator.is_operator(key, given)
    assert not operator.is_operator(None, b"anything")  # no key configured: no drain at all
