"""Locate the placeholder runs of already-expanded prompt ids (no vLLM imports: pure and testable)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmserve.errors import ProcessedInputError


def placeholder_runs(prompt_ids: Sequence[int] | np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """Maximal runs of ``token_id`` in ``prompt_ids`` as ``(offset, length)``, in prompt order."""
    is_token = np.asarray(prompt_ids, dtype=np.int64) == token_id
    if not is_token.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], is_token.view(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def locate_items(
    prompt_ids: Sequence[int],
    *,
    modality: str,
    token: str,
    token_id: int,
    expected: Sequence[int],
    describe: Sequence[str] = (),
) -> list[tuple[int, int]]:
    """Match each item of a modality to its placeholder run, in order of appearance.

    Every item must own exactly one run (the Qwen templates delimit each item with start/end
    tokens), and the run's length must equal the count the item's tensors imply.

    Raises:
        ProcessedInputError: the runs and the items don't correspond one to one.
    """
    runs = placeholder_runs(prompt_ids, token_id)
    if len(runs) != len(expected):
        raise ProcessedInputError(
            modality,
            field="prompt_token_ids",
            expected=f"{len(expected)} run(s) of {token} (one per item)",
            found=f"{len(runs)} run(s) with lengths {[n for _, n in runs]}",
            hint="the prompt must be expanded by the same processor that produced the tensors",
        )
    for index, ((offset, length), want) in enumerate(zip(runs, expected, strict=True)):
        if length != want:
            detail = describe[index] if index < len(describe) else ""
            raise ProcessedInputError(
                modality,
                item=index,
                field="prompt_token_ids",
                expected=f"{want} {token} tokens" + (f" ({detail})" if detail else ""),
                found=f"a run of {length} at offset {offset}",
            )
    return runs
