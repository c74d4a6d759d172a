"""Already-processed tensors of one modality, as vLLM's parser hands them to the processor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mmserve.errors import ProcessedInputError
from mmserve.families.base import ModalitySpec
from mmserve.vllm_seam import DictEmbeddingItems

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ProcessedItems(DictEmbeddingItems):
    """The HF processor's output for one modality of one request, validated and split into items.

    vLLM's own form of a dict of tensors (``DictEmbeddingItems``, what its ``--enable-mm-embeds``
    parsers return, and what upstream's pre-computed processor outputs will be parsed into: see
    docs/upstream-vllm.md), built from the modality's spec: its fields are the required fields, its
    ``fields_config`` the fields factory. The tensors go to the model as they are
    (``get_passthrough_data``); nothing reaches the HF processor (``get_processor_data`` is empty).
    Each item is hashed by its own tensors' content, so the prefix cache and the encoder cache
    never mix two requests with different pixels or audio (an item that came in a wire form comes
    with an identity of that form instead, its ``multi_modal_uuids``: ``ModalitySpec.wire_item_ids``).
    """

    def __init__(
        self,
        data: Mapping[str, Any],
        spec: ModalitySpec,
        hf_config: PretrainedConfig,
        *,
        max_model_len: int | None = None,
    ) -> None:
        """``max_model_len``: the engine's context length, for the checks that depend on it
        (``ModalitySpec.validate_limits``, and the placeholders' total); None: the model's own
        bounds only (``validate``)."""
        tensors = spec.check_fields(data)
        spec.validate(tensors, hf_config)
        if max_model_len is not None:
            spec.validate_limits(tensors, hf_config, max_model_len=max_model_len)
        tensors = spec.model_inputs(tensors, hf_config)
        super().__init__(
            tensors,
            spec.modality,
            required_fields=spec.required_field_names,
            optional_fields=set(tensors) - spec.required_field_names,
            fields_factory=lambda fields: spec.fields_config(fields, hf_config),
        )
        self.spec = spec
        self.hf_config = hf_config
        if max_model_len is not None:
            self._check_total(max_model_len)

    def _check_total(self, max_model_len: int) -> None:
        """The items' placeholders fit one prompt with room for a generated token: a prompt of
        ``max_model_len`` tokens or more is refused by vLLM anyway, this says which item overflows."""
        total = 0
        for index, count in enumerate(self.expected_tokens()):
            total += count
            if total > max_model_len - 1:
                raise ProcessedInputError(
                    self.spec.modality,
                    item=index,
                    expected=f"at most {max_model_len - 1} placeholder tokens over the request's "
                    f"{self.spec.modality} items (max_model_len={max_model_len}, less one token to generate)",
                    found=f"{total} up to this item ({self.spec.describe_item(self.get(index))})",
                )

    def get_item_for_hash(self, index: int) -> object:
        # Field order fixed so that equal content always hashes equal.
        item = self.get(index)
        return {name: item[name] for name in sorted(item)}

    def expected_tokens(self) -> list[int]:
        return [self.spec.expected_tokens(self.get(i), self.hf_config) for i in range(len(self))]

    def describe(self) -> list[str]:
        return [self.spec.describe_item(self.get(i)) for i in range(len(self))]
