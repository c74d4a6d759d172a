"""The pass-through multimodal processor: vLLM's own processor for a family, taught to accept the
HF processor's output and an already-expanded prompt.

For a request whose multimodal data are processed dicts (``{"pixel_values": ..., "image_grid_thw":
...}``), the processor

1. validates every field (presence, dtype, rank, shapes across fields) while parsing, before
   anything reaches the engine;
2. hands the tensors to the model unchanged (the family's own vLLM post-processing still maps HF
   names onto the model's kwargs, e.g. Omni's ``input_features`` -> ``input_audio_features``);
3. never expands the prompt: it locates each item's placeholders (``ModalitySpec.locate``: one run
   by default) and checks them against the count the item's tensors imply;
4. hashes each item by content (vLLM's hasher over the item's tensors; ``mm_llm`` gives the items
   that came in a wire form an identity of that form instead: ``ModalitySpec.wire_item_ids``).

Requests with raw media (PIL images, waveforms) take vLLM's normal path unchanged, so one
deployment serves both. A request may not mix the two.

The vLLM side (which internal methods are overridden, how the model class is registered) is in
``mmserve.vllm_seam``; this module holds the project's rules it calls.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mmserve import vllm_seam
from mmserve.errors import ProcessedInputError
from mmserve.families.base import FamilySpec
from mmserve.passthrough.items import ProcessedItems

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _is_processed(data: object, field_names: frozenset[str]) -> bool:
    return isinstance(data, Mapping) and bool(field_names & set(data))


class PassthroughInfoMixin(vllm_seam.ProcessingInfoHooks):
    """Parses processed dicts into ``ProcessedItems``; everything else goes to the stock parser."""

    family: ClassVar[FamilySpec]

    def select_own(self, mm_data: Mapping[str, Any]) -> dict[str, Any]:
        return {
            modality: data
            for modality, data in mm_data.items()
            if _is_processed(data, self.family.field_names(modality))
        }

    def parse_own(self, modality: str, data: Any, hf_config: PretrainedConfig) -> ProcessedItems:
        spec = self.family.spec_for(modality, data)
        assert spec is not None
        max_model_len = self.ctx.model_config.max_model_len  # type: ignore[attr-defined]
        return ProcessedItems(data, spec, hf_config, max_model_len=max_model_len)


class PassthroughProcessorMixin(vllm_seam.MultiModalProcessorHooks):
    """Locates placeholders instead of inserting them when the inputs are already processed."""

    family: ClassVar[FamilySpec]

    def owns(self, items: object) -> bool:
        return isinstance(items, ProcessedItems)

    def own_fields_config(self, hf_inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        # The encoded forms' own fields (the embeddings); those they share with the features (grids,
        # video seconds) keep the stock configuration, as in the features' path.
        hf_config = self.info.get_hf_config()  # type: ignore[attr-defined]
        config: dict[str, Any] = {}
        for spec in self.family.encoded:
            if spec.fields[0].name in hf_inputs:
                shared = self.family.modality(spec.modality)
                own = spec.field_names - (shared.field_names if shared is not None else frozenset())
                config.update({k: v for k, v in spec.fields_config(hf_inputs, hf_config).items() if k in own})
        return config

    def check_request(self, mm_items: Mapping[str, Any]) -> None:
        kinds = {isinstance(items, ProcessedItems) for items in mm_items.values()}
        if kinds == {True, False}:
            processed = sorted(m for m, i in mm_items.items() if isinstance(i, ProcessedItems))
            raw = sorted(m for m, i in mm_items.items() if not isinstance(i, ProcessedItems))
            raise ProcessedInputError(
                ",".join(raw),
                expected="all modalities of a request already processed, or all raw",
                found=f"processed {processed} with raw {raw}",
            )

    def placeholder_token(self, modality: str) -> str:
        spec = self.family.modality(modality)
        assert spec is not None
        return spec.placeholder_token

    def locate_placeholders(
        self, mm_items: Mapping[str, Any], prompt_ids: Sequence[int], token_ids: Mapping[str, int]
    ) -> dict[str, list[vllm_seam.Placement]]:
        placed: dict[str, list[vllm_seam.Placement]] = {}
        if self.family.audio_in_video is not None and "video" in mm_items:
            hf_config = self.info.get_hf_config()  # type: ignore[attr-defined]
            placed = (
                self.family.audio_in_video.placements(prompt_ids, mm_items["video"], mm_items.get("audio"), hf_config)
                or {}
            )
        for modality, items in mm_items.items():
            if modality in placed:
                continue
            assert isinstance(items, ProcessedItems)
            placed[modality] = items.spec.locate(
                prompt_ids,
                items,
                token_id=token_ids[modality],
                hf_config=items.hf_config,
                tokenizer=self.info.get_tokenizer(),  # type: ignore[attr-defined]
            )
        return placed


def build_model_class(family: FamilySpec) -> type:
    """The family's stock vLLM model under the pass-through architecture name, bound to the
    pass-through processor (stock processing info, dummy inputs and processor, extended)."""
    module_name, class_name = family.vllm_model.split(":")
    base = getattr(importlib.import_module(module_name), class_name)
    return vllm_seam.derive_model_class(
        base,
        family.passthrough_architecture,
        info_mixin=PassthroughInfoMixin,
        processor_mixin=PassthroughProcessorMixin,
        attrs={"family": family, "__module__": __name__},
        module="mmserve.passthrough.models",
        doc=f"{class_name} fed with already-processed inputs (family {family.name}).",
        # Processed pixel values are normalized by the HF processor already; with this off vLLM
        # also normalizes raw images on the CPU, so both paths feed the tower the same values.
        normalize_on_device=False,
        model_mixins=[_imported(path) for path in family.model_mixins],
    )


def _imported(path: str) -> type:
    module_name, name = path.split(":")
    return getattr(importlib.import_module(module_name), name)
