"""A checkpoint's encoder towers on their own: the vision tower (images, videos) and the audio tower,
loaded from the same local checkpoint without the language model's weights, on any torch device
and dtype. Needs torch, transformers and safetensors only (no vLLM, no Triton): the first piece of
running the encoders apart from the engine (issue: encoder offload), and what ``bench/encode_gpu.py``
runs on a GPU.

The embeddings are the model's own: the tower modules of transformers, fed the HF processor's
feature tensors (what ``preprocess`` outputs), giving what the full model computes before it merges
them into the prompt (``tests/test_encoder.py`` checks equality with the HF model's
``get_image_features``/``get_audio_features``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.families import TowerSpec
from mmserve.inputs import family_of_checkpoint

if TYPE_CHECKING:
    import torch


class Towers:
    """The encoder towers of the checkpoint at ``path`` (its family's ``towers``)."""

    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: Any = None) -> None:
        import torch
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        self.path = Path(path)
        self.family = family_of_checkpoint(self.path)
        if not self.family.towers:
            raise ValueError(f"{self.family.name}: no encoder towers declared (FamilySpec.towers)")
        self.device, self.dtype = torch.device(device), dtype or torch.float32
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # an Omni config warns of its (unused) talker's token ids
        try:
            config = AutoConfig.from_pretrained(str(self.path))
        finally:
            hf_logging.set_verbosity(verbosity)
        self.modules: dict[str, torch.nn.Module] = {}
        for tower in self.family.towers:
            module = _load(tower, config, self.path).to(device=self.device, dtype=self.dtype).eval()
            for modality in tower.modalities:
                self.modules[modality] = module

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.modules)

    def image(self, pixel_values: Any, image_grid_thw: Any) -> torch.Tensor:
        """One row per placeholder token of all the images, in order (the merger's output)."""
        return self._vision("image", pixel_values, image_grid_thw)

    def video(self, pixel_values_videos: Any, video_grid_thw: Any) -> torch.Tensor:
        return self._vision("video", pixel_values_videos, video_grid_thw)

    def audio(self, input_features: Any, feature_attention_mask: Any) -> torch.Tensor:
        """One row per placeholder token of all the clips, in order: the valid frames of each clip
        (``feature_attention_mask``) through the audio tower, as the model reads them."""
        import torch

        tower = self._tower("audio")
        features = self._tensor(input_features).to(self.dtype)
        mask = self._tensor(feature_attention_mask).bool()
        lengths = mask.sum(-1)
        valid = features.permute(0, 2, 1)[mask].permute(1, 0)
        after_cnn, _ = tower._get_feat_extract_output_lengths(lengths)
        with torch.inference_mode():
            return tower(valid, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state

    def _vision(self, modality: str, pixels: Any, grid: Any) -> torch.Tensor:
        import torch

        tower = self._tower(modality)
        with torch.inference_mode():
            out = tower(self._tensor(pixels).to(self.dtype), grid_thw=self._tensor(grid))
        return out.pooler_output

    def _tower(self, modality: str) -> torch.nn.Module:
        if modality not in self.modules:
            raise ValueError(f"{self.family.name}: no tower for {modality} (towers for {sorted(self.modules)})")
        return self.modules[modality]

    def _tensor(self, value: Any) -> torch.Tensor:
        import torch

        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
        return tensor.to(self.device)


def _load(tower: TowerSpec, config: Any, path: Path) -> torch.nn.Module:
    """The tower built from its sub-config, with its weights alone read from the safetensors."""
    from safetensors import safe_open

    for name in tower.config_path:
        config = getattr(config, name)
    module_name, class_name = tower.hf_class.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    config._attn_implementation = "sdpa"  # what from_pretrained picks on its own
    module = cls._from_config(config)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if key.startswith(tower.weights_prefix):
                    state[key[len(tower.weights_prefix) :]] = weights.get_tensor(key)
    if not state:
        raise ValueError(f"{path}: no weights under {tower.weights_prefix!r}")
    module.load_state_dict(state, strict=True)
    return module


def encode(towers: Towers, tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Embeddings per modality of ``preprocess``'s decoded outputs (``Preprocessor.decode_wire``):
    ``{"image": ..., "video": ..., "audio": ...}`` for the modalities present."""
    from mmserve.families.base import numel

    out = {}
    if "image" in towers.modules and numel(tensors.get("image_grid_thw")):
        out["image"] = towers.image(tensors["pixel_values"], tensors["image_grid_thw"])
    if "video" in towers.modules and numel(tensors.get("video_grid_thw")):
        out["video"] = towers.video(tensors["pixel_values_videos"], tensors["video_grid_thw"])
    if "audio" in towers.modules and numel(tensors.get("feature_attention_mask")):
        out["audio"] = towers.audio(tensors["input_features"], tensors["feature_attention_mask"])
    return out
