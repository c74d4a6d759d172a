"""Qwen2.5-Omni's fixes of vLLM 0.32's thinker: a video with its audio track (its embeddings merge and
its M-RoPE positions), the encoders' outputs in place of the features; and vLLM's own layout of a video
with its audio, which the pass-through checks prompts against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.passthrough.models.qwen2_audio import audio_rows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class OmniAudioInVideo:
    """Two fixes of vLLM 0.32's Qwen2.5-Omni thinker for a video with its audio track
    (``use_audio_in_video``), on the raw path and the pass-through alike: the embeddings merge of a
    chunked prefill step (``embed_input_ids``), and the M-RoPE positions as HF transformers computes
    them (``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index``, the model's
    reference) over vLLM's ``get_mrope_input_positions``:

    vLLM 0.32 places the span ``<|audio_bos|> (video and audio chunks) <|audio_eos|>`` one token
    late: it gives ``<|audio_bos|>`` the first chunk's position where HF gives it
    ``<|vision_bos|>``'s, so every later position is off by one token and the last two tokens of
    the span are counted as text (the greedy tokens then differ from HF's:
    ``tests/test_passthrough_video.py::test_omni_audio_in_video_parity_with_hf``). Positions of
    everything else are vLLM's, computed as its own method computes them. Upstream: audio in video
    is vllm-project/vllm#23888; #33605 ("Fix audio-in-video support for Qwen2.5-Omni and Qwen3-Omni")
    is the last fix of it merged, and 0.32 still places ``<|audio_bos|>`` a token late. Ends with the
    vLLM release that gets both right (the two tests say so)."""

    def embed_input_ids(self, input_ids: Any, multimodal_embeddings: Any = None, *, is_multimodal: Any = None) -> Any:
        """With video and audio tokens in the step, each modality's embeddings go to its own tokens
        (vLLM's ``merge_interleaved_embeddings``). vLLM 0.32 does so only when the step's tokens
        interleave (``check_interleaved_audio_video``): a chunked prefill step holding the end of a
        video chunk and the start of the audio chunk after it is merged in the embeddings' order
        instead, audio rows into video tokens
        (``tests/test_passthrough_chunked.py::test_a_video_with_its_audio_under_chunked_prefill_matches_hf``)."""
        from mmserve import vllm_seam as stock

        if multimodal_embeddings and is_multimodal is not None:
            config = self.config  # type: ignore[attr-defined]
            with stock.gpu_sync_allowed():
                ids = input_ids.cpu()
                is_video = is_multimodal & (ids == config.video_token_index)
                is_audio = is_multimodal & (ids == config.audio_token_index)
                both = bool(is_video.any()) and bool(is_audio.any())
            if both:
                embeds = self._embed_text_input_ids(  # type: ignore[attr-defined]
                    input_ids,
                    self.get_language_model().embed_input_ids,  # type: ignore[attr-defined]
                    is_multimodal=is_multimodal,
                )
                return stock.merge_interleaved_embeddings(
                    embeds, multimodal_embeddings, is_video, is_audio, is_multimodal
                )
        return super().embed_input_ids(  # type: ignore[misc]
            input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Any, int]:
        import torch

        if not any(f.modality == "video" and shares_audio(f) for f in mm_features):
            return super().get_mrope_input_positions(input_tokens, mm_features)  # type: ignore[misc]
        positions: list[np.ndarray] = []
        done = 0  # tokens placed

        def start() -> int:
            return int(positions[-1].max()) + 1 if positions else 0

        def text(count: int) -> None:
            if count > 0:
                positions.append(np.broadcast_to(np.arange(count), (3, count)) + start())

        for offset, modality, data in self.iter_mm_features(mm_features):  # type: ignore[attr-defined]
            text(offset - done)
            if modality == "audio":
                count = self._compute_audio_token_count(data["audio_feature_length"])  # type: ignore[attr-defined]
                positions.append(np.broadcast_to(np.arange(count), (3, count)) + start())
                done = offset + count
            elif modality == "video" and data["use_audio_in_video"]:
                bos = start() - 1  # <|audio_bos|> at <|vision_bos|>'s position
                chunks, count = self._compute_interleaved_positions(bos + 1, data)  # type: ignore[attr-defined]
                positions += [np.full((3, 1), bos), chunks, np.full((3, 2), int(chunks.max()) + 1)]
                done = offset + count + 3  # <|audio_bos|>, the chunks, <|audio_eos|><|vision_eos|> (one position)
            else:  # an image, a video without its audio
                grid = np.indices((data["grid_t"], data["grid_h"], data["grid_w"]))
                if data["t_factor"] != 1.0:
                    grid[0] = (grid[0] * data["t_factor"]).astype(np.int64)
                positions.append(grid.reshape(3, -1) + start())
                done = offset + grid[0].size
        text(len(input_tokens) - done)
        merged = np.concatenate(positions, axis=1).reshape(3, -1)
        return torch.from_numpy(merged), int(merged.max()) + 1 - len(input_tokens)


class OmniEmbeddings:
    """Qwen2.5-Omni's thinker fed the encoders' outputs (encoder offload: ``qwen.VisionEmbeddings``,
    ``qwen.AudioEmbeddings``). vLLM 0.32 takes ``image_embeds`` and ``video_embeds`` but hands them
    on as one tensor for all items of a batch, where the engine wants one per item (its Qwen2.5-VL
    splits them by grid, as here), and has no ``audio_embeds`` (the audio tower always runs). No
    upstream issue asks for it (found none); ends with the vLLM release that splits them and takes
    audio embeddings (docs/upstream-vllm.md; ``tests/test_passthrough_omni.py`` says so)."""

    def _parse_and_validate_multimodal_inputs(self, **kwargs: object) -> dict[str, Any]:
        inputs = super()._parse_and_validate_multimodal_inputs(**kwargs)  # type: ignore[misc]
        if kwargs.get("audio_embeds") is not None:  # one modality per batch (vLLM groups them so)
            inputs["audio"] = {
                "type": "audio_embeds",
                "audio_embeds": kwargs["audio_embeds"],
                "audio_feature_lengths": kwargs["audio_feature_lengths"],
            }
        return inputs

    def _process_image_input(self, image_input: Any) -> Any:
        if image_input["type"] != "image_embeds":
            return super()._process_image_input(image_input)  # type: ignore[misc]
        return self._split_vision(image_input["image_embeds"], image_input["image_grid_thw"])

    def _process_video_input(self, video_input: Any) -> Any:
        if video_input["type"] != "video_embeds":
            return super()._process_video_input(video_input)  # type: ignore[misc]
        return self._split_vision(video_input["video_embeds"], video_input["video_grid_thw"])

    def _process_audio_input(self, audio_input: Any) -> Any:
        if audio_input["type"] != "audio_embeds":
            return super()._process_audio_input(audio_input)  # type: ignore[misc]
        return audio_input["audio_embeds"].split(self._audio_rows(audio_input["audio_feature_lengths"]))

    def _audio_rows(self, lengths: Any) -> list[int]:
        """Rows of each clip of ``lengths`` valid mel frames: the audio tower's own rule."""
        return audio_rows(self, lengths)

    def _split_vision(self, embeds: Any, grid_thw: Any) -> Any:
        merge = self.visual.spatial_merge_size  # type: ignore[attr-defined]
        sizes = (grid_thw.reshape(-1, 3).prod(-1) // merge // merge).tolist()
        return embeds.type(self.visual.dtype).split(sizes)  # type: ignore[attr-defined]


def omni_audio_in_video_tokens(
    hf_config: PretrainedConfig, audio_tokens: int, video_grid_thw: Sequence[int], second_per_grid_t: float
) -> list[int]:
    """The tokens vLLM (and HF's processor) put in place of a video's ``<|VIDEO|>`` with its audio
    track: ``<|audio_bos|>``, the video's and the audio's embeddings in chunks by time,
    ``<|audio_eos|>``."""
    from mmserve.vllm_seam import Qwen2_5OmniThinkerMultiModalProcessor

    return list(
        Qwen2_5OmniThinkerMultiModalProcessor.omni_get_updates_use_audio_in_video(
            hf_config, audio_tokens, list(video_grid_thw), second_per_grid_t
        )
    )


def shares_audio(feature: Any) -> bool:
    flag = feature.data.get("use_audio_in_video") if feature.data is not None else None
    return flag is not None and bool(flag.data.reshape(-1)[0])
