"""Placeholder location on expanded ids (pure, no engine)."""

import pytest

from mmserve.errors import ProcessedInputError
from mmserve.passthrough.placeholders import locate_items, placeholder_runs

P = 7  # placeholder id


def test_runs_found_in_order_with_lengths():
    ids = [1, P, P, P, 2, 3, P, 4, P, P]
    assert placeholder_runs(ids, P) == [(1, 3), (6, 1), (8, 2)]
    assert placeholder_runs([1, 2, 3], P) == []
    assert placeholder_runs([P] * 5, P) == [(0, 5)]


def test_locate_matches_each_item_to_its_run():
    ids = [0, 5, P, P, P, P, 6, 9, 5, P, P, 6]
    runs = locate_items(ids, modality="image", token="<p>", token_id=P, expected=[4, 2])
    assert runs == [(2, 4), (9, 2)]


def test_locate_reports_item_expected_and_found():
    ids = [0, P, P, P, 9, P, P]
    with pytest.raises(ProcessedInputError) as err:
        locate_items(
            ids, modality="audio", token="<|AUDIO|>", token_id=P, expected=[3, 4], describe=["", "16 valid mel frames"]
        )
    e = err.value
    assert (e.modality, e.item, e.field) == ("audio", 1, "prompt_token_ids")
    assert "expected 4 <|AUDIO|> tokens (16 valid mel frames)" in str(e)
    assert "found a run of 2 at offset 5" in str(e)


@pytest.mark.parametrize("ids,expected", [([0, 1, 2], [4]), ([P, P, 0, P], [2]), ([P, P], [1, 1])])
def test_locate_rejects_run_count_mismatch(ids, expected):
    with pytest.raises(ProcessedInputError, match=r"expected \d+ run\(s\) of <p>"):
        locate_items(ids, modality="image", token="<p>", token_id=P, expected=expected)
