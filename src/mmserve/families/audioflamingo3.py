"""Audio Flamingo 3 (NVIDIA; transformers' format, ``AudioFlamingo3ForConditionalGeneration``): audio
through a Whisper encoder, ``<sound>`` placeholders.

A family with audio outside Qwen, whose clips are not one encoder window each: its processor cuts a
clip into 30-s windows (up to ``max_audio_len``, 600 s: 20 windows), each one row of log-mel features
padded to 3000 frames, and writes one run of ``<sound>`` for the whole clip, counted on the clip's
valid frames together. What the processor outputs lacks the windows per clip (vLLM's
``chunk_counts``): ``preprocess`` takes them from its own cut of the samples (``complete``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.errors import ProcessedInputError
from mmserve.families.base import FamilySpec, FieldSpec, ModalitySpec, TowerSpec
from mmserve.families.qwen import MAX_LOG_MEL, AudioEmbeddings, whisper_output_length

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


class WindowedAudio(ModalitySpec):
    """Clips cut into whole encoder windows (``2 * max_source_positions`` mel frames, 30 s).

    One clip of windows with ``L`` valid frames together occupies ``whisper_output_length(L)``
    placeholder tokens (the HF processor's rule). Every window but a clip's last is whole: then the
    encoder's outputs per window add up to exactly that count."""

    modality = "audio"
    max_item_seconds_replaces_window = True
    max_items = 1  # its processor: "Got 1 text but 2 audios; they must match 1:1"

    def __init__(self, placeholder_token: str = "<sound>") -> None:
        self.placeholder_token = placeholder_token
        self.fields = (
            FieldSpec(
                "input_features",
                "float32",
                ("windows", "mel_bins", "frames"),
                "log-mel features of each 30-s window of every clip, in prompt order, padded to the "
                "encoder's whole window",
            ),
            FieldSpec(
                "feature_attention_mask",
                "int32",
                ("windows", "frames"),
                "1 for the valid frames of each window (a prefix), 0 for padding (the HF processor's "
                "input_features_mask)",
            ),
            FieldSpec(
                "chunk_counts",
                "int64",
                ("clips",),
                "windows of each clip, in prompt order (vLLM's name; preprocess cuts the clips as the processor does)",
            ),
        )

    def max_item_seconds(self, checkpoint_config: Mapping[str, Any], processor: Any) -> float | None:
        """The processor's ``max_audio_len``: it truncates longer clips silently, preprocess refuses them."""
        seconds = getattr(processor, "max_audio_len", None)
        return float(seconds) if seconds else None

    def validate(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> None:
        features, mask, counts = data["input_features"], data["feature_attention_mask"], data["chunk_counts"]
        audio = hf_config.audio_config
        windows, mel_bins, frames = features.shape
        whole = 2 * int(audio.max_source_positions)
        if windows == 0 or counts.shape[0] == 0:
            raise ProcessedInputError("audio", field="chunk_counts", expected="at least one clip", found="none")
        if mel_bins != audio.num_mel_bins or frames != whole:
            raise ProcessedInputError(
                "audio",
                field="input_features",
                expected=f"(windows, {audio.num_mel_bins}, {whole}): mel bins, and every window padded to the "
                "encoder's whole window",
                found=f"shape {tuple(features.shape)}",
            )
        if features.numel() and (peak := float(features.detach().abs().max())) > MAX_LOG_MEL:
            raise ProcessedInputError(
                "audio",
                field="input_features",
                expected=f"log-mel values within [-{MAX_LOG_MEL:g}, {MAX_LOG_MEL:g}]",
                found=f"values up to {peak:g} in magnitude",
            )
        if tuple(mask.shape) != (windows, frames):
            raise ProcessedInputError(
                "audio",
                field="feature_attention_mask",
                expected=f"shape {(windows, frames)} (windows, frames of input_features)",
                found=f"shape {tuple(mask.shape)}",
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ProcessedInputError(
                "audio", field="feature_attention_mask", expected="only 0 and 1", found="other values"
            )
        valid = mask.sum(-1).tolist()
        for window, length in enumerate(valid):
            if length < 1 or not bool(mask[window, :length].all()):
                raise ProcessedInputError(
                    "audio",
                    field="feature_attention_mask",
                    expected=f"each window's valid frames a prefix of at least one (window {window})",
                    found=f"{length} ones" if length < 1 else "ones after a zero",
                )
        clips = counts.tolist()  # exact integers
        if any(count < 1 for count in clips) or sum(clips) != windows:
            raise ProcessedInputError(
                "audio",
                field="chunk_counts",
                expected=f"positive counts of windows summing to the {windows} windows of input_features",
                found=str(clips[:16]),
            )
        start = 0
        for index, count in enumerate(clips):
            lengths = valid[start : start + count]
            if any(length != whole for length in lengths[:-1]):
                raise ProcessedInputError(
                    "audio",
                    item=index,
                    field="feature_attention_mask",
                    expected=f"{whole} valid frames in every window of a clip but its last (the processor's cut)",
                    found=str(lengths[:-1][:8]),
                )
            self.check_clip_frames("feature_attention_mask", index, sum(lengths), hf_config)
            start += count

    def check_clip_frames(self, field: str, index: int, length: int, hf_config: PretrainedConfig) -> None:
        """A clip of ``length`` valid mel frames over all its windows: at least one placeholder, at
        most the language model's positions."""
        positions = int(hf_config.get_text_config().max_position_embeddings)
        tokens = self.output_length(length)
        if not 1 <= tokens <= positions:
            raise ProcessedInputError(
                "audio",
                item=index,
                field=field,
                expected=f"between 1 and {positions} placeholder tokens (at least 3 valid frames; the "
                "language model's positions)",
                found=f"{tokens} from {length} valid frames",
            )

    def output_length(self, mel_frames: int) -> int:
        """Placeholders of a clip of ``mel_frames`` valid frames over all its windows (whole but the
        last): Whisper's rule, which adds up over whole windows (3000 frames: 750)."""
        return whisper_output_length(mel_frames)

    def item_rows(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(tensors["chunk_counts"], dtype=np.int64)  # each clip's windows

    def fields_config(self, data: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> Mapping[str, Any]:
        from mmserve.vllm_seam import MultiModalFieldConfig

        counts = data["chunk_counts"]
        return {
            "input_features": MultiModalFieldConfig.flat_from_sizes("audio", counts, dim=0),
            "feature_attention_mask": MultiModalFieldConfig.flat_from_sizes("audio", counts, dim=0),
            "chunk_counts": MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
        }

    def expected_tokens(self, item: Mapping[str, torch.Tensor], hf_config: PretrainedConfig) -> int:
        return self.output_length(int(item["feature_attention_mask"].sum()))

    def describe_item(self, item: Mapping[str, torch.Tensor]) -> str:
        return f"{int(item['chunk_counts'])} window(s), {int(item['feature_attention_mask'].sum())} valid mel frames"

    def complete(
        self,
        processed: Mapping[str, Any],
        input_ids: np.ndarray,
        token_id: int,
        *,
        processor: Any = None,
        items: Sequence[Any] = (),
    ) -> dict[str, Any]:
        out = dict(processed)
        if "input_features_mask" in out:
            out["feature_attention_mask"] = np.asarray(out.pop("input_features_mask"), dtype=np.int32)
        out.pop("num_audio_tokens", None)
        if "input_features" in out and "chunk_counts" not in out:
            out["chunk_counts"] = np.array(windows(processor, items), dtype=np.int64)
        return out


def windows(processor: Any, clips: Sequence[np.ndarray]) -> list[int]:
    """Windows per clip, as ``AudioFlamingo3Processor._process_audio`` cuts them: ``chunk_length``
    seconds each, at least one, at most ``max_audio_len / chunk_length``."""
    extractor = processor.feature_extractor
    window = int(extractor.sampling_rate * extractor.chunk_length)
    most = int(processor.max_audio_len // extractor.chunk_length)
    return [min(max(1, -(-len(clip) // window)), most) for clip in clips]


_AUDIO = WindowedAudio()

AUDIO_FLAMINGO_3 = FamilySpec(
    name="audioflamingo3",
    stock_architectures=("AudioFlamingo3ForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughAudioFlamingo3",
    vllm_model="vllm.model_executor.models.audioflamingo3:AudioFlamingo3ForConditionalGeneration",
    modalities=(_AUDIO,),
    processor_tensors="pt",  # "AudioFlamingo3Processor only supports `return_tensors='pt'`"
    # each clip's rows, its windows' valid rows one after the other (vLLM 0.32 takes audio_embeds)
    encoded=(AudioEmbeddings(_AUDIO),),
    towers=(
        TowerSpec(
            ("audio",),
            "transformers.models.audioflamingo3.modeling_audioflamingo3:AudioFlamingo3Encoder",
            ("audio_config",),
            "audio_tower.",
            projector=(
                "transformers.models.audioflamingo3.modeling_audioflamingo3:AudioFlamingo3MultiModalProjector",
                "multi_modal_projector.",
            ),
            padded=True,
        ),
    ),
    model_mixins=("mmserve.passthrough.models.qwen2_audio:Qwen2AudioEmbeddings",),
)
