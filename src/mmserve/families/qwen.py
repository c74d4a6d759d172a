"""Modality rules shared by the Qwen families: the Qwen2-VL vision tower and the Whisper-style
audio encoder. The per-family adapters (``qwen2_5_vl.py``, ``qwen2_audio.py``, ``qwen2_5_omni.py``)
only pick these up with their own placeholder tokens."""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mmserve.errors import ProcessedInputError
from mmserve.families.base import (
    FieldSpec,
    ModalitySpec,
    WireDecoder,
    check_embeddings,
    check_pixel_magnitude,
    hidden_size,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class PatchNormalization:
    """The HF image processor's rescale and normalize, applied to the patches it outputs as uint8
    when both are off (``do_rescale=False, do_normalize=False``; resizing and patching are the same
    either way). The float32 values are bit-identical to the processor's own: it fuses the two steps
    into ``(x - mean / rescale_factor) / (std / rescale_factor)`` per channel, in float32
    (transformers' ``TorchvisionBackend.rescale_and_normalize``); ``tests/test_serving.py`` compares
    them on random images."""

    mean: np.ndarray
    """Per channel, float32, divided by ``rescale_factor`` as the processor fuses it."""
    std: np.ndarray
    patch_dim: int
    """Values per patch: channels * temporal_patch_size * patch_size**2, channels outermost."""

    @staticmethod
    def applies(image_processor: Any) -> bool:
        """Whether the processor rescales and normalizes per channel (what ``of`` takes over)."""
        mean, std = getattr(image_processor, "image_mean", None), getattr(image_processor, "image_std", None)
        return (
            bool(getattr(image_processor, "do_rescale", False) and getattr(image_processor, "do_normalize", False))
            and isinstance(mean, (list, tuple))
            and isinstance(std, (list, tuple))
            and len(mean) == len(std) > 0
        )

    @classmethod
    def of(cls, image_processor: Any) -> PatchNormalization | None:
        """The processor's normalization; None unless it ``applies``."""
        if not cls.applies(image_processor):
            return None
        import torch

        # As transformers computes them: float32 tensors times the Python float 1 / rescale_factor.
        scale = 1.0 / image_processor.rescale_factor
        mean = (torch.tensor(image_processor.image_mean) * scale).numpy()
        std = (torch.tensor(image_processor.image_std) * scale).numpy()
        patch_dim = mean.size * image_processor.temporal_patch_size * image_processor.patch_size**2
        return cls(mean, std, patch_dim)

    def __call__(self, patches: np.ndarray) -> np.ndarray:
        """uint8 patches (rows, patch_dim) -> the processor's float32 ``pixel_values``."""
        rows = patches.shape[0]
        # Converted first, then in place: a subtraction that also converts (``dtype=``) buffers the
        # broadcast mean for every chunk, 2.3x slower on a 448x448 image; the values are the same.
        values = patches.reshape(rows, self.mean.size, -1).astype(np.float32)
        values -= self.mean[:, None]
        values /= self.std[:, None]
        return values.reshape(rows, self.patch_dim)


def _content_id(kind: str, *arrays: np.ndarray) -> str:
    """An identity of ``arrays``' dtypes, shapes and bytes, apart from vLLM's own hashes (hex)."""
    from blake3 import blake3  # a vLLM dependency: only mm_llm calls this

    hasher = blake3()
    for array in arrays:
        array = np.ascontiguousarray(array)
        hasher.update(f"{array.dtype.str}{array.shape};".encode())
        hasher.update(array.reshape(-1).view(np.uint8).data)
    return f"mmserve:{kind}:{hasher.hexdigest()}"


MROPE_POSITIONS_FACTOR = 4
"""vLLM 0.32's ``MRotaryEmbedding`` default ``positions_factor``, which the Qwen2 language model of
Qwen2.5-VL and of the Qwen2.5-Omni thinker keeps (``get_rope``'s ``mrope_positions_factor``)."""


def rotary_positions(hf_config: PretrainedConfig, factor: int = MROPE_POSITIONS_FACTOR) -> int:
    """Rows of the language model's M-RoPE cos/sin table in vLLM 0.32: every position of a request
    (prompt and generation) indexes it, and one at or past its end fails in the engine core (an
    IndexError on CPU, a device-side assert on a GPU: the core dies, and every request with it).

    vLLM builds the table (``vllm/model_executor/layers/rotary_embedding/mrope.py``) over the text
    config's ``max_position_embeddings`` (``original_max_position_embeddings`` under YaRN) times
    ``MROPE_POSITIONS_FACTOR``: "the maximum index value is related to the duration of the input
    video", since a video's time positions step by seconds, not by tokens (``QwenVisionVideo``).
    131072 for the tiny checkpoints and Qwen2.5-Omni-7B (32768 x 4), 512000 for Qwen2.5-VL-7B.
    ``factor``: Qwen3-VL's language model builds it with 1 (``qwen3_vl.mrope_positions_factor``,
    without video pruning): 262144 for Qwen3-VL-8B."""
    text = hf_config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    base = text.max_position_embeddings
    if rope.get("rope_type") == "yarn" and rope.get("original_max_position_embeddings"):
        base = rope["original_max_position_embeddings"]
    return int(base) * factor


def _grid_rows(grid: Any) -> list[tuple[int, int, int]]:
    """A ``(items, 3)`` grid as Python integers: exact, where int64 tensor arithmetic on the
    client's numbers wraps around."""
    return [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]


def _check_patch_rows(field: str, rows: int, grid: Any, modality: str = "image") -> None:
    """``rows`` patches are what the ``{modality}_grid_thw`` (``grid``) says: the sum of t*h*w."""
    expected = sum(t * h * w for t, h, w in _grid_rows(grid))
    if rows != expected:
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"{expected} patches (sum of t*h*w over {modality}_grid_thw)",
            found=f"{rows} rows",
        )


def _check_patches(modality: str, field: str, pixels: Any, grid: Any, patch_dim: int) -> None:
    """``field`` holds ``patch_dim`` values per patch, as many patches as the grid says, each within
    ``base.MAX_PIXEL_VALUE``."""
    if pixels.shape[1] != patch_dim:
        raise ProcessedInputError(
            modality,
            field=field,
            expected=f"{patch_dim} values per patch (the vision tower's patch size)",
            found=f"shape {tuple(pixels.shape)}",
        )
    _check_patch_rows(field, pixels.shape[0], grid, modality)
    check_pixel_magnitude(modality, field, pixels)


def _check_grid(modality: str, grid: Any, merge: int, positions: int) -> list[tuple[int, int, int]]:
    """``{modality}_grid_thw``: (items >= 1, 3) of positive (t, h, w), h and w multiples of the
    spatial merge size, each item's placeholders (t*h*w / merge**2, in exact integers) within the
    model's ``positions`` (``rotary_positions``): then no product or sum of them comes near int64's
    range, here or in the engine (whose M-RoPE builds an index array of t x h/merge x w/merge per
    item). Returns the grid's rows as Python integers."""
    field = f"{modality}_grid_thw"
    if grid.shape[1] != 3 or grid.shape[0] == 0:
        raise ProcessedInputError(
            modality, field=field, expected=f"shape ({modality}s >= 1, 3)", found=f"shape {tuple(grid.shape)}"
        )
    rows = _grid_rows(grid)
    for index, (t, h, w) in enumerate(rows):
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise ProcessedInputError(
                modality,
                item=index,
                field=field,
                expected=f"positive (t, h, w) with h and w multiples of spatial_merge_size={merge}",
                found=f"({t}, {h}, {w})",
            )
        if t * h * w // merge**2 > positions:
            raise ProcessedInputError(
                modality,
                item=index,
                field=field,
                expected=f"at most {positions} placeholder tokens (t*h*w/{merge * merge}): the positions of "
                "the model's M-RoPE table",
                found=f"({t}, {h}, {w}): {t * h * w // merge**2} tokens",
            )
    return rows


def _vision(hf_config: PretrainedConfig) -> tuple[int, int]:
    """The vision tower's values per patch and spatial merge size."""
    vision = hf_config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    patch_dim = channels * vision.temporal_patch_size * vision.patch_size**2
    return patch_dim, vision.spatial_merge_size


def _patches_per_item(grid: Any) -> torch.Tensor:
    """Each item's patch rows (t*h*w) of a validated grid, for vLLM's ``flat_from_sizes``."""
    import torch

    return torch.tensor([t * h * w for t, h, w in _grid_rows(grid)], dtype=torch.int64)


def _grid_item_rows(tensors: Mapping[str, np.ndarray], modality: str) -> np.ndarray:
    """Patch rows of each item: ``t*h*w`` of its row of ``{modality}_grid_thw``."""
    return np.asarray(tensors[f"{modality}_grid_thw"], dtype=np.int64).reshape(-1, 3).prod(-1)


def _item_tokens(grid: Any, merge: int) -> int:
    """Placeholders of one item's (t, h, w): t*h*w / merge**2, in exact integers."""
    t, h, w = (int(v) for v in grid.tolist())
    return t * h * w // merge**2


class QwenVisionImage(ModalitySpec):
    """Images through the Qwen2-VL/2.5-VL vision tower.

    One image of patch grid (t, h, w) occupies ``t*h*w / spatial_merge_size**2`` placeholder tokens
    (the HF processor's rule: ``image_grid_thw.prod() // merge_size**2``).

    On the wire from ``preprocess`` to ``mm_llm`` the patches travel as ``pixel_values_uint8``, the
    processor's output before its rescale and normalize (a quarter of ``pixel_values``' bytes, and
    less work for the processor); ``mm_llm`` applies them (``PatchNormalization``).
    """

    modality = "image"

    def __init__(
        self,
        placeholder_token: str,
        *,
        positions_factor: int = MROPE_POSITIONS_FACTOR,
        enclosed_by: tuple[str, str] | None = None,
    ) -> None:
        """``positions_factor``: of the language model's M-RoPE table (``rotary_positions``);
        ``enclosed_by``: ``ModalitySpec.enclosed_by``."""
        self.placeholder_token = placeholder_token
        self.positions_factor = positions_factor
        self.enclosed_by = enclosed_by
        self.fields = (
            FieldSpec(
                "pixel_values",
                "float32",
                ("patches", "patch_dim"),
                "normalized image patches of all images, flattened as the HF image processor outputs "
                "them: sum of t*h*w rows, channels*temporal_patch_size*patch_size**2 columns",
            ),
            FieldSpec(
                "image_grid_thw",
                "int64",
                ("images", 3),
                "patch grid (t, h, w) of each image, in the order the images appear in the prompt",
            ),
        )
        self.wire_fields = (
            FieldSpec(
                "pixel_values_uint8",
                "uint8",
                ("patches", "patch_dim"),
                "pixel_values before the processor's rescale and normalize (its output with "
                "do_rescale=False, do_normalize=False), which mm_llm applies: send this or "
                "pixel_values",
            ),
        )

    def processor_kwargs(self, processor: Any, items: Sequence[Any]) -> dict[str, Any]:
        """Patches left as uint8 (``compact`` sends them so) where ``mm_llm`` can normalize them."""
        if not PatchNormalization.applies(getattr(processor, "image_processor", None)):
            return {}
        return {"images_kwargs": {"do_rescale": False, "do_normalize": False}}

    def compact(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """uint8 patches (see ``processor_kwargs``) go as ``pixel_values_uint8``."""
        out = dict(data)
        pixels = out.get("pixel_values")
        if pixels is not None and np.asarray(pixels).dtype == np.uint8:
            out["pixel_values_uint8"] = out.pop("pixel_values")
        return out

    def wire_decoder(self, model: str | Path) -> WireDecoder:
        from transformers import AutoImageProcessor

        normalization = PatchNormalization.of(AutoImageProcessor.from_pretrained(str(model)))

        def decode(data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            out = dict(data)
            patches = out.pop("pixel_values_uint8", None)
            if patches is None:
                return out
            if "pixel_values" in out:
                raise ProcessedInputError(
                    "image",
                    field="pixel_values_uint8",
                    expected="pixel_values or pixel_values_uint8, not both",
                    found="both",
                )
            if normalization is None:
                raise ProcessedInputError(
                    "image",
                    field="pixel_values_uint8",
                    expected="pixel_values (this checkpoint's image processor does not rescale and normalize)",
                    found=f"shape {tuple(patches.shape)}",
                )
            if patches.dtype != np.uint8 or patches.ndim != 2 or patches.shape[1] != normalization.patch_dim:
                raise ProcessedInputError(
                    "image",
                    field="pixel_values_uint8",
                    expected=f"uint8 of shape (patches, {normalization.patch_dim})",
                    found=f"{patches.dtype} of shape {tuple(patches.shape)}",
                )
            grid = out.get("image_grid_thw")
            if grid is not None and grid.ndim == 2 and grid.shape[1] == 3:
                _check_patch_rows("pixel_values_uint8", patches.shape[0], grid)
            out["pixel_values"] = normalization(patches)
            return out

        return decode

    def wire_item_ids(self, tensors: Mapping[str, np.ndarray]) -> list[str] | None:
        """blake3 of each image's uint8 patches and grid: what its float32 ``pixel_values`` are made
        from (for the checkpoint's fixed normalization), a quarter of their bytes to hash (0.2 ms for
        a 448x448 image where vLLM's hash of the decoded item takes 1.3)."""
        patches, grid = tensors.get("pixel_values_uint8"), tensors.get("image_grid_thw")
        if patches is None or grid is None or grid.ndim != 2 or grid.shape[1] != 3:
            return None
        rows = [t * h * w for t, h, w in _grid_rows(grid)]  # exact: int64 products of a grid wrap around
        if min(rows, default=0) <= 0 or sum(rows) != patches.shape[0]:
            return None  # refused by the checks of the decoded fields, with their message
        offsets = np.cumsum(rows)[:-1]
        return [_content_id("image-uint8", grid[i], part) for i, part in enumerate(np.split(patches, offsets))]

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        self.validate_layout(data, hf_config, patches="pixel_values")

    def validate_layout(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, patches: str | None = None
    ) -> None:
        """Every field, the patches (``patches``) only if named (``VisionEmbeddings`` has none)."""
        grid = data["image_grid_thw"]
        patch_dim, merge = _vision(hf_config)
        rows = _check_grid("image", grid, merge, rotary_positions(hf_config, self.positions_factor))
        if patches is not None:
            _check_patches("image", patches, data[patches], grid, patch_dim)
        for index, (t, h, w) in enumerate(rows):
            if t != 1:  # vLLM's M-RoPE asserts it for images, in the engine
                raise ProcessedInputError(
                    "image",
                    item=index,
                    field="image_grid_thw",
                    expected="t = 1 (an image is one temporal patch)",
                    found=f"({t}, {h}, {w})",
                )

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", _patches_per_item(data["image_grid_thw"])),
            "image_grid_thw": MultiModalFieldConfig.batched("image"),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        _, merge = _vision(hf_config)
        return _item_tokens(item["image_grid_thw"], merge)

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return _grid_item_rows(tensors, self.modality)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"image_grid_thw={item['image_grid_thw'].tolist()}"


class QwenVisionVideo(ModalitySpec):
    """Videos through the Qwen2.5-VL vision tower: frames in temporal patches of
    ``temporal_patch_size``, as the HF video processor outputs them.

    One video of patch grid (t, h, w) occupies ``t*h*w / spatial_merge_size**2`` placeholder tokens
    (the HF processor's rule: ``video_grid_thw.prod() // merge_size**2``); ``second_per_grid_ts``
    (seconds per temporal patch) sets the video's M-RoPE time positions.

    Its positions, as vLLM 0.32 computes them (``Qwen2_5_VLForConditionalGeneration.
    get_mrope_input_positions``, the Omni thinker's and ``passthrough.models.qwen2_5_omni.OmniAudioInVideo``'s alike): from
    ``start``, the position after the text before it, temporal patch k at ``start + int(k * seconds *
    tokens_per_second)``, rows and columns at ``start + 0 .. h/merge - 1`` and ``start + 0 .. w/merge -
    1``; whatever follows (text, generated tokens) continues after the largest. So a video takes
    ``max(int((t - 1) * seconds * tokens_per_second) + 1, h/merge, w/merge)`` positions for its
    ``t*h*w/merge**2`` tokens (with its audio track: the audio's tokens take one position each, and
    its delimiters none more than their tokens), and the positions a video takes beyond its tokens,
    its *excess* ``max(0, int((t - 1) * seconds * tokens_per_second) + 1 - t*h*w/merge**2)``, are
    what a request's positions run ahead of its tokens: every other item (an image: ``max(h, w)/merge``
    positions for ``h*w/merge**2`` tokens; audio: one per token) and every text or generated token
    takes no more positions than tokens. A request's largest position is therefore below
    ``max_model_len + sum of its videos' excess``, which must stay within the rotary table
    (``rotary_positions``): ``validate_limits`` bounds the excess so.
    """

    modality = "video"

    def __init__(
        self,
        placeholder_token: str,
        *,
        seconds_field: str = "second_per_grid_ts",
        audio_in_video: bool = False,
        tokens_per_second: float = 1.0,
        tokens_per_second_field: str | None = None,
        positions_factor: int = MROPE_POSITIONS_FACTOR,
        enclosed_by: tuple[str, str] | None = None,
    ) -> None:
        """``seconds_field``: the HF processor's name for ``second_per_grid_ts`` where it differs
        (Qwen2.5-Omni's ``video_second_per_grid``): a wire field, renamed by ``wire_decoder``.
        ``audio_in_video``: the family takes a video with its audio track (``AudioInVideo``), told by
        the optional field ``use_audio_in_video``. ``tokens_per_second``: M-RoPE time positions per
        second where the vision config has no ``tokens_per_second``, as vLLM's model class defaults
        it (Qwen2.5-VL 1.0, the Qwen2.5-Omni thinker 25); ``tokens_per_second_field``: the model
        config's attribute that holds it instead (the Qwen3-Omni thinker's ``position_id_per_seconds``).
        ``positions_factor``: of the language model's M-RoPE table (``rotary_positions``);
        ``enclosed_by``: ``ModalitySpec.enclosed_by``."""
        self.placeholder_token = placeholder_token
        self.enclosed_by = enclosed_by
        self.seconds_field = seconds_field
        self.default_tokens_per_second = tokens_per_second
        self.tokens_per_second_field = tokens_per_second_field
        self.positions_factor = positions_factor
        if seconds_field != "second_per_grid_ts":
            self.wire_fields = (
                FieldSpec(
                    seconds_field,
                    "float32",
                    ("videos",),
                    "second_per_grid_ts under this family's HF processor's name: send either",
                ),
            )
        self.fields = (
            FieldSpec(
                "pixel_values_videos",
                "float32",
                ("patches", "patch_dim"),
                "normalized patches of all videos, flattened as the HF video processor outputs "
                "them: sum of t*h*w rows, channels*temporal_patch_size*patch_size**2 columns",
            ),
            FieldSpec(
                "video_grid_thw",
                "int64",
                ("videos", 3),
                "patch grid (t, h, w) of each video (t: temporal patches), in prompt order",
            ),
            FieldSpec(
                "second_per_grid_ts",
                "float32",
                ("videos",),
                "seconds per temporal patch of each video (temporal_patch_size / sampled fps)",
            ),
        )
        if audio_in_video:
            self.fields += (
                FieldSpec(
                    "use_audio_in_video",
                    "bool",
                    ("videos",),
                    "per video: its audio track is an audio item of the request, its placeholders "
                    "interleaved with the video's (the HF processor's use_audio_in_video); absent or "
                    "empty: false",
                    optional=True,
                ),
            )

    def wire_decoder(self, model: str | Path) -> WireDecoder | None:
        if not self.wire_fields:
            return None
        name = self.seconds_field

        def decode(data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            out = dict(data)
            if name in out:
                if "second_per_grid_ts" in out:
                    raise ProcessedInputError(
                        "video", field=name, expected=f"second_per_grid_ts or {name}, not both", found="both"
                    )
                out["second_per_grid_ts"] = out.pop(name)
            return out

        return decode

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        self.validate_layout(data, hf_config, patches="pixel_values_videos")

    def validate_layout(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, patches: str | None = None
    ) -> None:
        """Every field, the patches (``patches``) only if named (``VisionEmbeddings`` has none)."""
        grid, seconds = data["video_grid_thw"], data["second_per_grid_ts"]
        patch_dim, merge = _vision(hf_config)
        positions = rotary_positions(hf_config)
        rows = _check_grid("video", grid, merge, positions)
        if patches is not None:
            _check_patches("video", patches, data[patches], grid, patch_dim)
        if tuple(seconds.shape) != (grid.shape[0],):
            raise ProcessedInputError(
                "video",
                field="second_per_grid_ts",
                expected=f"shape ({grid.shape[0]},) (one per video of video_grid_thw)",
                found=f"shape {tuple(seconds.shape)}",
            )
        per_second = self.tokens_per_second(hf_config)
        for index, ((t, _, _), value) in enumerate(zip(rows, seconds.tolist(), strict=True)):
            if not value > 0:  # vLLM reads 0 as "not given" (1 s per patch)
                raise ProcessedInputError(
                    "video",
                    item=index,
                    field="second_per_grid_ts",
                    expected="a positive number of seconds",
                    found=str(value),
                )
            # This video's own time positions (above) within the table, whatever else the request
            # holds; max(t - 1, 1): seconds * tokens_per_second finite and small for t = 1 too (vLLM
            # multiplies the temporal index 0 by it: 0 * Inf is NaN, an index of -2**63).
            if not math.isfinite(value) or max(t - 1, 1) * value * per_second >= positions:
                raise ProcessedInputError(
                    "video",
                    item=index,
                    field="second_per_grid_ts",
                    expected=f"a positive number of seconds below {positions / (max(t - 1, 1) * per_second):.6g} "
                    f"for t={t}: the last temporal patch's M-RoPE time position, (t - 1) * seconds * "
                    f"tokens_per_second={per_second:g}, within the model's {positions} positions",
                    found=repr(value),
                )
        flags = data.get("use_audio_in_video")
        if flags is not None and tuple(flags.shape) != (grid.shape[0],):
            raise ProcessedInputError(
                "video",
                field="use_audio_in_video",
                expected=f"shape ({grid.shape[0]},) (one per video of video_grid_thw)",
                found=f"shape {tuple(flags.shape)}",
            )
        if flags is not None and not set(flags.tolist()) <= {0, 1}:
            raise ProcessedInputError(
                "video",
                field="use_audio_in_video",
                expected="booleans (0 or 1)",
                found=f"values {sorted(set(flags.tolist()))[:6]}",
            )

    def tokens_per_second(self, hf_config: PretrainedConfig) -> float:
        """M-RoPE time positions per second of video, as vLLM's model class reads it."""
        if self.tokens_per_second_field is not None:
            return float(getattr(hf_config, self.tokens_per_second_field))
        return float(getattr(hf_config.vision_config, "tokens_per_second", self.default_tokens_per_second))

    def validate_limits(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, max_model_len: int
    ) -> None:
        """The videos' excess positions (the class's docstring) within the rotary table past a whole
        context of ``max_model_len`` tokens: then no position of the request, whatever it generates,
        reaches the table's end. The same arithmetic as vLLM's, in Python floats and integers: its
        ``(np.arange(t) * t_factor).astype(np.int64)`` with ``t_factor = seconds * tokens_per_second``.

        Measured at the bound (``tests/test_property_engine.py``, Qwen2.5-VL, max_model_len 2048): a
        video at this budget generates to the end of the context; at the budget + 1 too (the last
        token sampled is never fed back: one position of margin); at the budget + 2 the engine core
        indexed position 131072 of a 131072-row table and died (without this check)."""
        _, merge = _vision(hf_config)
        positions = rotary_positions(hf_config, self.positions_factor)
        per_second = self.tokens_per_second(hf_config)
        budget = positions - max_model_len
        excess = 0
        rows = _grid_rows(data["video_grid_thw"])
        for index, ((t, h, w), value) in enumerate(zip(rows, data["second_per_grid_ts"].tolist(), strict=True)):
            time_positions = int((t - 1) * (value * per_second)) + 1
            excess += max(0, time_positions - t * h * w // merge**2)
            if excess > budget:
                raise ProcessedInputError(
                    "video",
                    item=index,
                    field="second_per_grid_ts",
                    expected=f"at most {budget} M-RoPE positions beyond the videos' tokens over the request's "
                    f"videos (the model's {positions} positions less max_model_len={max_model_len}; a video "
                    f"takes int((t - 1) * seconds * {per_second:g}) + 1 time positions for t*h*w/{merge * merge} "
                    "tokens)",
                    found=f"{excess} up to this video ({time_positions} time positions for video_grid_thw="
                    f"{[t, h, w]} at {value!r} seconds per temporal patch)",
                )

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        config = {
            "pixel_values_videos": MultiModalFieldConfig.flat_from_sizes(
                "video", _patches_per_item(data["video_grid_thw"])
            ),
            "video_grid_thw": MultiModalFieldConfig.batched("video"),
            "second_per_grid_ts": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
        }
        if "use_audio_in_video" in data:  # per video (vLLM's own is one flag for the request)
            config["use_audio_in_video"] = MultiModalFieldConfig.batched("video", keep_on_cpu=True)
        return config

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        _, merge = _vision(hf_config)
        return _item_tokens(item["video_grid_thw"], merge)

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return _grid_item_rows(tensors, self.modality)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"video_grid_thw={item['video_grid_thw'].tolist()}"


class TimestampedVideo(ModalitySpec):
    """Videos through the Qwen3-VL vision tower: each temporal patch a frame group of its own,
    introduced by its time as text.

    The HF processor (``Qwen3VLProcessor.replace_video_token``) expands a video of patch grid
    (t, h, w) into t groups ``<T seconds><|vision_start|>`` + ``h*w / merge**2`` placeholders +
    ``<|vision_end|>``, T the group's mean frame time to one decimal (``<0.5 seconds>``): so one
    video is t runs of its placeholder, and ``t*h*w / merge**2`` tokens take its embeddings. vLLM
    0.32 lays a raw video out the same way (``Qwen3VLMultiModalProcessor.get_video_repl``): one
    span from the first timestamp to the last ``<|vision_end|>``, only the placeholders embedded.
    ``locate`` finds that span, and checks every group: its timestamp (the tokens the tokenizer gives
    the text on its own, as both processors tokenize it), its delimiters and its placeholders.

    Positions: every group's placeholders take ``max(h, w)/merge`` M-RoPE positions from the one
    after the text before them, with temporal index 0 (``Qwen3VLForConditionalGeneration.
    get_mrope_input_positions``); time is told by the timestamps alone. A video thus takes no more
    positions than tokens: the table bounds a request by ``max_model_len`` (``rotary_positions``
    with ``positions_factor`` 1, as vLLM builds it for this language model), and only the grid
    needs checking.
    """

    modality = "video"
    TIMESTAMP = re.compile(r"<\d+\.\d seconds>")
    """A group's time, as both processors write it (``f"<{seconds:.1f} seconds>"``)."""
    MAX_TIMESTAMP_TOKENS = 32
    """Tokens a timestamp may take (the text is ~14 characters): how far ``locate`` looks back."""

    def __init__(
        self,
        placeholder_token: str,
        *,
        start_token: str = "<|vision_start|>",
        end_token: str = "<|vision_end|>",
        positions_factor: int = 1,
    ) -> None:
        self.placeholder_token = placeholder_token
        self.start_token, self.end_token = start_token, end_token
        self.positions_factor = positions_factor
        self.fields = (
            FieldSpec(
                "pixel_values_videos",
                "float32",
                ("patches", "patch_dim"),
                "normalized patches of all videos, flattened as the HF video processor outputs "
                "them: sum of t*h*w rows, channels*temporal_patch_size*patch_size**2 columns",
            ),
            FieldSpec(
                "video_grid_thw",
                "int64",
                ("videos", 3),
                "patch grid (t, h, w) of each video (t: temporal patches, each a timestamped frame "
                "group in the prompt), in prompt order",
            ),
        )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        self.validate_layout(data, hf_config, patches="pixel_values_videos")

    def validate_layout(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, patches: str | None = None
    ) -> None:
        grid = data["video_grid_thw"]
        patch_dim, merge = _vision(hf_config)
        _check_grid("video", grid, merge, rotary_positions(hf_config, self.positions_factor))
        if patches is not None:
            _check_patches("video", patches, data[patches], grid, patch_dim)

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        return {
            "pixel_values_videos": MultiModalFieldConfig.flat_from_sizes(
                "video", _patches_per_item(data["video_grid_thw"])
            ),
            "video_grid_thw": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        _, merge = _vision(hf_config)
        return _item_tokens(item["video_grid_thw"], merge)

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return _grid_item_rows(tensors, self.modality)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"video_grid_thw={item['video_grid_thw'].tolist()}"

    def placeholder_runs(self, tensors: Mapping[str, Any], items: int) -> int:
        grid = tensors.get("video_grid_thw")
        return items if grid is None else sum(t for t, _, _ in _grid_rows(np.asarray(grid)))

    def locate(
        self, prompt_ids: Sequence[int], items: Any, *, token_id: int, hf_config: PretrainedConfig, tokenizer: Any
    ) -> list[Any]:
        from mmserve.passthrough.placeholders import placeholder_runs
        from mmserve.vllm_seam import Placement

        ids = np.asarray(prompt_ids, dtype=np.int64)
        start_id, end_id = (
            tokenizer.convert_tokens_to_ids(self.start_token),
            tokenizer.convert_tokens_to_ids(self.end_token),
        )
        _, merge = _vision(hf_config)
        grids = [_grid_rows(items.get(i)["video_grid_thw"].reshape(1, 3))[0] for i in range(len(items))]
        runs = placeholder_runs(ids, token_id)
        groups = sum(t for t, _, _ in grids)
        if len(runs) != groups:
            raise ProcessedInputError(
                "video",
                field="prompt_token_ids",
                expected=f"{groups} run(s) of {self.placeholder_token}: one per temporal patch (t of each video's "
                f"video_grid_thw {[list(g) for g in grids]}), each after its timestamp and {self.start_token}",
                found=f"{len(runs)} run(s) with lengths {[n for _, n in runs][:16]}",
                hint="the prompt must be expanded by the same processor that produced the tensors",
            )
        placements = []
        at = 0
        for index, (t, h, w) in enumerate(grids):
            per_group = h * w // merge**2
            first: int | None = None
            previous_end: int | None = None
            for group in range(t):
                offset, length = runs[at + group]
                where = f"temporal patch {group} ({self.placeholder_token} run at offset {offset})"
                if length != per_group:
                    raise ProcessedInputError(
                        "video",
                        item=index,
                        field="prompt_token_ids",
                        expected=f"{per_group} {self.placeholder_token} tokens per temporal patch "
                        f"(h*w/{merge * merge} of video_grid_thw={[t, h, w]})",
                        found=f"{length} in {where}",
                    )
                if (
                    offset == 0
                    or ids[offset - 1] != start_id
                    or offset + length >= ids.size
                    or ids[offset + length] != end_id
                ):
                    raise ProcessedInputError(
                        "video",
                        item=index,
                        field="prompt_token_ids",
                        expected=f"every temporal patch's placeholders between {self.start_token} and {self.end_token}",
                        found=f"other tokens around {where}",
                    )
                stamp = self._timestamp(ids, offset - 1, previous_end, tokenizer)
                if stamp is None:
                    raise ProcessedInputError(
                        "video",
                        item=index,
                        field="prompt_token_ids",
                        expected=f"a timestamp ('<1.5 seconds>', tokenized on its own) right before the "
                        f"{self.start_token} of every temporal patch"
                        + (f", and nothing else after the {self.end_token} of the one before" if group else ""),
                        found=f"none before {where}",
                    )
                first = stamp if first is None else first
                previous_end = offset + length
            assert first is not None and previous_end is not None  # t >= 1: _check_grid
            placements.append(
                Placement(first, previous_end + 1 - first, (ids[first : previous_end + 1] == token_id).tolist())
            )
            at += t
        return placements

    def _timestamp(self, ids: np.ndarray, start: int, previous_end: int | None, tokenizer: Any) -> int | None:
        """Where the timestamp before the ``<|vision_start|>`` at ``start`` begins: the shortest run
        of tokens before it whose text is a timestamp and which the tokenizer gives that text (the
        whole gap after ``previous_end``, the ``<|vision_end|>`` of the group before, if any)."""
        if previous_end is not None:
            candidates = [previous_end + 1] if previous_end + 1 < start else []
        else:
            candidates = list(range(start - 1, max(start - self.MAX_TIMESTAMP_TOKENS, 0) - 1, -1))
        for begin in candidates:
            tokens = ids[begin:start].tolist()
            text = tokenizer.decode(tokens)
            if self.TIMESTAMP.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == tokens:
                return begin
        return None


@dataclass(frozen=True)
class AudioInVideo:
    """The Omni families' videos with their audio track (the HF processor's ``use_audio_in_video``):
    the video's placeholder becomes vision start + audio start + the video's and the audio's
    embeddings interleaved by time + audio end + vision end, and the request's audio items are the
    videos' tracks, in order. ``layout`` (``"module:function"``) gives the tokens from audio start to
    audio end as vLLM's own processor writes them: Qwen2.5-Omni's in 2-s chunks
    (``passthrough.models.qwen2_5_omni.omni_audio_in_video_tokens``, the default), Qwen3-Omni's token
    by token (``passthrough.models.qwen3_omni.qwen3_omni_audio_in_video_tokens``); ``video_token`` and
    ``audio_token`` name the config's attributes of their ids, ``markers`` the start tokens (for
    errors). As in vLLM 0.32 (whose processor drops the placeholders of other audio then), all
    videos of a request share their audio or none do, and no other audio comes with them."""

    layout: str = "mmserve.passthrough.models.qwen2_5_omni:omni_audio_in_video_tokens"
    video_token: str = "video_token_index"
    audio_token: str = "audio_token_index"
    markers: str = "<|vision_bos|><|audio_bos|>"

    @functools.cached_property
    def _layout(self) -> Callable[..., list[int]]:
        """``layout``, imported once (on the first video with its audio: it imports vLLM's model)."""
        module, name = self.layout.split(":")
        return getattr(importlib.import_module(module), name)

    def placements(self, prompt_ids: Sequence[int], videos: Any, audios: Any, hf_config: PretrainedConfig) -> Any:
        """``{"video": [...], "audio": [...]}`` (``vllm_seam.Placement``) when the videos share
        their audio (``videos``, ``audios``: ``ProcessedItems``), else None. Raises
        ``ProcessedInputError``."""
        from mmserve.vllm_seam import Placement

        layout = self._layout

        flags = [bool(videos.get(i).get("use_audio_in_video", False)) for i in range(len(videos))]
        if not any(flags):
            return None
        if not all(flags):
            raise ProcessedInputError(
                "video",
                field="use_audio_in_video",
                expected="the same for every video of a request (vLLM takes audio in video per request)",
                found=str(flags),
            )
        audio_tokens = audios.expected_tokens() if audios is not None else []
        if len(audio_tokens) != len(flags):
            raise ProcessedInputError(
                "audio",
                expected=f"{len(flags)} audio item(s): the track of each video, in order (use_audio_in_video)",
                found=f"{len(audio_tokens)}",
            )
        ids = np.asarray(prompt_ids, dtype=np.int64)
        starts = np.flatnonzero(
            (ids[1:] == hf_config.audio_start_token_id) & (ids[:-1] == hf_config.vision_start_token_id)
        )
        starts += 1
        if len(starts) != len(flags):
            raise ProcessedInputError(
                "video",
                field="prompt_token_ids",
                expected=f"{len(flags)} {self.markers} span(s) (one per video with its audio)",
                found=f"{len(starts)}",
                hint="the prompt must be expanded by the same processor, with use_audio_in_video",
            )
        video_id, audio_id = getattr(hf_config, self.video_token), getattr(hf_config, self.audio_token)
        out: dict[str, list[Any]] = {"video": [], "audio": []}
        covered = 0
        for index, start in enumerate(starts.tolist()):
            item = videos.get(index)
            want = layout(
                hf_config, audio_tokens[index], item["video_grid_thw"].tolist(), float(item["second_per_grid_ts"])
            )
            got = ids[start : start + len(want) + 1].tolist()
            if got != [*want, hf_config.vision_end_token_id]:
                at = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got) - 1)
                found = got[at] if at < len(got) else "the end of the prompt"
                raise ProcessedInputError(
                    "video",
                    item=index,
                    field="prompt_token_ids",
                    expected=f"{len(want)} tokens from audio start to audio end, then vision end: the "
                    f"video's and the audio's interleaved by time (video_grid_thw={item['video_grid_thw'].tolist()}, "
                    f"{audio_tokens[index]} audio tokens)",
                    found=f"token {found} at offset {start + at}",
                )
            mask = np.asarray(want)
            out["video"].append(Placement(start, len(want), (mask == video_id).tolist()))
            out["audio"].append(Placement(start, len(want), (mask == audio_id).tolist()))
            covered += int((mask == video_id).sum() + (mask == audio_id).sum())
        stray = int(np.isin(ids, (video_id, audio_id)).sum()) - covered
        if stray:
            raise ProcessedInputError(
                "audio",
                field="prompt_token_ids",
                expected="no other video or audio placeholders with use_audio_in_video (as vLLM 0.32)",
                found=f"{stray} more",
            )
        return out


def whisper_output_length(mel_frames: int) -> int:
    """Encoder outputs for ``mel_frames`` valid mel frames: two stride-2 reductions (conv, pooling)."""
    after_conv = (mel_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def qwen3_omni_output_length(mel_frames: int) -> int:
    """Qwen3-Omni's audio encoder outputs for ``mel_frames`` valid mel frames: 13 per whole window of
    100 frames (three stride-2 convolutions), and the rest's through the same convolutions (the HF
    processor's ``_get_feat_extract_output_lengths`` with ``n_window`` 50)."""
    rest = mel_frames % 100
    after_conv = (rest - 1) // 2 + 1
    return ((after_conv - 1) // 2 + 1 - 1) // 2 + 1 + (mel_frames // 100) * 13


def _check_valid_frames(
    field: str, index: int, length: int, max_frames: int, output_length: Callable[[int], int] = whisper_output_length
) -> None:
    """A clip's valid mel frames: at most the encoder's ``max_frames`` (its position table) and
    enough for one output (3 for Whisper's rule: 2 frames give none)."""
    if length < 2 or length > max_frames:
        raise ProcessedInputError(
            "audio", item=index, field=field, expected=f"between 2 and {max_frames} valid frames", found=f"{length}"
        )
    if output_length(length) <= 0:
        raise ProcessedInputError(
            "audio",
            item=index,
            field=field,
            expected="at least 3 valid frames (fewer give no encoder output)",
            found=f"{length}",
        )


MAX_LOG_MEL = 64.0
"""The largest magnitude of a log-mel feature ``WhisperAudio`` takes. Whisper's extractor gives
``(max(log10(mel power), its max - 8) + 4) / 4`` (the power floored at 1e-10 first): at least
(-10 + 4) / 4 = -1.5, and at most about 22 for any float32 waveform (a power spectrum of 400-sample
frames below (400 * 3.4e38)**2, log10 83). Far larger finite values overflow the audio encoder's
float32 arithmetic (1e25 did on the tiny checkpoints, Qwen2.5-Omni's and Qwen2-Audio's alike), and
the NaN keys and values it writes poison vLLM's CPU KV cache for the next, unrelated requests (which
answered token 0: ``tests/test_property_engine.py`` checks the next request after every accepted
input)."""


class WhisperAudio(ModalitySpec):
    """Audio through a Whisper-style encoder (Qwen2-Audio, Qwen2.5-Omni, Qwen3-Omni).

    One clip with ``L`` valid mel frames (``feature_attention_mask.sum()``) occupies
    ``output_length(L)`` placeholder tokens: ``((L - 1) // 2 + 1 - 2) // 2 + 1`` for Whisper's
    encoder (``whisper_output_length``), 13 per 100 frames for Qwen3-Omni's (``qwen3_omni_output_length``).

    Args:
        placeholder_token: the token that stands for one audio embedding.
        fixed_frames: the encoder needs every clip padded to exactly ``2 * max_source_positions``
            frames (Qwen2-Audio's absolute position table); otherwise any length up to that works.
        output_length: the encoder's count rule.
        enclosed_by: ``ModalitySpec.enclosed_by``.

    A clip has at most ``2 * max_source_positions`` valid frames (30 s): Whisper's position table;
    for Qwen3-Omni's encoder (positions per 100-frame window) the clip vLLM 0.32 profiles its encoder
    cache for (``Qwen3OmniMoeThinkerProcessingInfo.get_mm_max_tokens_per_item``: Qwen2-Audio's 30 s).
    """

    modality = "audio"

    def __init__(
        self,
        placeholder_token: str,
        *,
        fixed_frames: bool,
        output_length: Callable[[int], int] = whisper_output_length,
        enclosed_by: tuple[str, str] | None = None,
    ) -> None:
        self.placeholder_token = placeholder_token
        self.enclosed_by = enclosed_by
        self.fixed_frames = fixed_frames
        self.output_length = output_length
        self.fields = (
            FieldSpec(
                "input_features",
                "float32",
                ("clips", "mel_bins", "frames"),
                "log-mel features of each clip, padded to a common number of frames",
            ),
            FieldSpec(
                "feature_attention_mask",
                "int32",
                ("clips", "frames"),
                "1 for the valid frames of each clip (a prefix), 0 for padding",
            ),
        )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        features, mask = data["input_features"], data["feature_attention_mask"]
        audio = hf_config.audio_config
        clips, mel_bins, frames = features.shape
        if clips == 0:
            raise ProcessedInputError("audio", field="input_features", expected="at least one clip", found="0 clips")
        if mel_bins != audio.num_mel_bins:
            raise ProcessedInputError(
                "audio",
                field="input_features",
                expected=f"{audio.num_mel_bins} mel bins",
                found=f"shape {tuple(features.shape)}",
            )
        if features.numel() and (peak := float(features.detach().abs().max())) > MAX_LOG_MEL:
            raise ProcessedInputError(
                "audio",
                field="input_features",
                expected=f"log-mel values within [-{MAX_LOG_MEL:g}, {MAX_LOG_MEL:g}] (a Whisper feature extractor "
                "gives [-1.5, 22] for any float32 waveform)",
                found=f"{int((features.detach().abs() > MAX_LOG_MEL).sum())} value(s) beyond, up to {peak:g} in magnitude",
            )
        max_frames = 2 * audio.max_source_positions
        if self.fixed_frames and frames != max_frames:
            raise ProcessedInputError(
                "audio",
                field="input_features",
                expected=f"{max_frames} frames per clip (padded as the feature extractor does)",
                found=f"shape {tuple(features.shape)}",
            )
        if tuple(mask.shape) != (clips, frames):
            raise ProcessedInputError(
                "audio",
                field="feature_attention_mask",
                expected=f"shape {(clips, frames)} (clips, frames of input_features)",
                found=f"shape {tuple(mask.shape)}",
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ProcessedInputError(
                "audio",
                field="feature_attention_mask",
                expected="only 0 and 1",
                found=f"values {sorted(set(mask.unique().tolist()))[:6]}",
            )
        lengths = mask.sum(-1).tolist()
        for index, length in enumerate(lengths):
            if not bool(mask[index, :length].all()):
                raise ProcessedInputError(
                    "audio",
                    item=index,
                    field="feature_attention_mask",
                    expected="a prefix of ones followed by zeros",
                    found="ones after a zero",
                )
            self.check_clip_frames("feature_attention_mask", index, length, hf_config)

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        return {
            "input_features": MultiModalFieldConfig.batched("audio"),
            "feature_attention_mask": MultiModalFieldConfig.batched("audio"),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return self.output_length(int(item["feature_attention_mask"].sum()))

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.ones(len(tensors["feature_attention_mask"]), dtype=np.int64)  # a clip per row

    def check_clip_frames(self, field: str, index: int, length: int, hf_config: PretrainedConfig) -> None:
        """A clip of ``length`` valid mel frames, whatever the form its features take."""
        _check_valid_frames(field, index, length, 2 * hf_config.audio_config.max_source_positions, self.output_length)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"{int(item['feature_attention_mask'].sum())} valid mel frames"

    def max_item_seconds(self, checkpoint_config: Mapping[str, Any], processor: Any) -> float | None:
        """``validate``'s bound, ``2 * max_source_positions`` valid frames (30 s for every Qwen audio
        encoder), in seconds of the feature extractor's hop. The feature extractor's own window may
        be longer (Qwen2.5-Omni-7B's is 300 s)."""
        audio = _find_audio_config(checkpoint_config)
        extractor = getattr(processor, "feature_extractor", None)
        positions = (audio or {}).get("max_source_positions")
        hop, rate = getattr(extractor, "hop_length", None), getattr(extractor, "sampling_rate", None)
        if not (positions and hop and rate):
            return None
        return 2 * int(positions) * int(hop) / int(rate)

    def processor_kwargs(self, processor: Any, items: Sequence[Any]) -> dict[str, Any]:
        """Pad the clips to just past the longest one instead of the 30-s window (unless
        ``fixed_frames``): the feature extractor's cost is that of the padded length (a 3-s clip:
        ~20x less), and the values of every valid frame are bit-identical.

        Why identical: Whisper's log-mel runs a centered STFT (``n_fft`` window, reflect padding of
        ``n_fft // 2`` at both ends) over the clip followed by zeros. With at least
        ``n_fft // 2 + 1`` zeros past the longest clip, every frame sees the same samples as in the
        30-s window (the reflected tail is zeros too), and the clamp to ``max - 8`` uses the same
        maximum (silent frames give the floor, -10, in both). ``tests/test_serving.py`` checks it
        against the processor's default.
        """
        extractor = getattr(processor, "feature_extractor", None)
        if self.fixed_frames or extractor is None or not items:
            return {}
        hop, n_fft, window = extractor.hop_length, extractor.n_fft, extractor.n_samples
        needed = max(len(clip) for clip in items) + n_fft // 2 + 1
        samples = -(-needed // hop) * hop  # whole frames: as many mask entries as feature frames
        return {"audio_kwargs": {"max_length": samples}} if samples < window else {}

    def compact(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Frames past the longest clip's valid ones cut (unless ``fixed_frames``): the feature
        extractor pads every clip to its 30-s window (3000 frames, 1.5 MB a clip), and the encoder
        reads the valid frames only (vLLM packs ``input_features[mask]`` before it runs)."""
        features, mask = data.get("input_features"), data.get("feature_attention_mask")
        if self.fixed_frames or features is None or mask is None or features.size == 0:
            return dict(data)
        frames = int(np.asarray(mask).sum(-1).max())
        if frames <= 0 or frames >= features.shape[-1]:
            return dict(data)
        return {
            **data,
            "input_features": np.ascontiguousarray(features[..., :frames]),
            "feature_attention_mask": np.ascontiguousarray(mask[..., :frames]),
        }


def _find_audio_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``audio_config`` of a checkpoint's ``config.json``, wherever the family nests it
    (Qwen2-Audio: at the top; Qwen2.5-Omni: under ``thinker_config``)."""
    if isinstance(config.get("audio_config"), Mapping):
        return config["audio_config"]
    for value in config.values():
        if isinstance(value, Mapping):
            found = _find_audio_config(value)
            if found is not None:
                return found
    return None


# -- the encoders' outputs in place of their inputs (encoder offload: mmserve.encoder) ------------
def _vision_embedding_width(hf_config: PretrainedConfig) -> tuple[int, str]:
    """Values per row of a vision tower's output, and what they are: the language model's hidden
    size, times 1 + the DeepStack levels where the tower has them (Qwen3-VL: the merger's output, then
    each level's, as vLLM's tower concatenates them and its model splits them)."""
    hidden = hidden_size(hf_config)
    levels = len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or ())
    if levels:
        return hidden * (1 + levels), f"the language model's hidden size {hidden} x (1 + {levels} DeepStack levels)"
    return hidden, "the language model's hidden size"


class VisionEmbeddings(ModalitySpec):
    """Images or videos as the vision tower's output (``{modality}_embeds``: one row per placeholder
    token, the merger's output) with the same grid fields as ``features``, the patches' spec: what
    ``mm_llm`` takes when the encoder ran apart (``model_repository_encoder/encode``)."""

    def __init__(self, features: QwenVisionImage | QwenVisionVideo | TimestampedVideo) -> None:
        self.features = features
        self.modality = features.modality
        self.placeholder_token = features.placeholder_token
        self.embeds = f"{self.modality}_embeds"
        self.patches = features.fields[0].name
        self.fields = (
            FieldSpec(
                self.embeds,
                "float32",
                ("tokens", "hidden"),
                f"the vision tower's output for all {self.modality}s (encoder offload), in place of "
                f"{self.patches}: one row per placeholder token, the language model's hidden size",
            ),
            *features.fields[1:],
        )
        self.wire_fields = features.wire_fields if self.modality == "video" else ()

    def wire_decoder(self, model: str | Path) -> WireDecoder | None:
        return self.features.wire_decoder(model) if self.wire_fields else None

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        self.features.validate_layout(data, hf_config)
        grid = data[f"{self.modality}_grid_thw"]
        _, merge = _vision(hf_config)
        rows = sum(t * h * w // merge**2 for t, h, w in _grid_rows(grid))
        rule = f"sum of t*h*w/{merge * merge} over {self.modality}_grid_thw"
        width = _vision_embedding_width(hf_config)
        check_embeddings(self.modality, self.embeds, data[self.embeds], rows, hf_config, rule, width)

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        _, merge = _vision(hf_config)
        sizes = _patches_per_item(data[f"{self.modality}_grid_thw"]) // merge**2
        config = dict(self.features.fields_config(data, hf_config))
        del config[self.patches]
        return {self.embeds: MultiModalFieldConfig.flat_from_sizes(self.modality, sizes), **config}

    def validate_limits(
        self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig, *, max_model_len: int
    ) -> None:
        self.features.validate_limits(data, hf_config, max_model_len=max_model_len)

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return self.features.expected_tokens(item, hf_config)

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return self.features.describe_item(item)

    def locate(
        self, prompt_ids: Sequence[int], items: Any, *, token_id: int, hf_config: PretrainedConfig, tokenizer: Any
    ) -> list[Any]:
        return self.features.locate(prompt_ids, items, token_id=token_id, hf_config=hf_config, tokenizer=tokenizer)

    def placeholder_runs(self, tensors: Mapping[str, Any], items: int) -> int:
        return self.features.placeholder_runs(tensors, items)


class ClipAudio(Protocol):
    """What ``AudioEmbeddings`` needs of the features' spec: ``WhisperAudio``, Audio Flamingo 3's
    ``WindowedAudio``."""

    placeholder_token: str
    enclosed_by: tuple[str, str] | None

    def output_length(self, mel_frames: int) -> int: ...

    def check_clip_frames(self, field: str, index: int, length: int, hf_config: PretrainedConfig) -> None: ...


class AudioEmbeddings(ModalitySpec):
    """Clips as the audio tower's output (``audio_embeds``: one row per placeholder token) with each
    clip's valid mel frames (``audio_feature_lengths``, which the LLM's positions need): what
    ``mm_llm`` takes when the encoder ran apart."""

    modality = "audio"

    def __init__(self, features: ClipAudio) -> None:
        self.features = features
        self.placeholder_token = features.placeholder_token
        self.enclosed_by = features.enclosed_by
        self.fields = (
            FieldSpec(
                "audio_embeds",
                "float32",
                ("tokens", "hidden"),
                "the audio tower's output for all clips (encoder offload), in place of "
                "input_features: one row per placeholder token, the language model's hidden size",
            ),
            FieldSpec(
                "audio_feature_lengths",
                "int64",
                ("clips",),
                "valid mel frames of each clip (feature_attention_mask.sum(-1), over all its windows where "
                "the family cuts clips into windows), in prompt order",
            ),
        )

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        lengths = data["audio_feature_lengths"]
        if lengths.shape[0] == 0:
            raise ProcessedInputError(
                "audio", field="audio_feature_lengths", expected="at least one clip", found="0 clips"
            )
        frames = lengths.tolist()  # exact integers
        for index, length in enumerate(frames):
            self.features.check_clip_frames("audio_feature_lengths", index, length, hf_config)
        rows = sum(self.features.output_length(length) for length in frames)
        rule = f"{getattr(self.features.output_length, '__name__', 'the encoder rule')}(L) per clip of L valid frames"
        check_embeddings("audio", "audio_embeds", data["audio_embeds"], rows, hf_config, rule)

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        import torch

        from mmserve.vllm_seam import MultiModalFieldConfig

        sizes = torch.tensor([self.features.output_length(n) for n in data["audio_feature_lengths"].tolist()])
        return {
            "audio_embeds": MultiModalFieldConfig.flat_from_sizes("audio", sizes),
            "audio_feature_lengths": MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return self.features.output_length(int(item["audio_feature_lengths"]))

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"{int(item['audio_feature_lengths'])} valid mel frames"
