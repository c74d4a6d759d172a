"""Raw request -> the model's own HF processor output: what the ``preprocess`` Triton model runs.

Media arrive encoded (PNG/JPEG/WebP images; WAV/FLAC/OGG/MP3 audio, as file bytes) or as float32
PCM with its sample rate. Over JSON transports (Triton's HTTP generate endpoint) bytes can't travel,
so an element may also be a ``data:<mime>;base64,<...>`` URL. Errors name the input and the item.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.inputs import family_of_checkpoint
from mmserve.passthrough.placeholders import placeholder_runs
from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS, empty_feature


class PreprocessError(ValueError):
    """A request the preprocessing cannot turn into model inputs (bad media, bad prompt)."""


class Preprocessor:
    """The HF processor of one checkpoint, applied to raw requests.

    Args:
        model: local checkpoint directory (the same one ``mm_llm`` serves).
    """

    def __init__(self, model: str | Path) -> None:
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        self.model = str(model)
        self.family = family_of_checkpoint(model)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # Omni configs warn about the (unused) talker's defaults
        try:
            self.processor = AutoProcessor.from_pretrained(self.model)
        finally:
            hf_logging.set_verbosity(verbosity)
        vocab = self.processor.tokenizer.get_vocab()
        self.placeholder_ids = {
            spec.modality: (spec.placeholder_token, vocab[spec.placeholder_token])
            for spec in self.family.modalities
        }
        self.modalities = {spec.modality for spec in self.family.modalities}
        extractor = getattr(self.processor, "feature_extractor", None)
        self.sampling_rate: int | None = getattr(extractor, "sampling_rate", None)

    # -- media ---------------------------------------------------------------------------------
    @staticmethod
    def _payload(data: bytes | str, what: str) -> bytes:
        if isinstance(data, str):
            data = data.encode()
        if data.startswith(b"data:"):
            header, _, encoded = data.partition(b",")
            if not header.endswith(b";base64"):
                raise PreprocessError(f"{what}: a data URL must be base64-encoded")
            try:
                return base64.b64decode(encoded, validate=True)
            except ValueError as exc:
                raise PreprocessError(f"{what}: invalid base64 in data URL ({exc})") from None
        return data

    def decode_image(self, index: int, data: bytes | str):
        from PIL import Image, UnidentifiedImageError

        what = f"image[{index}]"
        payload = self._payload(data, what)
        try:
            with Image.open(io.BytesIO(payload)) as image:
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError):
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as an image (PNG/JPEG/WebP/...)"
            ) from None

    def decode_audio(self, index: int, data: bytes | str) -> np.ndarray:
        import soundfile

        what = f"audio[{index}]"
        payload = self._payload(data, what)
        try:
            samples, rate = soundfile.read(io.BytesIO(payload), dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as audio (WAV/FLAC/OGG/MP3): "
                f"{str(exc).rsplit(': ', 1)[-1]}"
            ) from None
        return self.resample(what, samples.mean(axis=1), rate)

    def resample(self, what: str, samples: np.ndarray, rate: int) -> np.ndarray:
        """Mono float32 at the feature extractor's rate."""
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise PreprocessError(f"{what}: expected a non-empty mono clip, found shape {samples.shape}")
        if rate <= 0:
            raise PreprocessError(f"{what}: expected a positive sample rate, found {rate}")
        if self.sampling_rate is None or rate == self.sampling_rate:
            return samples
        import soxr

        return soxr.resample(samples, rate, self.sampling_rate).astype(np.float32)

    # -- prompt --------------------------------------------------------------------------------
    def chat_prompt(self, text: str, num_images: int, num_audios: int) -> str:
        """One user turn: the images, then the audio clips, then the text; generation prompt on."""
        content: list[dict[str, Any]] = [{"type": "image"}] * num_images
        content += [{"type": "audio"}] * num_audios
        content.append({"type": "text", "text": text})
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    # -- the whole step ------------------------------------------------------------------------
    def __call__(
        self,
        text: str,
        images: Sequence[bytes | str] = (),
        audios: Sequence[bytes | str] = (),
        pcm: Sequence[tuple[np.ndarray, int]] = (),
        *,
        apply_chat_template: bool = True,
    ) -> dict[str, np.ndarray]:
        """``input_ids`` and every feature tensor of the contract, as numpy arrays."""
        if images and "image" not in self.modalities:
            raise PreprocessError(f"image: the {self.family.name} model takes no images")
        if (audios or len(pcm)) and "audio" not in self.modalities:
            raise PreprocessError(f"audio: the {self.family.name} model takes no audio")
        pil_images = [self.decode_image(i, data) for i, data in enumerate(images)]
        clips = [self.decode_audio(i, data) for i, data in enumerate(audios)]
        clips += [self.resample(f"audio_pcm[{i}]", s, r) for i, (s, r) in enumerate(pcm)]

        prompt = self.chat_prompt(text, len(pil_images), len(clips)) if apply_chat_template else text
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "np"}
        if pil_images:
            kwargs["images"] = pil_images
        if clips:
            kwargs["audio"] = clips
            kwargs["sampling_rate"] = self.sampling_rate
        try:
            processed = self.processor(**kwargs)
        except (ValueError, IndexError) as exc:  # e.g. placeholders in the text != media given
            raise PreprocessError(f"text_input: the processor rejected the prompt and media: {exc}") from None

        input_ids = np.asarray(processed["input_ids"][0], dtype=INPUT_IDS.dtype)
        given = {"image": len(pil_images), "audio": len(clips)}
        for modality, (token, token_id) in self.placeholder_ids.items():
            runs = len(placeholder_runs(input_ids, token_id))
            if runs != given[modality]:
                raise PreprocessError(
                    f"text_input: {runs} {token} placeholder(s) in the prompt, "
                    f"but {given[modality]} {modality} item(s) given"
                )
        outputs = {INPUT_IDS.name: input_ids}
        for spec in FEATURE_TENSORS:
            value = processed.get(spec.name)
            outputs[spec.name] = (
                empty_feature(spec) if value is None else np.ascontiguousarray(value, dtype=spec.dtype)
            )
        return outputs
