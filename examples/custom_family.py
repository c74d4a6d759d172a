"""Worked example: serving your own multimodal model through the pass-through processor.

The model of the origin thread takes images as ``pixel_values`` + ``image_grid_thw`` (a Qwen2-VL
vision tower) and audio as ``audio_values`` (clips, mel bins, frames) + ``audio_attention_masks``
(clips, encoder positions) where every unmasked position is one audio embedding. Its vLLM model class
``MyOmniForConditionalGeneration`` (in your package ``my_omni``) already has a vLLM multimodal
processor registered for raw inputs. This module is all the pass-through needs to know about it; see
docs/adding-a-family.md for how it is registered and used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from mmserve.errors import ProcessedInputError
from mmserve.families import FamilySpec, FieldSpec, ModalitySpec
from mmserve.families.qwen import QwenVisionImage


class MaskedAudio(ModalitySpec):
    """Audio whose placeholder count is the number of unmasked encoder positions."""

    modality = "audio"
    placeholder_token = "<|AUDIO|>"
    fields = (
        FieldSpec("audio_values", "float32", ("clips", "mel_bins", "frames"), "log-mel features of each clip"),
        FieldSpec("audio_attention_masks", "int64", ("clips", "positions"), "1 for each audio embedding"),
    )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        values, masks = data["audio_values"], data["audio_attention_masks"]
        if values.shape[0] != masks.shape[0] or values.shape[0] == 0:
            raise ProcessedInputError(
                "audio",
                field="audio_attention_masks",
                expected=f"one mask per clip ({values.shape[0]} clips)",
                found=f"shape {tuple(masks.shape)}",
            )
        for index, count in enumerate(masks.sum(-1).tolist()):
            if count <= 0:
                raise ProcessedInputError(
                    "audio",
                    item=index,
                    field="audio_attention_masks",
                    expected="at least one unmasked position",
                    found="none",
                )

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        return {
            "audio_values": MultiModalFieldConfig.batched("audio"),
            "audio_attention_masks": MultiModalFieldConfig.batched("audio"),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return int(item["audio_attention_masks"].sum())

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"{int(item['audio_attention_masks'].sum())} unmasked positions"


MY_OMNI = FamilySpec(
    name="my_omni",
    stock_architectures=("MyOmniForConditionalGeneration",),
    passthrough_architecture="MyOmniPassthrough",
    vllm_model="my_omni.modeling:MyOmniForConditionalGeneration",
    modalities=(QwenVisionImage("<|IMAGE|>"), MaskedAudio()),
)


def register() -> None:
    """Your package's ``vllm.general_plugins`` entry point (runs in every vLLM process)."""
    from mmserve.families import register_family
    from mmserve.passthrough.models import register_models

    register_family(MY_OMNI)
    register_models()
