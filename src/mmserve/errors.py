"""The project's exception taxonomy.

``ProcessedInputError`` is a per-request error: the request that carried the bad tensors fails with
a message naming the modality, the item, the field, what was expected and what was found; the engine
and every other request are untouched. It is a ``VLLMValidationError``, vLLM's client-error (4xx)
class, so that ``AsyncLLM.generate`` re-raises it to the caller as it is, and a ``ValueError``, what
vLLM's offline ``LLM`` and most callers expect of bad input.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError


class ProcessedInputError(VLLMValidationError, ValueError):
    """Already-processed multimodal tensors that don't fit the model or the prompt."""

    def __init__(
        self,
        modality: str,
        *,
        item: int | None = None,
        field: str | None = None,
        expected: object,
        found: object,
        hint: str = "",
    ) -> None:
        self.modality = modality
        self.item = item
        self.field = field
        self.expected = expected
        self.found = found
        where = modality if item is None else f"{modality} item {item}"
        if field:
            where += f", {field}"
        message = f"{where}: expected {expected}, found {found}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)
