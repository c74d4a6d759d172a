"""Qwen3-Omni's fixes of vLLM 0.32's thinker: a video with its audio track under chunked prefill, the
encoders' outputs in place of the features; and vLLM's own layout of such a video (which the
pass-through checks prompts against)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mmserve.passthrough.models.qwen2_5_omni import OmniEmbeddings

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def spans_mix_audio_and_video(is_video: torch.Tensor, is_audio: torch.Tensor, num_video: int, num_audio: int) -> bool:
    """Whether a run of adjacent video and audio placeholders in the step holds both (one video's
    span with its audio): vLLM's ``check_interleaved_audio_video`` with "holds both" for "interleaves"."""
    import torch

    if num_video == 0 or num_audio == 0:
        return False
    pads = (is_video | is_audio).nonzero(as_tuple=True)[0]
    span = torch.cat([pads.new_zeros(1), (pads.diff() != 1).cumsum(0)])  # the span of each placeholder
    spans = int(span[-1]) + 1
    video = torch.bincount(span, weights=is_video[pads].to(torch.float32), minlength=spans)
    audio = torch.bincount(span, weights=is_audio[pads].to(torch.float32), minlength=spans)
    return bool(((video > 0) & (audio > 0)).any())


class Qwen3OmniAudioInVideo:
    """vLLM 0.32's Qwen3-Omni thinker merges a step's embeddings by modality (each to its own tokens,
    DeepStack levels to the vision tokens) only where the step's video and audio placeholders
    interleave (``check_interleaved_audio_video``: video before the last audio and audio before the
    last video). A chunked prefill step that holds the audio placeholders of a video's span before the
    span's next video ones (or the reverse) does not interleave by that test, and the step's
    embeddings are merged in the items' order instead: video rows into audio tokens (greedy tokens
    then differ from the same prompt prefilled at once, and from HF's:
    ``tests/test_family_qwen3_omni.py::test_parity_with_hf``, raw path and pass-through alike). Here a
    step merges by modality whenever one span holds both. Upstream: the audio-in-video fixes of
    vllm-project/vllm#33605 and #34506 left this case; ends with the vLLM release whose chunked
    prefill of such a span matches its prefill at once (that test says so)."""

    def embed_input_ids(self, input_ids: Any, multimodal_embeddings: Any = None, *, is_multimodal: Any = None) -> Any:
        from mmserve import vllm_seam as stock

        with stock.replaced(stock.QWEN3_OMNI_THINKER, "check_interleaved_audio_video", spans_mix_audio_and_video):
            return super().embed_input_ids(  # type: ignore[misc]
                input_ids, multimodal_embeddings, is_multimodal=is_multimodal
            )


class Qwen3OmniEmbeddings(OmniEmbeddings):
    """Qwen3-Omni's thinker fed the encoders' outputs (encoder offload): as Qwen2.5-Omni's, vLLM 0.32
    takes its ``image_embeds`` and ``video_embeds`` (the tower's rows with their DeepStack levels
    beside them, which its ``embed_input_ids`` splits) in one tensor for all items, and has no
    ``audio_embeds``. Its audio tower has no method for its count rule: the family's
    (``qwen3_omni_output_length``, 13 rows per 100 frames). Ends with ``OmniEmbeddings``."""

    def _audio_rows(self, lengths: Any) -> list[int]:
        from mmserve.families.qwen import qwen3_omni_output_length

        return [qwen3_omni_output_length(int(n)) for n in lengths.reshape(-1).tolist()]


def qwen3_omni_audio_in_video_tokens(
    hf_config: PretrainedConfig, audio_tokens: int, video_grid_thw: Sequence[int], second_per_grid_t: float
) -> list[int]:
    """The tokens vLLM (and HF's processor) put in place of a video's ``<|video_pad|>`` with its audio
    track: ``<|audio_start|>``, the video's and the audio's placeholders interleaved one by one by
    their time positions, ``<|audio_end|>``."""
    from mmserve.vllm_seam import Qwen3OmniMoeThinkerMultiModalProcessor

    # An instance method that reads nothing of its instance.
    return list(
        Qwen3OmniMoeThinkerMultiModalProcessor.get_updates_use_audio_in_video(
            None, hf_config, audio_tokens, list(video_grid_thw), second_per_grid_t
        )
    )
