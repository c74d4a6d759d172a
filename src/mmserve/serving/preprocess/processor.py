"""``Preprocessor``: one checkpoint's HF processor applied to raw requests, within the limits.

The steps of a request: the request-level checks (modalities, counts, bytes: before anything is
decoded or parsed), the conversation, the media, the template (escaping control tokens), the
processor, the checks of its output (prompt tokens, one placeholder run per item, finite features).
When the processor fails, or an item yields no placeholder, each item is processed again on its own
to name the one at fault (on that error path only).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.families.base import WireDecoder
from mmserve.inputs import family_of_checkpoint
from mmserve.passthrough.placeholders import placeholder_runs
from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS
from mmserve.serving.preprocess.escaping import CONTROL_TOKEN_POLICIES, ControlTokenPolicy, ControlTokens, Run
from mmserve.serving.preprocess.limits import PreprocessError, PreprocessLimits
from mmserve.serving.preprocess.media import Clip, MediaDecoder, Video
from mmserve.serving.preprocess.messages import (
    BYTES_LIKE,
    Conversation,
    check_media_counts,
    decode_text,
    parse_messages,
    parse_tools,
    user_turn,
    without_media,
)

if TYPE_CHECKING:
    from PIL.Image import Image

MEDIA_KINDS = ("image", "audio", "video")

FALLBACK_AUDIO_SECONDS = 30.0
"""``max_audio_seconds`` when the feature extractor declares no window."""

# What the HF processor raises on inputs it can't handle; anything else is a fault of ours.
_PROCESSOR_REJECTIONS = (ValueError, IndexError, TypeError, ArithmeticError, RuntimeError)

# What the HF video processor's preprocess takes out of its keyword arguments before it samples
# frames with the rest (transformers 5.19, ``BaseVideoProcessor.preprocess``).
_NOT_FOR_SAMPLING = ("input_data_format", "do_convert_rgb", "do_sample_frames", "device", "video_metadata")


class HFProcessorPlan:
    """What the HF processor will make of a medium (``media.ProcessorPlan``), asked before the
    medium is decoded: the frames its video processor keeps (so that only those are converted and
    held) and the placeholder tokens of an image or a video (so that a request over
    ``max_prompt_tokens`` is refused before its media are decoded and processed).

    Its settings are those a processor call without media options gives the video and image
    processors (the processor's defaults merged with theirs, ``ProcessorMixin._merge_kwargs``).
    Where the video processor samples frames (``do_sample_frames``), the frames kept here go to it
    with ``do_sample_frames=False`` and their indices in the metadata (``frames_indices``): the
    frames, ``sampled_fps`` and so every output are the processor's own on the whole video. Token
    counts are the processors' own (``get_num_of_video_patches``, ``get_number_of_image_patches``,
    over merge²) where those are their outputs' counts (a resize by size alone), else unknown.
    ``tests/test_media_budget.py`` compares both with the processor's outputs.
    """

    def __init__(self, processor: Any) -> None:
        self.video_processor = getattr(processor, "video_processor", None)
        self.image_processor = getattr(processor, "image_processor", None)
        try:
            merged = processor._merge_kwargs(
                processor.valid_processor_kwargs, tokenizer_init_kwargs=processor.tokenizer.init_kwargs
            )
        except (AttributeError, TypeError, KeyError):  # a processor unlike ProcessorMixin's: nothing is known
            self.video_processor = self.image_processor = None
            merged = {"videos_kwargs": {}, "images_kwargs": {}}
        kwargs = dict(merged["videos_kwargs"])
        for name in getattr(self.video_processor, "valid_kwargs", dict).__annotations__:
            kwargs.setdefault(name, getattr(self.video_processor, name, None))
        self.samples = self.video_processor is not None and bool(kwargs.get("do_sample_frames"))
        """Whether the video processor samples frames (else it takes every frame it is given)."""
        self.video_kwargs = {name: value for name, value in kwargs.items() if name not in _NOT_FOR_SAMPLING}
        self.images_kwargs = dict(merged["images_kwargs"])

    def kept(self, total: int, fps: float, width: int, height: int) -> list[int] | None:
        processor = self.video_processor
        if not self.samples or processor is None:
            return None
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height)
        indices = processor.sample_frames(metadata=metadata, **self.video_kwargs)
        return [int(index) for index in np.asarray(indices).reshape(-1)]

    def video_tokens(self, frames: int, width: int, height: int) -> int | None:
        kwargs, processor = self.video_kwargs, self.video_processor
        count = getattr(processor, "get_num_of_video_patches", None)
        if count is None or not kwargs.get("do_resize") or kwargs.get("cap_pixels_per_frame"):
            return None  # no resize, or one bounded by the whole video's pixels: not this count
        if kwargs.get("min_pixels") is not None or kwargs.get("max_pixels") is not None:
            return None
        return self._tokens(lambda: count(frames, height, width, kwargs), kwargs.get("merge_size") or processor)

    def image_tokens(self, width: int, height: int) -> int | None:
        kwargs, processor = self.images_kwargs, self.image_processor
        count = getattr(processor, "get_number_of_image_patches", None)
        if count is None or not getattr(processor, "do_resize", False):
            return None
        if {"size", "min_pixels", "max_pixels", "do_resize", "patch_size", "merge_size"} & set(kwargs):
            return None  # call options the count does not read as the processor does
        return self._tokens(lambda: count(height, width, {}), processor)

    @staticmethod
    def _tokens(patches: Callable[[], int], merge: Any) -> int | None:
        """``patches()`` over merge² (``merge``: the size, or the processor that has it)."""
        size = merge if isinstance(merge, int) else getattr(merge, "merge_size", None)
        if not size:
            return None
        try:
            return int(patches()) // size**2
        except _PROCESSOR_REJECTIONS:  # e.g. an extreme aspect ratio: the processor will name it
            return None


class Preprocessor:
    """The HF processor of one checkpoint, applied to raw requests within ``limits``.

    Args:
        model: local checkpoint directory (the same one ``mm_llm`` serves).
        limits: bounds on one request (defaults: ``PreprocessLimits()``).
        user_control_tokens: ``"escape"`` (special-token strings in user text become plain text) or
            ``"reject"`` (they are refused); applies with the chat template only.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        limits: PreprocessLimits | None = None,
        user_control_tokens: ControlTokenPolicy = "escape",
    ) -> None:
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
        self.tokenizer = self.processor.tokenizer
        vocab = self.tokenizer.get_vocab()
        self.placeholder_ids = {
            spec.modality: (spec.placeholder_token, vocab[spec.placeholder_token]) for spec in self.family.modalities
        }
        self.modalities = {spec.modality for spec in self.family.modalities}
        # No token stands for more text than this: a longer text is surely over max_prompt_tokens.
        self.max_token_bytes = max(len(token.encode()) for token in vocab)
        extractor = getattr(self.processor, "feature_extractor", None)
        self.sampling_rate: int | None = getattr(extractor, "sampling_rate", None)
        self.audio_window_s = self._audio_window(extractor)
        every_kind = self.chat_prompt(
            "", *(int(kind in self.modalities) for kind in MEDIA_KINDS)
        )  # the template's own markers around every kind of media: never the escaping sentinel
        processor_tokens = [getattr(self.processor, f"{kind}_token", None) for kind in MEDIA_KINDS]
        try:
            self.control_tokens = ControlTokens(
                self.tokenizer, [token for token, _ in self.placeholder_ids.values()], every_kind, processor_tokens
            )
        except ValueError as exc:
            raise ValueError(f"{self.model}: {exc}") from None
        # A prompt without media or placeholders goes to the tokenizer alone where that gives the
        # processor's ids: 77 µs against the processor's 205 (Qwen2.5-Omni's; the rest is its
        # merging of keyword arguments).
        self._placeholder_strings = tuple(
            {token for token, _ in self.placeholder_ids.values()} | {token for token in processor_tokens if token}
        )
        self._tokenizer_for_text = self._tokenizer_matches_processor()
        self._min_audio_samples: int | None = None  # found on the first too-short clip
        self._wire_decoders: dict[str, WireDecoder] | None = None  # loaded by the first decode_wire
        self.plan = HFProcessorPlan(self.processor) if {"image", "video"} & self.modalities else None
        self._configure(limits or PreprocessLimits(), user_control_tokens)

    def with_settings(
        self, *, limits: PreprocessLimits | None = None, user_control_tokens: ControlTokenPolicy | None = None
    ) -> Preprocessor:
        """The same loaded processor under other limits or control-token policy (a cheap copy)."""
        other = copy.copy(self)
        other._configure(limits or self.limits, user_control_tokens or self.user_control_tokens)
        return other

    # -- setup ---------------------------------------------------------------------------------
    def _configure(self, limits: PreprocessLimits, user_control_tokens: str) -> None:
        if user_control_tokens not in CONTROL_TOKEN_POLICIES:
            raise ValueError(
                f"user_control_tokens: expected one of {list(CONTROL_TOKEN_POLICIES)}, found {user_control_tokens!r}"
            )
        self.limits = limits
        self.max_audio_seconds = self._max_audio_seconds()
        self.user_control_tokens = user_control_tokens
        self.media = MediaDecoder(limits, self.max_audio_seconds, self.audio_window_s, self.sampling_rate, self.plan)

    def _audio_window(self, extractor: Any) -> float | None:
        """The longest clip: the feature extractor's window, or less where the family's encoder
        accepts less (``ModalitySpec.max_item_seconds``)."""
        windows = []
        n_samples = getattr(extractor, "n_samples", None)
        audio = self.family.modality("audio")
        if n_samples and self.sampling_rate and not (audio is not None and audio.max_item_seconds_replaces_window):
            windows.append(n_samples / self.sampling_rate)
        if audio is not None:
            config = json.loads((Path(self.model) / "config.json").read_text())
            encoder = audio.max_item_seconds(config, self.processor)
            if encoder is not None:
                windows.append(encoder)
        return min(windows, default=None)

    def _max_audio_seconds(self) -> float:
        configured = self.limits.max_audio_seconds
        window = self.audio_window_s
        if configured is None:
            return window or FALLBACK_AUDIO_SECONDS
        if window is not None and configured > window:
            raise ValueError(
                f"max_audio_seconds: {configured} s exceeds the model's audio window of {window} s "
                "(the feature extractor would cut longer clips silently)"
            )
        return float(configured)

    # -- text ----------------------------------------------------------------------------------
    def chat_prompt(self, text: str, num_images: int, num_audios: int, num_videos: int = 0) -> str:
        """One user turn: the images, the videos, the audio clips, then the text; generation prompt on."""
        return self.render(user_turn(text, num_images, num_audios, num_videos).messages)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template on ``messages`` (HF form) and ``tools``, generation prompt on."""
        return self.processor.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=False
        )

    def _render_text_only(self, conversation: Conversation) -> str:
        """The template on the conversation with its media parts left out."""
        return self.render(without_media(conversation.messages), conversation.tools)

    def _templated(self, conversation: Conversation) -> tuple[str, list[Run] | None]:
        render = functools.partial(self.render, tools=conversation.tools)
        return self.control_tokens.template(conversation, self.user_control_tokens, render)

    # -- request-level limits ------------------------------------------------------------------
    def _check_request(
        self,
        text: object,
        images: Sequence[bytes | str],
        audios: Sequence[bytes | str],
        pcm: Sequence[tuple[np.ndarray, int]],
        messages: str | bytes | None = None,
        videos: Sequence[bytes | str] = (),
        tools: str | bytes | None = None,
    ) -> None:
        """Modalities, item counts and total size: all before anything is decoded (or parsed)."""
        limits = self.limits
        if images and "image" not in self.modalities:
            raise PreprocessError(f"image: the {self.family.name} model takes no images")
        if videos and "video" not in self.modalities:
            raise PreprocessError(f"video: the {self.family.name} model takes no video")
        if len(videos) > limits.max_videos:
            raise PreprocessError(
                f"video: {len(videos)} videos exceed the limit of {limits.max_videos} per request (max_videos)"
            )
        if (audios or pcm) and "audio" not in self.modalities:
            raise PreprocessError(f"audio: the {self.family.name} model takes no audio")
        if len(images) > limits.max_images:
            raise PreprocessError(
                f"image: {len(images)} images exceed the limit of {limits.max_images} per request (max_images)"
            )
        clips = len(audios) + len(pcm)
        if clips > limits.max_audio_clips:
            raise PreprocessError(
                f"audio: {clips} clips (audio and audio_pcm together) exceed the limit of "
                f"{limits.max_audio_clips} per request (max_audio_clips)"
            )
        for modality, count in (("image", len(images)), ("audio", clips), ("video", len(videos))):
            spec = self.family.modality(modality)
            if spec is not None and spec.max_items is not None and count > spec.max_items:
                raise PreprocessError(
                    f"{modality}: {count} items; the {self.family.name} model's processor takes at most "
                    f"{spec.max_items} per prompt"
                )
        text_bytes = _byte_size("text_input", text)
        total = text_bytes + sum(_byte_size(f"image[{i}]", item) for i, item in enumerate(images))
        total += 0 if messages is None else _byte_size("messages", messages)
        total += 0 if tools is None else _byte_size("tools", tools)
        total += sum(_byte_size(f"audio[{i}]", item) for i, item in enumerate(audios))
        total += sum(_byte_size(f"video[{i}]", item) for i, item in enumerate(videos))
        total += sum(np.asarray(samples).nbytes for samples, _ in pcm)
        if total > limits.max_request_bytes:
            raise PreprocessError(
                f"request: {total} bytes of text and media exceed the limit of {limits.max_request_bytes} "
                "(max_request_bytes)"
            )
        self._check_text_bytes("text_input", text_bytes)

    def _check_text_bytes(self, what: str, text_bytes: int) -> None:
        """Refuse a text too long for ``max_prompt_tokens`` at any tokenization, before tokenizing it."""
        limit = self.limits.max_prompt_tokens
        fewest_tokens = -(-text_bytes // self.max_token_bytes)  # without spending time to tokenize it
        if fewest_tokens > limit:
            raise PreprocessError(
                f"{what}: {text_bytes} bytes make at least {fewest_tokens} tokens, over the limit of "
                f"{limit} (max_prompt_tokens)"
            )

    def _conversation(
        self, messages: str | bytes, num_images: int, num_clips: int, num_videos: int, tools: str | bytes | None
    ) -> Conversation:
        """``messages`` (and ``tools``) parsed and checked against the request's media (before any decoding)."""
        conversation = parse_messages(messages, max_messages=self.limits.max_messages)
        check_media_counts(conversation, num_images, num_clips, num_videos)
        if tools is not None:
            conversation.tools, tool_texts = parse_tools(tools)
            conversation.structured += tool_texts
        texts = conversation.texts + conversation.structured
        self._check_text_bytes("messages", sum(len(t.text.encode()) for t in texts))
        return conversation

    # -- the processor -------------------------------------------------------------------------
    def _tokenizer_matches_processor(self) -> bool:
        """Whether the tokenizer alone gives the processor's ``input_ids`` for a prompt without media
        (checked once, on a templated one)."""
        probe = self.chat_prompt("Hello, wörld: 你好 ¿?", 0, 0)
        try:
            by_processor = self.processor(text=[probe], return_tensors="np")["input_ids"]
            by_tokenizer = self.tokenizer(text=[probe], return_tensors="np")["input_ids"]
        except _PROCESSOR_REJECTIONS:
            return False
        return bool(np.array_equal(by_processor, by_tokenizer))

    def _run_processor(
        self, prompt: str, images: Sequence[Image], clips: Sequence[np.ndarray], videos: Sequence[Video] = ()
    ) -> Mapping[str, Any]:
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": self.family.processor_tensors}
        if (
            not (images or clips or videos)
            and self._tokenizer_for_text
            and not any(token in prompt for token in self._placeholder_strings)
        ):  # nothing for the processor to expand (a prompt with placeholders: its errors, as always)
            return self.tokenizer(**kwargs)
        if videos:
            kwargs["videos"] = [video.frames for video in videos]
            kwargs["video_metadata"] = [video.metadata() for video in videos]
            # Frames as decoded: channels first (what the processor converts them to), those it keeps.
            videos_kwargs: dict[str, Any] = {"input_data_format": "channels_first"}
            if self.plan is not None and self.plan.samples:
                videos_kwargs["do_sample_frames"] = False  # sampled while decoding (HFProcessorPlan)
            kwargs["videos_kwargs"] = videos_kwargs
            tracks = [video.audio.samples for video in videos if video.audio is not None]
            if tracks:  # every video's (use_audio_in_video), and no other audio
                kwargs["use_audio_in_video"] = True
                clips = tracks
        for modality, items in (("image", images), ("audio", clips)):
            spec = self.family.modality(modality)
            if items and spec is not None:
                kwargs.update(spec.processor_kwargs(self.processor, items))
        if images:
            kwargs["images"] = list(images)
        if clips:
            kwargs["audio"] = list(clips)
            kwargs["sampling_rate"] = self.sampling_rate
        return self.processor(**kwargs)

    def _item_tokens(self, modality: str, item: Any) -> int:
        """Placeholder tokens one item yields when processed on its own (error path only)."""
        if modality == "image":
            processed = self._run_processor(self.chat_prompt("", 1, 0), [item], [])
        else:
            processed = self._run_processor(self.chat_prompt("", 0, 1), [], [item])
        _, token_id = self.placeholder_ids[modality]
        return int(np.count_nonzero(np.asarray(processed["input_ids"][0]) == token_id))

    def _blame_item(self, images: Sequence[Image], clips: Sequence[Clip], videos: Sequence[Video] = ()) -> None:
        """Raise a ``PreprocessError`` naming the first item the processor rejects on its own."""
        for index, image in enumerate(images):
            self._blame_image(f"image[{index}]", image)
        for video in videos:
            self._blame_video(video)
        for clip in clips:
            self._blame_clip(clip)

    def _blame_video(self, video: Video) -> None:
        frames, height, width = video.total_frames, video.height, video.width
        try:
            processed = self._run_processor(self.chat_prompt("", 0, 0, 1), [], [], [video])
        except _PROCESSOR_REJECTIONS as exc:
            raise PreprocessError(
                f"{video.label}: {frames} frames of {width}x{height} pixels: the processor rejects it ({exc})"
            ) from None
        _, token_id = self.placeholder_ids["video"]
        if not np.count_nonzero(np.asarray(processed["input_ids"][0]) == token_id):
            raise PreprocessError(f"{video.label}: {frames} frames of {width}x{height} pixels: no placeholder")

    def _blame_image(self, what: str, image: Image) -> None:
        width, height = image.size
        try:
            tokens = self._item_tokens("image", image)
        except _PROCESSOR_REJECTIONS as exc:
            raise PreprocessError(f"{what}: {width}x{height} pixels: the processor rejects it ({exc})") from None
        if tokens == 0:
            raise PreprocessError(f"{what}: {width}x{height} pixels: the processor gives it no placeholder")

    def _blame_clip(self, clip: Clip) -> None:
        try:
            tokens = self._item_tokens("audio", clip.samples)
        except _PROCESSOR_REJECTIONS as exc:
            raise PreprocessError(
                f"{clip.label}: a {clip.seconds:.3f} s clip: the processor rejects it ({exc})"
            ) from None
        if tokens == 0:
            # Rounded up to the millisecond: a clip of the length printed always passes.
            needed = math.ceil(self._shortest_clip(clip.samples.size) * 1000 / self._audio_rate()) / 1000
            raise PreprocessError(
                f"{clip.label}: a {clip.seconds:.3f} s clip is too short: at least {needed:.3f} s needed "
                "(shorter clips give no audio embedding)"
            )

    def _audio_rate(self) -> int:
        """The feature extractor's rate; a model that takes audio has one (clips are decoded at it)."""
        if self.sampling_rate is None:
            raise RuntimeError(f"the {self.family.name} processor has no feature extractor sampling_rate")
        return self.sampling_rate

    def _shortest_clip(self, too_short: int) -> int:
        """Fewest samples (at the model's rate) that give one audio placeholder; found once, by search.

        ``too_short``: a length known to give none.
        """
        if self._min_audio_samples is None:
            window = int((self.audio_window_s or self.max_audio_seconds) * self._audio_rate())
            low, high = too_short, min(max(2 * too_short, 1), window)  # low gives none
            while high < window and not self._item_tokens("audio", np.zeros(high, np.float32)):
                low, high = high, min(2 * high, window)
            while high - low > 1:  # low gives none, high gives some
                middle = (low + high) // 2
                if self._item_tokens("audio", np.zeros(middle, np.float32)):
                    high = middle
                else:
                    low = middle
            self._min_audio_samples = high
        return self._min_audio_samples

    def _process(
        self,
        prompt: str,
        images: Sequence[Image],
        clips: Sequence[Clip],
        *,
        raw_prompt: bool,
        text_only: Callable[[], str] | None,
        what: str = "text_input",
        videos: Sequence[Video] = (),
    ) -> Mapping[str, Any]:
        """The processor's output. ``text_only``: the templated text as the processor saw it, without
        the media (None: escaped, the processor never saw it); ``what``: the input holding the text."""
        try:
            return self._run_processor(prompt, images, [clip.samples for clip in clips], videos)
        except _PROCESSOR_REJECTIONS as exc:
            failure = exc
        # Error path: which part of the request does the processor reject?
        self._blame_item(images, clips, videos)
        if raw_prompt:  # the caller wrote the prompt, placeholders included
            raise PreprocessError(f"text_input: the processor rejected the prompt and media: {failure}") from None
        if text_only is not None:
            try:
                self._run_processor(text_only(), [], [])
            except _PROCESSOR_REJECTIONS as exc:
                raise PreprocessError(f"{what}: the processor rejects the text ({exc})") from None
        raise failure  # not the request's fault as far as can be told: an internal error

    def _check_placeholders(
        self,
        input_ids: np.ndarray,
        images: Sequence[Image],
        clips: Sequence[Clip],
        *,
        raw_prompt: bool,
        videos: Sequence[Video] = (),
        processed: Mapping[str, Any] | None = None,
    ) -> None:
        given = {"image": len(images), "audio": len(clips), "video": len(videos)}
        for modality, (token, token_id) in self.placeholder_ids.items():
            if modality in ("audio", "video") and any(video.audio is not None for video in videos):
                continue  # in chunks by time: mm_llm's pass-through checks the layout
            runs = len(placeholder_runs(input_ids, token_id))
            spec = self.family.modality(modality)
            count = given.get(modality, 0)
            if spec is not None and count and runs == spec.placeholder_runs(processed or {}, count):
                continue  # e.g. Qwen3-VL: a run per temporal patch of a video
            if runs == count:
                continue
            self._blame_item(images, clips, videos)  # e.g. a clip too short for one embedding
            if not raw_prompt:
                raise RuntimeError(f"the templated prompt has {runs} {token} runs for {given.get(modality, 0)} item(s)")
            raise PreprocessError(
                f"text_input: {runs} {token} placeholder(s) in the prompt, "
                f"but {given.get(modality, 0)} {modality} item(s) given"
            )

    # -- the whole step ------------------------------------------------------------------------
    def __call__(
        self,
        text: str | bytes | None = "",
        images: Sequence[bytes | str] = (),
        audios: Sequence[bytes | str] = (),
        pcm: Sequence[tuple[np.ndarray, int]] = (),
        *,
        apply_chat_template: bool = True,
        messages: str | bytes | None = None,
        videos: Sequence[bytes | str] = (),
        tools: str | bytes | None = None,
        use_audio_in_video: bool = False,
    ) -> dict[str, np.ndarray]:
        """``input_ids`` and every feature tensor of the contract, as numpy arrays.

        ``messages``: a conversation (UTF-8 JSON, see the package docstring) instead of ``text``;
        ``tools``: its function tools (UTF-8 JSON), for the chat template; ``use_audio_in_video``:
        each video's audio track is heard too (families with ``audio_in_video``).

        Raises:
            PreprocessError: the request is invalid or over a limit (the message names the input).
        """
        conversation: Conversation | None = None
        prompt_text = ""
        if messages is not None:
            if text is not None and (not isinstance(text, (str, *BYTES_LIKE)) or len(text)):
                raise PreprocessError("messages: text_input must be absent or empty when messages is given")
            if not apply_chat_template:
                raise PreprocessError(
                    "messages: apply_chat_template must not be false when messages is given "
                    "(the model's chat template renders the conversation)"
                )
            self._check_request("", images, audios, pcm, messages, videos, tools)
            conversation = self._conversation(messages, len(images), len(audios) + len(pcm), len(videos), tools)
        elif tools is not None:
            raise PreprocessError("tools: only with messages (a conversation)")
        else:
            self._check_request(text, images, audios, pcm, videos=videos)
            prompt_text = decode_text(text)
        with_audio = use_audio_in_video and bool(videos)
        if with_audio and self.family.audio_in_video is None:
            raise PreprocessError(f"use_audio_in_video: the {self.family.name} model takes no audio in video")
        if with_audio and (audios or pcm):
            raise PreprocessError(
                "use_audio_in_video: audio and audio_pcm must be absent (vLLM takes a video's own audio only then)"
            )
        budget = self.media.budget()  # max_decoded_bytes and max_prompt_tokens, shared by the items in this order
        pil_images = [self.media.image(i, data, budget) for i, data in enumerate(images)]
        decoded_videos = [
            self.media.video(i, data, with_audio=with_audio, budget=budget) for i, data in enumerate(videos)
        ]
        clips = self.media.clips(audios, pcm, budget)

        what = "text_input" if conversation is None else "messages"
        runs: list[Run] | None = None
        text_only: Callable[[], str] | None = None
        if conversation is not None:
            prompt, runs = self._templated(conversation)
            text_only = functools.partial(self._render_text_only, conversation)
        elif apply_chat_template:
            prompt, runs = self._templated(user_turn(prompt_text, len(pil_images), len(clips), len(decoded_videos)))
            text_only = functools.partial(self.chat_prompt, prompt_text, 0, 0)
        else:
            prompt = prompt_text
        processed = self._process(
            prompt,
            pil_images,
            clips,
            raw_prompt=not apply_chat_template,
            text_only=text_only if runs is None else None,
            what=what,
            videos=decoded_videos,
        )

        input_ids = np.asarray(processed["input_ids"][0], dtype=INPUT_IDS.dtype)
        if runs is not None:
            input_ids = self.control_tokens.splice(input_ids, runs)
        if input_ids.size > self.limits.max_prompt_tokens:
            raise PreprocessError(
                f"{what}: the prompt is {input_ids.size} tokens after expansion (template, text and media "
                f"placeholders), over the limit of {self.limits.max_prompt_tokens} (max_prompt_tokens)"
            )
        self._check_placeholders(
            input_ids, pil_images, clips, raw_prompt=not apply_chat_template, videos=decoded_videos, processed=processed
        )
        if with_audio:
            processed = {**processed, "use_audio_in_video": np.ones(len(decoded_videos), dtype=bool)}
        media: dict[str, Sequence[Any]] = {
            "image": pil_images,
            "audio": [clip.samples for clip in clips],
            "video": decoded_videos,
        }
        for spec in self.family.modalities:  # the family's names, and what the processor's output lacks
            processed = spec.complete(
                processed,
                input_ids,
                self.placeholder_ids[spec.modality][1],
                processor=self.processor,
                items=media.get(spec.modality, ()),
            )
        return {INPUT_IDS.name: input_ids, **self._features(processed)}

    def decode_wire(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A call's outputs as the HF processor itself gives them (``pixel_values`` for
        ``pixel_values_uint8``, as ``mm_llm`` decodes them), for callers that hand them to an engine
        of their own (``mmserve.inputs.processed_prompt``)."""
        if self._wire_decoders is None:
            self._wire_decoders = self.family.wire_decoders(self.model)
        return self.family.decode_wire(outputs, self._wire_decoders)

    def _features(self, processed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feature tensors of the modalities the request has (none of the others: see
        ``mmserve.serving.contract``), in the family's compact form (``compact``: no padding the
        model never reads, wire fields where it has them); float ones checked finite."""
        processed = dict(processed)
        for modality in self.family.modalities:
            present = {name: processed.pop(name) for name in modality.field_names if processed.get(name) is not None}
            if present:
                processed.update(modality.compact(present))
        outputs = {}
        for spec in FEATURE_TENSORS:
            value = processed.get(spec.name)
            if value is None:
                continue
            array = np.ascontiguousarray(value, dtype=spec.dtype)
            if spec.is_float and not np.isfinite(array).all():
                bad = int(np.count_nonzero(~np.isfinite(array)))
                raise PreprocessError(
                    f"{spec.name}: {bad} non-finite values (NaN/Inf) in the processed features "
                    "(the media's values are out of range)"
                )
            outputs[spec.name] = array
        return outputs


def _byte_size(what: str, value: object) -> int:
    """Bytes of a text or media element as received (a ``str`` counts as UTF-8)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, BYTES_LIKE):
        return len(value)
    expected = "a UTF-8 string" if what in ("text_input", "messages", "tools") else "bytes or a data URL"
    raise PreprocessError(f"{what}: expected {expected}, found {type(value).__name__}")
