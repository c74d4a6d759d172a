"""InternVL in transformers' format (``InternVLForConditionalGeneration``: InternVL3-*-hf, InternVL3.5-*-HF):
images as tiles through InternViT, ``<IMG_CONTEXT>`` placeholders.

The first family here whose placeholders are not Qwen's: an image is a thumbnail beside up to
``max_patches`` tiles of the vision tower's size (``GotOcr2ImageProcessor(crop_to_patches=True)``),
each tile ``image_seq_length`` placeholders after pixel shuffle, all of them one run
``<img><IMG_CONTEXT>...</img>``. Its processor merges every image's tiles into one ``pixel_values``
(tiles, 3, H, W) and drops the tiles per image; ``preprocess`` reads them from the runs it expanded
(``complete``), and the tiles travel as rows (tiles, 3*H*W) like every other family's patches, turned
back into images for the model (``model_inputs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.errors import ProcessedInputError
from mmserve.families.base import (
    FamilySpec,
    FieldSpec,
    ModalitySpec,
    TowerSpec,
    check_embeddings,
    check_pixel_magnitude,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def _tile(hf_config: PretrainedConfig) -> tuple[int, int, int]:
    """(channels, height, width) of one tile: the vision tower's input."""
    vision = hf_config.vision_config
    size = vision.image_size
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    return int(getattr(vision, "num_channels", 3)), height, width


def _check_tile_counts(counts: torch.Tensor, hf_config: PretrainedConfig) -> list[int]:
    """``image_num_patches``: at least one image, each of 1 tile or more, its placeholders within the
    language model's positions. Returns the counts as exact integers."""
    if counts.shape[0] == 0:
        raise ProcessedInputError("image", field="image_num_patches", expected="at least one image", found="0")
    positions = int(hf_config.get_text_config().max_position_embeddings)
    per_tile = int(hf_config.image_seq_length)
    tiles = counts.tolist()  # exact integers
    for index, count in enumerate(tiles):
        if count < 1 or count * per_tile > positions:
            raise ProcessedInputError(
                "image",
                item=index,
                field="image_num_patches",
                expected=f"between 1 and {positions // per_tile} tiles ({per_tile} placeholders each, within the "
                f"language model's {positions} positions)",
                found=str(count),
            )
    return [int(count) for count in tiles]


class TiledImage(ModalitySpec):
    """Images as tiles of the vision tower's size, ``image_seq_length`` placeholders per tile.

    One image of ``n`` tiles (``image_num_patches``, thumbnail included) occupies ``n *
    image_seq_length`` placeholder tokens (the HF processor's ``replace_image_token``)."""

    modality = "image"

    def __init__(self, placeholder_token: str = "<IMG_CONTEXT>") -> None:
        self.placeholder_token = placeholder_token
        self.fields = (
            FieldSpec(
                "pixel_values",
                "float32",
                ("tiles", "values"),
                "normalized tiles of all images in prompt order, one row of channels*height*width "
                "values each (the HF processor's (tiles, 3, H, W) flattened past the first axis)",
            ),
            FieldSpec(
                "image_num_patches",
                "int64",
                ("images",),
                "tiles of each image, its thumbnail included, in prompt order (vLLM's name; "
                "preprocess reads it from each image's run of placeholders)",
            ),
        )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        pixels, counts = data["pixel_values"], data["image_num_patches"]
        channels, height, width = _tile(hf_config)
        values = channels * height * width
        if pixels.shape[1] != values:
            raise ProcessedInputError(
                "image",
                field="pixel_values",
                expected=f"{values} values per tile ({channels}x{height}x{width}, the vision tower's input)",
                found=f"shape {tuple(pixels.shape)}",
            )
        tiles = _check_tile_counts(counts, hf_config)
        if sum(tiles) != pixels.shape[0]:
            raise ProcessedInputError(
                "image",
                field="pixel_values",
                expected=f"{sum(tiles)} tiles (sum of image_num_patches)",
                found=f"{pixels.shape[0]} rows",
            )
        check_pixel_magnitude("image", "pixel_values", pixels)

    def model_inputs(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> dict[str, torch.Tensor]:
        import torch

        channels, height, width = _tile(hf_config)
        pixels = data["pixel_values"]
        return {
            "pixel_values": pixels.reshape(pixels.shape[0], channels, height, width),
            "image_num_patches": data["image_num_patches"].to(torch.int64),
            "image_token_id": torch.tensor(int(hf_config.image_token_id)),  # the model reads it per request
        }

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        counts = data["image_num_patches"]
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", counts),
            "image_num_patches": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "image_token_id": MultiModalFieldConfig.shared("image", len(counts), keep_on_cpu=True),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return int(item["image_num_patches"]) * int(hf_config.image_seq_length)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"image_num_patches={int(item['image_num_patches'])}"

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(tensors["image_num_patches"], dtype=np.int64)  # each image's tiles

    def complete(
        self,
        processed: Mapping[str, Any],
        input_ids: np.ndarray,
        token_id: int,
        *,
        processor: Any = None,
        items: Sequence[Any] = (),
    ) -> dict[str, Any]:
        from mmserve.passthrough.placeholders import placeholder_runs

        out = dict(processed)
        pixels = out.get("pixel_values")
        if pixels is None or "image_num_patches" in out:
            return out
        runs = [length for _, length in placeholder_runs(input_ids, token_id)]
        tiles = int(np.asarray(pixels).shape[0])
        if not runs or sum(runs) % tiles or any(length % (sum(runs) // tiles) for length in runs):
            raise RuntimeError(f"the processor's {tiles} tiles do not divide its placeholder runs {runs}")
        per_tile = sum(runs) // tiles
        out["image_num_patches"] = np.array([length // per_tile for length in runs], dtype=np.int64)
        return out

    def compact(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Tiles as rows (the contract's rank-2 ``pixel_values``)."""
        out = dict(data)
        pixels = out.get("pixel_values")
        if pixels is not None and np.asarray(pixels).ndim == 4:
            out["pixel_values"] = np.asarray(pixels).reshape(pixels.shape[0], -1)
        return out


class TileEmbeddings(ModalitySpec):
    """Images as the vision tower's output after pixel shuffle and the projector (``image_embeds``:
    ``image_seq_length`` rows per tile) with each image's tiles (``image_num_patches``): what
    ``mm_llm`` takes when the encoder ran apart (vLLM 0.32's model takes ``image_embeds`` as they are)."""

    modality = "image"

    def __init__(self, features: TiledImage) -> None:
        self.features = features
        self.placeholder_token = features.placeholder_token
        self.fields = (
            FieldSpec(
                "image_embeds",
                "float32",
                ("tokens", "hidden"),
                "the vision tower's output for all images (encoder offload), in place of pixel_values: "
                "one row per placeholder token, the language model's hidden size",
            ),
            features.fields[1],
        )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        tiles = _check_tile_counts(data["image_num_patches"], hf_config)
        per_tile = int(hf_config.image_seq_length)
        rule = f"image_seq_length {per_tile} per tile of image_num_patches"
        check_embeddings("image", "image_embeds", data["image_embeds"], sum(tiles) * per_tile, hf_config, rule)

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        counts = data["image_num_patches"]
        return {
            "image_embeds": MultiModalFieldConfig.flat_from_sizes("image", counts * int(hf_config.image_seq_length)),
            "image_num_patches": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return self.features.expected_tokens(item, hf_config)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return self.features.describe_item(item)


_IMAGE = TiledImage()

INTERNVL = FamilySpec(
    name="internvl",
    stock_architectures=("InternVLForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughInternVL",
    vllm_model="vllm.model_executor.models.interns1:InternS1ForConditionalGeneration",
    modalities=(_IMAGE,),
    encoded=(TileEmbeddings(_IMAGE),),
    towers=(
        TowerSpec(
            ("image",),
            "transformers.models.internvl.modeling_internvl:InternVLVisionModel",
            ("vision_config",),
            "model.vision_tower.",
            projector=(
                "transformers.models.internvl.modeling_internvl:InternVLMultiModalProjector",
                "model.multi_modal_projector.",
            ),
            tiles=True,
        ),
    ),
    model_mixins=("mmserve.passthrough.models.internvl:InternVLEmbeddings",),
)
