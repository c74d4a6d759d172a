"""The independent test oracle: HF transformers run on raw inputs.

Nothing here shares code with the serving path: the HF processor turns raw media and the chat-templated
prompt into model inputs, and the HF model decodes greedily in float32 on the CPU. Tests compare what
the served model returns with :meth:`HFReference.generate`, and what the preprocessing produced with
:meth:`HFReference.processor_inputs`.

Example::

    ref = HFReference("qwen2_5_vl", "models/qwen2_5_vl")
    prompt = chat_prompt("qwen2_5_vl", ref.processor, ["image", "text:Describe."])
    token_ids = ref.generate(prompt, images=[pil_image], max_new_tokens=16)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmserve_dev.samples import AUDIO_SAMPLE_RATE
from mmserve_dev.tiny_models import FAMILY_NAMES


@contextmanager
def _quiet_transformers():
    """Silence transformers' warnings for the duration (restores the previous verbosity).

    Reading a Qwen2.5-Omni config makes transformers 5.19 build and validate a *default* talker
    config, which warns about token ids that only the real 7B vocabulary has (the checkpoint's own
    talker config is consistent, and nothing here uses the talker).
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def load_processor(path: str | Path):
    """The HF processor (``AutoProcessor``) saved in the checkpoint directory ``path``."""
    from transformers import AutoProcessor

    with _quiet_transformers():
        return AutoProcessor.from_pretrained(str(path))


def chat_prompt(family_name: str, processor, parts: Sequence[str], *, system: str | None = None) -> str:
    """The chat-templated prompt text for one user turn made of ``parts``, in order.

    ``parts`` items are ``"image"``, ``"audio"``, ``"video"`` or ``"text:<the text>"``; the prompt ends
    with the assistant generation prompt. ``family`` is checked against the modalities it supports.
    """
    supported = {
        "qwen2_5_omni": {"image", "audio", "video"},
        "qwen3_omni": {"image", "audio", "video"},
        "qwen2_5_vl": {"image", "video"},
        "qwen2_audio": {"audio"},
        "qwen3_vl": {"image", "video"},
        "qwen3_5": {"image", "video"},
        "qwen3_vl_moe": {"image", "video"},
        "internvl": {"image", "video"},
        "audioflamingo3": {"audio"},
    }[family_name]
    content: list[dict[str, Any]] = []
    for part in parts:
        if part.startswith("text:"):
            content.append({"type": "text", "text": part[len("text:") :]})
        elif part in supported:
            content.append({"type": part})
        else:
            raise ValueError(f"{family_name} does not take a {part!r} part (expected text:... or {sorted(supported)})")
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": content})
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _model_class(family_name: str):
    import transformers

    if family_name == "qwen2_5_vl":
        return transformers.Qwen2_5_VLForConditionalGeneration
    if family_name == "qwen2_audio":
        return transformers.Qwen2AudioForConditionalGeneration
    if family_name == "qwen2_5_omni":
        return transformers.Qwen2_5OmniThinkerForConditionalGeneration
    if family_name == "qwen3_omni":
        return transformers.Qwen3OmniMoeThinkerForConditionalGeneration
    if family_name == "qwen3_vl":
        return transformers.Qwen3VLForConditionalGeneration
    if family_name == "qwen3_5":
        return transformers.Qwen3_5ForConditionalGeneration
    if family_name == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeForConditionalGeneration
    if family_name == "internvl":
        return transformers.InternVLForConditionalGeneration
    if family_name == "audioflamingo3":
        return transformers.AudioFlamingo3ForConditionalGeneration
    raise ValueError(f"unknown family {family_name!r}; expected one of {FAMILY_NAMES}")


class HFReference:
    """HF processor + HF model of one checkpoint, float32, eval mode, CPU."""

    def __init__(self, family_name: str, path: str | Path):
        import torch

        if family_name not in FAMILY_NAMES:
            raise ValueError(f"unknown family {family_name!r}; expected one of {FAMILY_NAMES}")
        self.family_name = family_name
        self.path = Path(path)
        self.processor = load_processor(self.path)
        kwargs: dict[str, Any] = {"dtype": torch.float32, "output_loading_info": True}
        if family_name in ("qwen2_5_omni", "qwen3_omni"):
            # The directory holds the full Omni config (what vLLM wants); the thinker is loaded
            # on its own from it: its config is the thinker sub-config, and its weights are the
            # checkpoint's "thinker." keys (HF strips the thinker's base_model_prefix).
            from transformers import AutoConfig

            with _quiet_transformers():
                kwargs["config"] = AutoConfig.from_pretrained(str(self.path)).thinker_config
        model, info = _model_class(family_name).from_pretrained(str(self.path), **kwargs)
        # A key-naming mismatch shows up as missing + unexpected keys (HF would silently leave those
        # weights randomly initialized): refuse it. Talker / token2wav weights are not the thinker's.
        missing = sorted(info.get("missing_keys") or [])
        mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
        unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not k.startswith(("talker.", "token2wav.")))
        if missing or mismatched or unexpected:
            raise RuntimeError(
                f"{family_name} checkpoint at {self.path} did not load cleanly: missing={missing[:8]} "
                f"unexpected={unexpected[:8]} mismatched={mismatched[:8]}"
            )
        self.model = model.eval().to(torch.float32)
        self.tokenizer = self.processor.tokenizer

    # -------------------------------------------------------------------------------------------
    def processor_inputs(
        self,
        prompt_text: str,
        images: Sequence[Any] | None = None,
        audios: Sequence[Any] | None = None,
    ):
        """Exactly what the HF processor makes of the raw inputs (``BatchFeature`` of torch tensors).

        ``input_ids`` come back with every media placeholder expanded; images add ``pixel_values`` and
        ``image_grid_thw``, audio ``input_features`` and ``feature_attention_mask``.
        """
        kwargs: dict[str, Any] = {"text": [prompt_text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = list(images)
        if audios:
            kwargs["audio"] = [_as_waveform(a) for a in audios]
            kwargs["sampling_rate"] = AUDIO_SAMPLE_RATE
        return self.processor(**kwargs)

    def generate(
        self,
        prompt_text: str,
        images: Sequence[Any] | None = None,
        audios: Sequence[Any] | None = None,
        max_new_tokens: int = 16,
        *,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Greedy decoding (``do_sample=False``); returns only the new token ids.

        Stops at the checkpoint's EOS tokens (``generation_config.json``) unless ``ignore_eos``, which
        always yields ``max_new_tokens`` tokens (vLLM's ``SamplingParams(ignore_eos=True)``).
        """
        import copy

        import torch

        inputs = self.processor_inputs(prompt_text, images=images, audios=audios)
        prompt_len = inputs["input_ids"].shape[1]
        generation_config = copy.deepcopy(self.model.generation_config)
        generation_config.do_sample = False
        generation_config.temperature = None
        generation_config.top_p = None
        generation_config.top_k = None
        generation_config.max_new_tokens = max_new_tokens
        if ignore_eos:
            generation_config.eos_token_id = []  # None would be refilled from the model defaults
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=generation_config)
        sequences = out.sequences if hasattr(out, "sequences") else out
        return [int(t) for t in sequences[0, prompt_len:].tolist()]


def _as_waveform(audio: Any):
    """A mono float32 waveform at 16 kHz; ``(array, rate)`` pairs must already be at 16 kHz."""
    import numpy as np

    if isinstance(audio, tuple):
        audio, rate = audio
        if int(rate) != AUDIO_SAMPLE_RATE:
            raise ValueError(f"audio must be at {AUDIO_SAMPLE_RATE} Hz (got {rate}); resample it first")
    wave = np.asarray(audio, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"audio must be a mono 1-D waveform, got shape {wave.shape}")
    return wave
