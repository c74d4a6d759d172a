"""Already-processed tensors of one modality, as vLLM's parser hands them to the processor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.feature_extraction_utils import BatchFeature
from vllm.multimodal.inputs import MultiModalKwargsItems
from vllm.multimodal.parse import ModalityDataItems

from mmserve.families.base import ModalitySpec


class ProcessedItems(ModalityDataItems[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]):
    """The HF processor's output for one modality of one request, validated and split into items.

    The tensors go to the model as they are (``get_passthrough_data``); nothing reaches the HF
    processor (``get_processor_data`` is empty). Each item is hashed by its own tensors' content,
    so the prefix cache and the encoder cache never mix two requests with different pixels or audio.
    """

    def __init__(self, data: Mapping[str, Any], spec: ModalitySpec, mm_config: Any) -> None:
        tensors = spec.check_fields(data)
        spec.validate(tensors, mm_config)
        super().__init__(tensors, spec.modality)
        self.spec = spec
        self._mm_config = mm_config
        self._items = MultiModalKwargsItems.from_hf_inputs(
            BatchFeature(dict(tensors)), spec.fields_config(tensors, mm_config)
        )[spec.modality]

    def get_count(self) -> int:
        return len(self._items)

    def get(self, index: int) -> Mapping[str, torch.Tensor]:
        return self._items[index].get_data()

    def get_item_for_hash(self, index: int) -> object:
        # Field order fixed so that equal content always hashes equal.
        item = self.get(index)
        return {name: item[name] for name in sorted(item)}

    def get_processor_data(self) -> Mapping[str, object]:
        return {}

    def get_passthrough_data(self) -> Mapping[str, object]:
        return self.data

    def expected_tokens(self) -> list[int]:
        return [self.spec.expected_tokens(self.get(i), self._mm_config) for i in range(len(self))]

    def describe(self) -> list[str]:
        return [self.spec.describe_item(self.get(i)) for i in range(len(self))]
