"""The bounds on one request (``PreprocessLimits``), the error every rejection raises, and the
torch threads of one ``preprocess`` instance."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mmserve.errors import InputError

MiB = 1 << 20


class PreprocessError(InputError):
    """A request the preprocessing cannot turn into model inputs (bad media, bad prompt, a limit)."""


ITEM_COUNTS = {"max_images": "image", "max_audio_clips": "audio", "max_videos": "video"}
"""The limits on items per request, by modality: the engine's ``limit_mm_per_prompt`` is their
default and ceiling."""


@dataclass(frozen=True)
class PreprocessLimits:
    """Bounds on one request; each field is also a config.pbtxt parameter of the same name.

    See the package docstring (``mmserve.serving.preprocess``) for what each one bounds and why.
    """

    max_request_bytes: int = 64 * MiB
    max_images: int = 4
    max_image_pixels: int = 16_777_216
    max_audio_clips: int = 2
    max_audio_seconds: float | None = None
    """``None``: the feature extractor's window (``n_samples / sampling_rate``)."""
    max_total_audio_seconds: float = 60.0
    max_prompt_tokens: int = 32_768
    max_messages: int = 64
    max_videos: int = 1
    max_video_seconds: float = 60.0
    max_video_frames: int = 256
    max_video_frame_pixels: int = 2_073_600
    max_decoded_bytes: int = 256 * MiB
    """Bytes decoding may create for one request: RGB of its images and of the video frames the
    processor keeps, float32 samples of its audio files (all channels), each counted before it is
    allocated."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "max_audio_seconds":
                continue
            kind = int if field.type == "int" else (int, float)
            least = 0 if field.name == "max_videos" else 1  # 0 videos: video refused (the engine's limit 0)
            if isinstance(value, bool) or not isinstance(value, kind) or not (value > 0 or value == least == 0):
                expected = "a positive integer" if kind is int else "a positive number"
                expected = "an integer >= 0" if least == 0 else expected
                raise ValueError(f"{field.name}: expected {expected}, found {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{field.name}: expected a finite number, found {value!r}")

    @classmethod
    def from_parameters(
        cls, parameters: Mapping[str, str], engine_mm_limits: Mapping[str, int] | None = None
    ) -> PreprocessLimits:
        """The limits set among Triton model ``parameters`` (string values; other keys ignored).

        An absent or empty value keeps the default; ``max_audio_seconds`` also takes ``"window"``.
        ``engine_mm_limits`` (the engine's ``limit_mm_per_prompt``, ``mmserve.inputs.mm_limits``)
        is the default of ``max_images`` and ``max_audio_clips`` and their ceiling: a request the
        engine would refuse is refused here, before any decoding.
        """
        values: dict[str, Any] = {}
        for field in fields(cls):
            text = str(parameters.get(field.name, "")).strip()
            if not text or (field.name == "max_audio_seconds" and text == "window"):
                continue
            seconds = field.name.endswith("_seconds")
            try:
                values[field.name] = float(text) if seconds else int(text)
            except ValueError:
                kind = "a number of seconds" if seconds else "an integer"
                raise ValueError(f"parameter {field.name}: expected {kind}, found {text!r}") from None
        for name, modality in ITEM_COUNTS.items():
            engine = (engine_mm_limits or {}).get(modality)
            if engine is None:
                continue
            if name not in values:
                values[name] = engine
            elif values[name] > engine:
                raise ValueError(
                    f"parameter {name}: {values[name]} exceeds the engine's limit_mm_per_prompt "
                    f"of {engine} {modality} items (mm_llm/model.json); leave it empty to follow it"
                )
        return cls(**values)


def instance_memory_bound(limits: PreprocessLimits, feature_bytes_per_token: int) -> int:
    """The most one ``preprocess`` instance's resident memory grows above its idle size for any one
    request ``limits`` accept (docs/RELIABILITY.md, Limits; measured by tests/test_media_budget.py):

    * 4 x ``max_decoded_bytes``: the decoded media (RGB of the images and of the video frames kept,
      float32 samples of the audio files, all counted before they are decoded) and the HF
      processor's working copies of them (its resize works on float32 copies of the pixels);
    * 3 x ``max_prompt_tokens`` x ``feature_bytes_per_token``: the processor's float32 output and
      its working copies (every image and video placeholder token is counted before decoding);
    * 256 MiB: what is decoded one image or frame at a time, the decoders' own buffers, the
      feature extractor's work on the audio, the allocator's slack.

    ``feature_bytes_per_token``: bytes of processor features per placeholder token; Qwen vision
    (Qwen2.5-VL, Qwen2.5-Omni): merge² x temporal patch x patch² x 3 channels x 4 bytes = 18816.
    """
    return 4 * limits.max_decoded_bytes + 3 * limits.max_prompt_tokens * feature_bytes_per_token + 256 * MiB


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: what a container or taskset grants)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_instance(setting: str | int | None, instances: int, cores: int | None = None) -> int:
    """torch threads for one ``preprocess`` instance (config.pbtxt parameter ``torch_threads``).

    ``"auto"`` (or empty): the cores shared out among the model's ``instances``, at least one, so
    that instances working at once don't oversubscribe the cores (torch's default, one thread per
    core in *every* instance, does). A positive integer is used as it is.
    """
    text = str(setting if setting is not None else "").strip()
    if text in ("", "auto"):
        return max(1, (cores or available_cores()) // max(1, instances))
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads <= 0:
        raise ValueError(f"parameter torch_threads: expected 'auto' or a positive integer, found {text!r}")
    return threads
