"""The pass-through multimodal processor: vLLM's own processor for a family, taught to accept the
HF processor's output and an already-expanded prompt.

For a request whose multimodal data are processed dicts (``{"pixel_values": ..., "image_grid_thw":
...}``), the processor

1. validates every field (presence, dtype, rank, shapes across fields) while parsing, before
   anything reaches the engine;
2. hands the tensors to the model unchanged (the family's own vLLM post-processing still maps HF
   names onto the model's kwargs, e.g. Omni's ``input_features`` -> ``input_audio_features``);
3. never expands the prompt: it locates each item's placeholder run and checks its length against
   the count the item's tensors imply;
4. hashes each item by content (vLLM's hasher over the item's tensors).

Requests with raw media (PIL images, waveforms) take vLLM's normal path unchanged, so one
deployment serves both. A request may not mix the two.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

from mmserve.errors import ProcessedInputError
from mmserve.families.base import FamilySpec
from mmserve.passthrough.items import ProcessedItems
from mmserve.passthrough.placeholders import locate_items


def _is_processed(data: object, field_names: frozenset[str]) -> bool:
    return isinstance(data, Mapping) and bool(field_names & set(data))


class PassthroughInfoMixin:
    """Parses processed dicts into ``ProcessedItems``; everything else goes to the stock parser."""

    family: ClassVar[FamilySpec]

    def parse_mm_data(self, mm_data: Mapping[str, Any], *, validate: bool = True) -> MultiModalDataItems:
        specs = {m.modality: m for m in self.family.modalities}
        processed = {
            modality: data
            for modality, data in mm_data.items()
            if modality in specs and _is_processed(data, specs[modality].field_names)
        }
        stock = super().parse_mm_data(  # type: ignore[misc]
            {m: d for m, d in mm_data.items() if m not in processed}, validate=validate
        )
        if not processed:
            return stock

        mm_config = self.get_hf_config()  # type: ignore[attr-defined]
        items = MultiModalDataItems()
        for modality in mm_data:
            if modality in processed:
                items[modality] = ProcessedItems(processed[modality], specs[modality], mm_config)
                if validate:
                    self.validate_num_items(modality, len(items[modality]))  # type: ignore[attr-defined]
            elif modality in stock:
                items[modality] = stock[modality]
        return items


class PassthroughProcessorMixin:
    """Locates placeholders instead of inserting them when the inputs are already processed."""

    family: ClassVar[FamilySpec]

    def apply(self, inputs, timing_ctx):  # noqa: ANN001 - vLLM's signature
        kinds = {isinstance(items, ProcessedItems) for items in inputs.mm_data_items.values()}
        if kinds == {True, False}:
            processed = sorted(m for m, i in inputs.mm_data_items.items() if isinstance(i, ProcessedItems))
            raw = sorted(m for m, i in inputs.mm_data_items.items() if not isinstance(i, ProcessedItems))
            raise ProcessedInputError(
                ",".join(raw),
                expected="all modalities of a request already processed, or all raw",
                found=f"processed {processed} with raw {raw}",
            )
        return super().apply(inputs, timing_ctx)  # type: ignore[misc]

    def _maybe_apply_prompt_updates(self, mm_items: MultiModalDataItems, mm_res):  # noqa: ANN001
        if not any(isinstance(items, ProcessedItems) for items in mm_items.values()):
            return super()._maybe_apply_prompt_updates(mm_items, mm_res)  # type: ignore[misc]

        self._validate_mm_kwargs(mm_res.kwargs, mm_items.get_all_counts())  # type: ignore[attr-defined]
        tokenizer = self.info.get_tokenizer()  # type: ignore[attr-defined]
        prompt_ids = mm_res.prompt_ids
        placeholders: dict[str, list[PlaceholderFeaturesInfo]] = {}
        for modality, items in mm_items.items():
            spec = self.family.modality(modality)
            assert spec is not None and isinstance(items, ProcessedItems)
            # Not get_vocab(): that copies the whole vocabulary, on every request.
            token_id = tokenizer.convert_tokens_to_ids(spec.placeholder_token)
            runs = locate_items(
                prompt_ids,
                modality=modality,
                token=spec.placeholder_token,
                token_id=token_id,
                expected=items.expected_tokens(),
                describe=items.describe(),
            )
            placeholders[modality] = [
                PlaceholderFeaturesInfo(
                    modality=modality,
                    item_idx=index,
                    start_idx=offset,
                    tokens=[token_id] * length,
                    is_embed=None,
                )
                for index, (offset, length) in enumerate(runs)
            ]
        return prompt_ids, placeholders


def build_model_class(family: FamilySpec) -> type:
    """The family's stock vLLM model under the pass-through architecture name, bound to the
    pass-through processor (stock processing info, dummy inputs and processor, extended)."""
    module_name, class_name = family.vllm_model.split(":")
    base = getattr(importlib.import_module(module_name), class_name)
    stock = base._processor_factory
    arch = family.passthrough_architecture
    attrs = {"family": family, "__module__": __name__}
    info_cls = type(f"{arch}ProcessingInfo", (PassthroughInfoMixin, stock.info), attrs)
    processor_cls = type(f"{arch}Processor", (PassthroughProcessorMixin, stock.processor), attrs)
    model_cls = type(
        arch,
        (base,),
        {
            "__module__": "mmserve.passthrough.models",
            "__doc__": f"{class_name} fed with already-processed inputs (family {family.name}).",
            # Processed pixel values are normalized by the HF processor already; with this off vLLM
            # also normalizes raw images on the CPU, so both paths feed the tower the same values.
            "supports_mm_device_do_normalize": False,
        },
    )
    return MULTIMODAL_REGISTRY.register_processor(
        processor_cls, info=info_cls, dummy_inputs=stock.dummy_inputs
    )(model_cls)
