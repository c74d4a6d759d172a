"""Qwen2-Audio's fix of vLLM 0.32's model class: its tower's output as the project's encoded form."""

from __future__ import annotations

from typing import Any


class Qwen2AudioEmbeddings:
    """Qwen2-Audio fed its audio tower's output as the project's encoded form (``audio_embeds`` of
    all clips, rows in order, with ``audio_feature_lengths``): split per clip by the tower's rule.
    vLLM 0.32's own ``audio_embeds`` (one tensor per clip, from ``--enable-mm-embeds``) is left as
    it is. Audio Flamingo 3's too (its tower is Qwen2-Audio's, run per 30-s window: a clip's rows are
    its windows' one after the other, as many as the rule gives for the clip's valid frames together).
    Ends with a vLLM release that takes a family's embeddings of all items in one tensor with their
    lengths (no upstream issue asks for it: the project's form, docs/upstream-vllm.md)."""

    def _parse_and_validate_audio_input(self, **kwargs: object) -> Any:
        if kwargs.get("audio_embeds") is not None and kwargs.get("audio_feature_lengths") is not None:
            return {
                "type": "audio_embeds",
                "audio_embeds": kwargs["audio_embeds"],
                "audio_feature_lengths": kwargs["audio_feature_lengths"],
            }
        return super()._parse_and_validate_audio_input(**kwargs)  # type: ignore[misc]

    def _process_audio_input(self, audio_input: Any) -> Any:
        if not isinstance(audio_input, dict):  # vLLM's own inputs (a TensorSchema), features or embeddings
            return super()._process_audio_input(audio_input)  # type: ignore[misc]
        return audio_input["audio_embeds"].split(audio_rows(self, audio_input["audio_feature_lengths"]))


def audio_rows(model: Any, lengths: Any) -> list[int]:
    """Rows of each clip of ``lengths`` valid mel frames, by the model's audio tower's own rule."""
    _, sizes = model.audio_tower._get_feat_extract_output_lengths(lengths.reshape(-1))
    return [int(n) for n in sizes.tolist()]
