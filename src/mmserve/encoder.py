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

import collections
import hashlib
import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.families import TowerSpec
from mmserve.families.base import numel
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
        self._takes: dict[str, frozenset[str]] = {}  # each tower's forward parameters, read once
        self.projectors: dict[str, torch.nn.Module] = {}
        self.specs: dict[str, TowerSpec] = {}
        for tower in self.family.towers:
            module = _load(tower, config, self.path).to(device=self.device, dtype=self.dtype).eval()
            takes = frozenset(inspect.signature(module.forward).parameters)
            projector = _load_projector(tower, config, self.path)
            for modality in tower.modalities:
                self.modules[modality], self.specs[modality], self._takes[modality] = module, tower, takes
                if projector is not None:
                    self.projectors[modality] = projector.to(device=self.device, dtype=self.dtype).eval()
        # the config above the towers' (the projectors', the language model's width: every embedding's)
        parent = config
        for name in self.family.towers[0].config_path[:-1]:
            parent = getattr(parent, name)
        self.parent_config = parent
        self.hidden_size = int(parent.get_text_config().hidden_size)

    def merge_size(self, modality: str) -> int:
        """Patches merged into one embedding, per side (the vision tower's ``spatial_merge_size``)."""
        return int(self._tower(modality).config.spatial_merge_size)

    def vision_rows(self, modality: str, per_item: Any) -> list[int]:
        """Embeddings of each image or video, from its row of the modality's second field: Qwen's
        ``t*h*w / merge**2`` of its grid; a tiles tower's ``image_seq_length`` per tile."""
        per_item = np.asarray(per_item, dtype=np.int64)
        if self.specs[modality].tiles:
            return [int(n) * int(self.parent_config.image_seq_length) for n in per_item.reshape(-1)]
        merge = self.merge_size(modality)
        return [int(n) // merge**2 for n in per_item.reshape(-1, 3).prod(-1)]

    def audio_rows(self, valid_frames: Sequence[int]) -> list[int]:
        """Embeddings of clips of ``valid_frames`` mel frames each: the family's count rule (the
        clip's over all its windows, where the family cuts clips into windows)."""
        spec = self.family.modality("audio")
        return [int(spec.output_length(int(n))) for n in valid_frames]  # type: ignore[union-attr]

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.modules)

    def image(self, pixel_values: Any, per_item: Any) -> torch.Tensor:
        """One row per placeholder token of all the images, in order: the tower's output (after its
        merger, or pixel shuffle and projector). ``per_item``: the grids (Qwen), the tiles (InternVL)."""
        return self._vision("image", pixel_values, per_item)

    def video(self, pixel_values_videos: Any, video_grid_thw: Any) -> torch.Tensor:
        return self._vision("video", pixel_values_videos, video_grid_thw)

    def audio(self, input_features: Any, feature_attention_mask: Any) -> torch.Tensor:
        """One row per placeholder token of all the rows of ``input_features`` (clips, or windows of
        them), in order: the valid frames of each (``feature_attention_mask``) as the model reads them."""
        import torch

        tower = self._tower("audio")
        features = self._tensor(input_features).to(self.dtype)
        mask = self._tensor(feature_attention_mask).bool()
        lengths = mask.sum(-1)
        takes = self._takes["audio"]
        with torch.inference_mode():
            if not self.specs["audio"].padded:  # the valid frames packed together (Qwen's Omni towers)
                valid = features.permute(0, 2, 1)[mask].permute(1, 0)
                if "aftercnn_lens" in takes:  # Qwen2.5-Omni's
                    after_cnn, _ = tower._get_feat_extract_output_lengths(lengths)
                    return tower(valid, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state
                return tower(valid, feature_lens=lengths).last_hidden_state
            # the whole window, the padding masked out (as the HF model's forward does), then the
            # projector, then each row's valid outputs
            after_cnn, outputs = tower._get_feat_extract_output_lengths(lengths)
            if "input_features_mask" in takes:  # Audio Flamingo 3's: it builds the mask itself
                hidden = tower(features, input_features_mask=mask.long()).last_hidden_state
            else:  # Qwen2-Audio's
                from transformers.masking_utils import create_bidirectional_mask

                steps = (features.shape[-1] - 2) // 2 + 1
                valid_steps = (torch.arange(steps, device=self.device)[None, :] < after_cnn[:, None]).long()
                attention = create_bidirectional_mask(
                    config=tower.config,
                    inputs_embeds=torch.zeros(features.shape[0], steps, 1, dtype=self.dtype, device=self.device),
                    attention_mask=valid_steps,
                )
                hidden = tower(features, attention_mask=attention).last_hidden_state
            hidden = self.projectors["audio"](hidden)
            keep = torch.arange(hidden.shape[1], device=self.device)[None, :] < outputs[:, None]
            return hidden[keep]

    def _vision(self, modality: str, pixels: Any, per_item: Any) -> torch.Tensor:
        import torch

        tower = self._tower(modality)
        if self.specs[modality].tiles:
            return self._tiles(modality, pixels)
        with torch.inference_mode():
            out = tower(self._tensor(pixels).to(self.dtype), grid_thw=self._tensor(per_item))
        deepstack = getattr(out, "deepstack_features", None)
        if (
            deepstack
        ):  # Qwen3-VL, Qwen3-Omni: the DeepStack levels after the merger's output, as vLLM's tower gives them
            return torch.cat([out.pooler_output, *deepstack], dim=-1)
        return out.pooler_output

    def _tiles(self, modality: str, pixels: Any) -> torch.Tensor:
        """InternVL's ``get_image_features``: the tiles through the tower, the patch tokens of the
        configured layer (its class token dropped by the ``default`` strategy), pixel-shuffled by
        ``downsample_ratio``, then the projector."""
        import torch
        from transformers.models.internvl.modeling_internvl import InternVLModel

        tower, config = self._tower(modality), self.parent_config
        vision = tower.config
        size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
        tiles = self._tensor(pixels).to(self.dtype).reshape(-1, vision.num_channels, size, size)
        layer = config.vision_feature_layer
        with torch.inference_mode():
            out = tower(pixel_values=tiles, output_hidden_states=layer != -1)
            features = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
            if config.vision_feature_select_strategy == "default":
                features = features[:, 1:, :]
            side = int(features.shape[1] ** 0.5)
            features = features.reshape(features.shape[0], side, side, -1)
            features = InternVLModel.pixel_shuffle(None, features, scale_factor=config.downsample_ratio)
            features = self.projectors[modality](features.reshape(features.shape[0], -1, features.shape[-1]))
        return features.reshape(-1, features.shape[-1])

    def _tower(self, modality: str) -> torch.nn.Module:
        if modality not in self.modules:
            raise ValueError(f"{self.family.name}: no tower for {modality} (towers for {sorted(self.modules)})")
        return self.modules[modality]

    def _tensor(self, value: Any) -> torch.Tensor:
        import torch

        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        return tensor.to(self.device)


def _load(tower: TowerSpec, config: Any, path: Path) -> torch.nn.Module:
    """The tower built from its sub-config, with its weights alone read from the safetensors."""
    for name in tower.config_path:
        config = getattr(config, name)
    config._attn_implementation = "sdpa"  # what from_pretrained picks on its own
    module = _class(tower.hf_class)._from_config(config)
    module.load_state_dict(_weights(path, tower.weights_prefix), strict=True)
    return module


def _load_projector(tower: TowerSpec, config: Any, path: Path) -> torch.nn.Module | None:
    """The tower's ``projector``, built from the config above the tower's, with its weights."""
    if tower.projector is None:
        return None
    for name in tower.config_path[:-1]:
        config = getattr(config, name)
    hf_class, prefix = tower.projector
    module = _class(hf_class)(config)
    module.load_state_dict(_weights(path, prefix), strict=True)
    return module


def _class(path: str) -> Any:
    module_name, class_name = path.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _weights(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``prefix`` (the prefix removed), from its safetensors files."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = weights.get_tensor(key)
    if not state:
        raise ValueError(f"{path}: no weights under {prefix!r}")
    return state


MODALITIES = ("image", "video", "audio")


@dataclass
class CacheStats:
    """Per modality: items found in the cache, items encoded; the bytes the cache holds."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODALITIES, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODALITIES, 0))
    bytes: int = 0


class Encoder:
    """``preprocess``'s outputs -> the fields ``mm_llm`` takes in their place (the families'
    ``encoded`` forms): ``image_embeds``, ``video_embeds``, ``audio_embeds`` and
    ``audio_feature_lengths`` (each clip's valid frames, over all its windows), every one present
    (empty without items), the other outputs of ``preprocess`` (grids, tile counts, ``input_ids``)
    unchanged and not returned.

    Item by item through an LRU cache of embeddings keyed by a hash of the item's own tensors (its
    patches as sent, uint8 when they are, and grid; its valid mel frames) and bounded in bytes
    (``cache_bytes``; 0: no cache): an image that comes back in a later request (a conversation's
    earlier turns) is encoded once. The items missed are encoded together, in one call per modality.

    Args:
        towers: the checkpoint's ``Towers``.
        decoders: the family's wire decoders (``FamilySpec.wire_decoders``), for ``pixel_values_uint8``.
    """

    def __init__(
        self, towers: Towers, *, decoders: Mapping[str, Any] | None = None, cache_bytes: int = 256 << 20
    ) -> None:
        self.towers = towers
        self.decoders = dict(decoders if decoders is not None else towers.family.wire_decoders(towers.path))
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.stats = CacheStats()
        self.hidden_size = towers.hidden_size
        self.consumed = towers.family.replaced_by_encoded
        """``preprocess``'s outputs whose place the encoders' outputs take (the rest go on to ``mm_llm``)."""

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for modality in ("image", "video"):
            if modality in self.towers.modules:
                out[f"{modality}_embeds"] = self._vision(modality, tensors)
        if "audio" in self.towers.modules:
            out["audio_embeds"], out["audio_feature_lengths"] = self._audio(tensors)
        return out

    def encoded(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """``tensors`` (``preprocess``'s outputs) with the ``consumed`` features replaced by the
        encoders' outputs: what ``mm_ensemble_encoded`` hands ``mm_llm``."""
        return {**{name: value for name, value in tensors.items() if name not in self.consumed}, **self(tensors)}

    # -- vision: rows of patches (or tiles) per item, by the item's grid (or tile count) ----------
    def _vision(self, modality: str, tensors: Mapping[str, Any]) -> np.ndarray:
        # The family's fields: the patches first, then the grid (Qwen) or the tiles (InternVL) of
        # each item; a wire field may stand for the patches (uint8 ones, decoded for the items the
        # cache misses).
        spec = self.towers.family.modality(modality)
        assert spec is not None, modality
        patches, per_item_name = spec.fields[0].name, spec.fields[1].name
        pixel_names = (patches, *sorted(spec.wire_field_names & self.consumed))
        pixel_name = next((n for n in pixel_names if numel(tensors.get(n))), None)
        if pixel_name is None or not numel(tensors.get(per_item_name)):
            return np.zeros((0, self.hidden_size), np.float32)
        pixels, per_item = np.asarray(tensors[pixel_name]), np.asarray(tensors[per_item_name])
        bounds = np.concatenate([[0], np.cumsum(spec.item_rows(tensors))])
        items = [(pixels[bounds[i] : bounds[i + 1]], per_item[i : i + 1]) for i in range(len(bounds) - 1)]

        def encode(batch: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
            fields = {
                pixel_name: np.concatenate([p for p, _ in batch]),
                per_item_name: np.concatenate([g for _, g in batch]),
            }
            if pixel_name != pixel_names[0]:  # a wire field (uint8 patches): the processor's values
                fields = self.decoders[modality](fields)
            embeds = getattr(self.towers, modality)(fields[pixel_names[0]], fields[per_item_name])
            return _split(embeds, self.towers.vision_rows(modality, fields[per_item_name]))

        return self._through_cache(modality, items, encode)

    # -- audio: the rows of each clip (one, or its windows), their valid frames ------------------
    def _audio(self, tensors: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        mask = tensors.get("feature_attention_mask")
        if not numel(mask):
            return np.zeros((0, self.hidden_size), np.float32), np.zeros((0,), np.int64)
        spec = self.towers.family.modality("audio")
        assert spec is not None
        features, mask = np.asarray(tensors["input_features"]), np.asarray(mask)
        lengths = mask.sum(-1).astype(np.int64)
        bounds = np.concatenate([[0], np.cumsum(spec.item_rows(tensors))])
        # A padded tower's convolutions read the feature extractor's padding next to the valid
        # frames: such an item is its whole windows; otherwise its valid frames alone.
        whole = self.towers.specs["audio"].padded
        items = [
            (features[a:b] if whole else features[a:b, :, : lengths[a]], lengths[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]

        def encode(batch: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
            frames = max(f.shape[-1] for f, _ in batch)
            rows = np.concatenate([n for _, n in batch])
            padded = np.zeros((len(rows), batch[0][0].shape[1], frames), np.float32)
            valid = (np.arange(frames)[None, :] < rows[:, None]).astype(np.int32)
            row = 0
            for f, _ in batch:
                padded[row : row + len(f), :, : f.shape[-1]] = f
                row += len(f)
            embeds = self.towers.audio(padded, valid)
            return _split(embeds, self.towers.audio_rows([int(n.sum()) for _, n in batch]))

        clip_frames = np.array([int(n.sum()) for _, n in items], dtype=np.int64)
        return self._through_cache("audio", items, encode), clip_frames

    # -- the cache -----------------------------------------------------------------------------------
    def _through_cache(self, modality: str, items: list[tuple[np.ndarray, np.ndarray]], encode: Any) -> np.ndarray:
        keys = [_key(modality, *item) for item in items]
        found: dict[int, np.ndarray] = {}
        for index, key in enumerate(keys):
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                found[index] = hit
        missed = [index for index in range(len(items)) if index not in found]
        self.stats.hits[modality] += len(found)
        self.stats.misses[modality] += len(missed)
        if missed:
            for index, embeds in zip(missed, encode([items[i] for i in missed]), strict=True):
                found[index] = embeds
                self._store(keys[index], embeds)
        return np.concatenate([found[i] for i in range(len(items))])

    def _store(self, key: bytes, embeds: np.ndarray) -> None:
        if embeds.nbytes > self.cache_bytes:
            return
        if key not in self._cache:
            self._cache[key] = embeds
            self.stats.bytes += embeds.nbytes
        while self.stats.bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self.stats.bytes -= old.nbytes


def _key(modality: str, *arrays: np.ndarray) -> bytes:
    digest = hashlib.blake2b(modality.encode(), digest_size=16)
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.data)
    return digest.digest()


def _split(embeds: torch.Tensor, sizes: list[int]) -> list[np.ndarray]:
    rows = embeds.float().cpu().numpy()
    return np.split(rows, np.cumsum(sizes)[:-1])
