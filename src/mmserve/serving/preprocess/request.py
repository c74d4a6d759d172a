"""One ``preprocess`` request read from its Triton input tensors (what the adapter calls)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmserve.serving.preprocess.limits import PreprocessError


@dataclass
class PreprocessRequest:
    """The arguments of ``Preprocessor.__call__``, read from a request's tensors."""

    text: str | bytes | None
    images: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)
    pcm: list[tuple[np.ndarray, int]] = field(default_factory=list)
    apply_chat_template: bool = True
    messages: str | bytes | None = None
    videos: list[Any] = field(default_factory=list)
    tools: str | bytes | None = None
    use_audio_in_video: bool = False

    def kwargs(self) -> dict[str, Any]:
        """The fields by name: the call's keyword arguments (no copy of the arrays)."""
        return dict(vars(self))


def parse_preprocess_request(get: Callable[[str], np.ndarray | None]) -> PreprocessRequest:
    """Read one request through ``get(name) -> array | None`` (None: an optional input not sent).

    The prompt stays bytes: the ``Preprocessor`` decodes UTF-8 and names a bad byte.
    """
    text, messages = get("text_input"), get("messages")
    if text is None and messages is None:
        raise PreprocessError("text_input: required (BYTES [1], the prompt), or messages (BYTES [1], a conversation)")
    if text is not None and text.size != 1:
        raise PreprocessError(f"text_input: expected exactly one prompt string, found {text.size}")
    if messages is not None and messages.size != 1:
        raise PreprocessError(f"messages: expected exactly one JSON string, found {messages.size}")
    tools = get("tools")
    if tools is not None and tools.size != 1:
        raise PreprocessError(f"tools: expected exactly one JSON string, found {tools.size}")
    pcm = get("audio_pcm")
    clips = []
    if pcm is not None and pcm.size:
        rate = get("audio_sample_rate")
        if rate is None or rate.size != 1:
            raise PreprocessError("audio_sample_rate: required (INT32 [1]) with audio_pcm")
        clips.append((pcm.reshape(-1), int(rate.reshape(-1)[0])))
    template, audio_in_video = get("apply_chat_template"), get("use_audio_in_video")
    return PreprocessRequest(
        text=None if text is None else text.reshape(-1)[0],
        images=_items(get("image")),
        audios=_items(get("audio")),
        pcm=clips,
        apply_chat_template=True if template is None or template.size == 0 else bool(template.reshape(-1)[0]),
        messages=None if messages is None else messages.reshape(-1)[0],
        videos=_items(get("video")),
        tools=None if tools is None else tools.reshape(-1)[0],
        use_audio_in_video=audio_in_video is not None
        and audio_in_video.size > 0
        and bool(audio_in_video.reshape(-1)[0]),
    )


def _items(array: np.ndarray | None) -> list[Any]:
    return [] if array is None else list(array.reshape(-1))
