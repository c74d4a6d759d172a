"""Raw request -> the model's own HF processor output: what the ``preprocess`` Triton model runs.

Contract
--------
``Preprocessor(model)(text, images, audios, pcm, apply_chat_template=True, messages=None)`` returns
``input_ids`` (chat template applied, every media placeholder expanded) and every feature tensor of
``mmserve.serving.contract``, as numpy arrays; a modality without media gives a zero-item tensor.

* ``text``: the prompt, ``str`` or UTF-8 ``bytes`` (what Triton's BYTES tensors hold). With
  ``apply_chat_template`` (the default) it is the user's message: one user turn holds the images,
  then the audio clips, then the text. Without it, it is the whole raw prompt, placeholders included.
* ``images``: encoded files (PNG, JPEG, WebP, GIF, BMP, TIFF; no other decoder is ever tried).
* ``audios``: encoded files (WAV, FLAC, OGG, MP3), mixed down to mono, resampled to the feature
  extractor's rate.
* ``pcm``: ``(samples, sample_rate)`` pairs of mono float PCM; they follow ``audios`` in the prompt.
* ``messages``: a whole conversation instead of ``text`` (which must then be empty, and
  ``apply_chat_template`` true): UTF-8 JSON (``str`` or ``bytes``), an array of
  ``{"role": "system"|"user"|"assistant", "content": <string> | [<part>, ...]}`` with parts
  ``{"type": "text", "text": <string>}``, ``{"type": "image"}``, ``{"type": "audio"}``. No other key
  is accepted anywhere (the chat templates read any ``image``/``audio``/``text`` key as a part of
  that kind); media parts only in user messages; an array content is non-empty; the last message
  is the user's (the prompt ends with the generation prompt: the model answers it). The media
  parts refer, in order of appearance across the whole conversation, to ``images`` (image parts)
  and to the clips (audio parts: ``audios``, then ``pcm``), and their counts must match. The model's
  chat template renders the conversation, the parts in their order.

Over JSON transports (Triton's HTTP generate endpoint) bytes can't travel, so a media element may
also be a ``data:<mime>;base64,<...>`` URL.

Limits (``PreprocessLimits``; each is a ``parameters`` entry of the same name in config.pbtxt)
-------------------------------------------------------------------------------------------
===========================  ==================  ==========================================================
parameter                    default             what it bounds
===========================  ==================  ==========================================================
``max_request_bytes``        67108864 (64 MiB)   text (or the messages JSON) + every media element as
                                                 received (encoded files, data URLs, float32 PCM);
                                                 checked before any decoding or JSON parsing
``max_messages``             64                  messages of a conversation (``messages``)
``max_images``               the engine's        images per request; default and ceiling: mm_llm's
                                                 ``limit_mm_per_prompt`` (4 when unknown)
``max_image_pixels``         16777216 (16 MP)    width*height of one image, read from its header before
                                                 any pixel is decoded, whatever PIL's global
                                                 ``MAX_IMAGE_PIXELS`` (which can only refuse earlier)
``max_audio_clips``          the engine's        ``audio`` and ``audio_pcm`` clips together per request;
                                                 default and ceiling as ``max_images`` (2 when unknown)
``max_audio_seconds``        the model's window  one clip. Default (``None``; ``"window"`` or empty in
                                                 config.pbtxt): ``n_samples / sampling_rate`` of the
                                                 feature extractor, 30 s for Whisper-style encoders. A
                                                 longer clip is rejected, never silently cut; a value
                                                 above the window is refused when the model loads
``max_total_audio_seconds``  60                  all clips of a request together
``max_prompt_tokens``        32768               ``input_ids`` after expansion (template, text, media
                                                 placeholders): bounds one request's work and tensors. The
                                                 engine still checks its own ``max_model_len`` (4096 in
                                                 mm_llm's model.json) and answers with its own message
===========================  ==================  ==========================================================

Sample rates must lie in 1..768000 Hz (``MAX_SAMPLE_RATE``): a decoded clip is read no further than
its duration limit, so a highly compressed "audio bomb" can't expand past it either.

Errors
------
Every rejection is a ``PreprocessError`` (an ``mmserve.errors.InputError``: Triton ``INVALID_ARG``,
HTTP 400) whose message names the input and the item, then what is wrong, then the limit if one
applies: ``<input>[<item>]: <what is wrong> (<limit name>)``, e.g.
``image[1]: 100000000 pixels (10000x10000) exceeds the limit of 16777216 (max_image_pixels)``.
Items the processor itself rejects (an extreme aspect ratio, a clip too short to give one audio
embedding) are named too: when the processor fails, or an item yields no placeholder, each item is
processed again on its own to find it (on that error path only; success costs nothing more).
Non-finite values (NaN/Inf) are refused in the decoded audio and in every float feature tensor:
they would poison the engine's KV cache for later, unrelated requests.

Errors of ``messages`` name the place: ``messages: ...`` (the JSON as a whole, the media counts),
``messages[i]: ...`` (a message), ``messages[i].content[j]: ...`` (a part), e.g.
``messages: 2 image parts but 1 image given``.

Control tokens in user text
---------------------------
With the chat template applied, the tokenizer's special tokens typed by the user (``<|im_start|>``,
``<|im_end|>``, ``<|IMAGE|>``, ``<|AUDIO|>``, ...) must never act as template markers or placeholders.
``user_control_tokens="escape"`` (the default) tokenizes them as plain text; ``"reject"`` refuses the
request. Escaping runs only when the text contains one of those strings: the template is rendered
with a one-token sentinel in place of the text, the processor runs on that, and the sentinel's id
(with the plain text around it up to the nearest special token, so that token boundaries are the
natural ones) is replaced by the user's text tokenized with ``split_special_tokens=True``. The
processor therefore never sees the user's text on that path. In a conversation every text (content
string or text part, of any role) is such a text: each one holding a special-token string is replaced
by its own sentinel, and the sentinels are spliced in order (sentinels with only plain text between
them form one run, tokenized as one text). With ``apply_chat_template=False`` the caller writes the
whole prompt on purpose, placeholders included, and it is used as it is.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import numpy as np

from mmserve.dataurl import data_url_payload, is_data_url
from mmserve.errors import InputError
from mmserve.inputs import family_of_checkpoint
from mmserve.passthrough.placeholders import placeholder_runs
from mmserve.serving.contract import FEATURE_TENSORS, INPUT_IDS, empty_feature

if TYPE_CHECKING:
    from PIL.Image import Image

MiB = 1 << 20
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only image decoders ever tried (no EPS/Ghostscript, no exotic plugins on untrusted bytes)."""
MAX_SAMPLE_RATE = 768_000
"""Highest accepted sample rate (Hz) of an audio clip."""
FALLBACK_AUDIO_SECONDS = 30.0
"""``max_audio_seconds`` when the feature extractor declares no window."""
ControlTokenPolicy = Literal["escape", "reject"]
CONTROL_TOKEN_POLICIES: tuple[str, ...] = ("escape", "reject")

# What the HF processor raises on inputs it can't handle; anything else is a fault of ours.
_PROCESSOR_REJECTIONS = (ValueError, IndexError, TypeError, ArithmeticError, RuntimeError)


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


class PreprocessError(InputError):
    """A request the preprocessing cannot turn into model inputs (bad media, bad prompt, a limit)."""


@dataclass(frozen=True)
class PreprocessLimits:
    """Bounds on one request; each field is also a config.pbtxt parameter of the same name.

    See the module docstring for what each one bounds and why.
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

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "max_audio_seconds":
                continue
            kind = int if field.type == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                expected = "a positive integer" if kind is int else "a positive number"
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
        for name, modality in (("max_images", "image"), ("max_audio_clips", "audio")):
            engine = (engine_mm_limits or {}).get(modality)
            if engine is None:
                continue
            if name not in values:
                values[name] = engine
            elif values[name] > engine:
                raise ValueError(f"parameter {name}: {values[name]} exceeds the engine's limit_mm_per_prompt "
                                 f"of {engine} {modality} items (mm_llm/model.json); leave it empty to follow it")
        return cls(**values)


@dataclass
class _Clip:
    """One decoded audio clip: mono float32 at the feature extractor's rate."""

    label: str  # "audio[0]", "audio_pcm[0]"
    samples: np.ndarray
    seconds: float  # duration as received


@dataclass
class _Run:
    """Escaped texts whose sentinels have only plain text between them: where the run sits in the
    processor's ids, and what replaces it."""

    sentinels: int  # how many sentinels (escaped texts) the run holds
    lead: int  # ids of the plain text between the previous special token and the first sentinel
    expected: list[int]  # the processor's ids of the run: lead, sentinel, (plain text, sentinel)..., trail
    ids: list[int]  # lead + text (+ plain text + text)... + trail, special-token strings as plain text


ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image", "audio")
_PART_KEYS = {"text": {"type", "text"}, "image": {"type"}, "audio": {"type"}}


@dataclass(frozen=True)
class _Text:
    """One text of a conversation: where it is (for errors and to replace it) and what it says."""

    where: str  # "messages[1].content[2]", "messages[0].content", "text_input"
    message: int
    part: int | None  # None: the message's content is this string
    text: str


@dataclass
class _Conversation:
    """A validated ``messages`` input: the messages in the HF form the chat templates take."""

    messages: list[dict[str, Any]]
    texts: list[_Text]  # every text, in order
    images: int  # image parts
    audios: int  # audio parts


_BYTES_LIKE = (bytes, bytearray)


def decode_text(text: str | bytes, what: str = "text_input") -> str:
    """``text_input`` (or the input ``what``) as a ``str``; invalid UTF-8 is an error naming the byte offset."""
    if isinstance(text, str):
        return text
    if not isinstance(text, _BYTES_LIKE):
        raise PreprocessError(f"{what}: expected a UTF-8 string, found {type(text).__name__}")
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreprocessError(
            f"{what}: invalid UTF-8 at byte {exc.start} (0x{exc.object[exc.start]:02x}): {exc.reason}"
        ) from None


def _json_kind(value: Any) -> str:
    """What a JSON value is, for messages: "an object", "a number", ..."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an empty array" if not value else "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null" if value is None else type(value).__name__


def _shown(value: Any, limit: int = 40) -> str:
    """A JSON value as an error message shows it (cut short)."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "..."


def _checked_text(where: str, text: str) -> str:
    """``text`` if it can be encoded (JSON's \\u escapes can make a lone surrogate), else an error."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise PreprocessError(f"{where}: a lone surrogate (\\u{ord(text[exc.start]):04x}) at character "
                              f"{exc.start} is not text") from None
    return text


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _without_media(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their media parts left out (a message left empty keeps an empty text)."""
    plain = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [part for part in content if part["type"] == "text"] or [{"type": "text", "text": ""}]
        plain.append({"role": message["role"], "content": content})
    return plain


def parse_messages(raw: str | bytes, *, max_messages: int) -> _Conversation:
    """The ``messages`` input (UTF-8 JSON) validated: every error names the message and the part."""
    text = decode_text(raw, "messages")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"messages: not valid JSON ({exc})") from None
    except RecursionError:
        raise PreprocessError("messages: not valid JSON (nested too deeply)") from None
    if not isinstance(value, list) or not value:
        raise PreprocessError(f"messages: expected a non-empty JSON array of messages, found {_json_kind(value)}")
    if len(value) > max_messages:
        raise PreprocessError(f"messages: {len(value)} messages exceed the limit of {max_messages} (max_messages)")
    messages: list[dict[str, Any]] = []
    texts: list[_Text] = []
    counts = {"image": 0, "audio": 0}
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise PreprocessError(f"{where}: expected a JSON object with role and content, found {_json_kind(message)}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise PreprocessError(f"{where}: unknown key(s) {extra} (a message has only role and content)")
        if "role" not in message:
            raise PreprocessError(f"{where}: missing role")
        role = message["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise PreprocessError(f"{where}: unknown role {_shown(role)} (expected 'system', 'user' or 'assistant')")
        if "content" not in message:
            raise PreprocessError(f"{where}: missing content")
        content = message["content"]
        if isinstance(content, str):
            texts.append(_Text(f"{where}.content", i, None, _checked_text(f"{where}.content", content)))
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise PreprocessError(
                f"{where}: content is not a string or an array of parts (found {_json_kind(content)})")
        if not content:
            raise PreprocessError(f"{where}: content is an empty array (expected a string or a non-empty array of parts)")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise PreprocessError(f"{at}: expected a JSON object with a type, found {_json_kind(part)}")
            if "type" not in part:
                raise PreprocessError(f"{at}: missing type")
            kind = part["type"]
            if not isinstance(kind, str) or kind not in PART_TYPES:
                raise PreprocessError(f"{at}: unknown type {_shown(kind)} (expected 'text', 'image' or 'audio')")
            extra = sorted(set(part) - _PART_KEYS[kind])
            if extra:
                allowed = " and ".join(sorted(_PART_KEYS[kind]))
                raise PreprocessError(f"{at}: unknown key(s) {extra} ({_a(kind)} part has only {allowed})")
            if kind == "text":
                if "text" not in part:
                    raise PreprocessError(f"{at}: missing text")
                if not isinstance(part["text"], str):
                    raise PreprocessError(f"{at}: text is not a string (found {_json_kind(part['text'])})")
                texts.append(_Text(at, i, j, _checked_text(at, part["text"])))
                parts.append({"type": "text", "text": part["text"]})
            else:
                if role != "user":
                    raise PreprocessError(f"{at}: {_a(kind)} part in {_a(role)} message (media go in user messages only)")
                counts[kind] += 1
                parts.append({"type": kind})
        messages.append({"role": role, "content": parts})
    if messages[-1]["role"] != "user":
        raise PreprocessError(
            f"messages[{len(messages) - 1}]: the conversation must end with a user message, found "
            f"{_a(messages[-1]['role'])} message (the model answers the last user message)"
        )
    return _Conversation(messages, texts, counts["image"], counts["audio"])


def _byte_size(what: str, value: str | bytes) -> int:
    """Bytes of a text or media element as received (a ``str`` counts as UTF-8)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, _BYTES_LIKE):
        return len(value)
    expected = "a UTF-8 string" if what in ("text_input", "messages") else "bytes or a data URL"
    raise PreprocessError(f"{what}: expected {expected}, found {type(value).__name__}")


def _declared_size(payload: bytes) -> tuple[int, int] | None:
    """The size an image's header declares, read without PIL's global bomb check (error path only:
    ``PIL.Image.open`` refused to say). Uses PIL's registry of format plugins."""
    from PIL import Image

    Image.init()
    for name in IMAGE_FORMATS:
        factory, accept = Image.OPEN.get(name, (None, None))
        accepted = accept is None or accept(payload[:16])  # a str: "yes, but can't open it"
        if factory is not None and accepted and not isinstance(accepted, str):
            try:
                with factory(io.BytesIO(payload), "") as image:
                    return image.size
            except Exception:  # noqa: BLE001 - not a valid file of this format
                return None
    return None


def payload_bytes(data: bytes | str) -> bytes:
    """A media element's file bytes: the element itself, or the content of a base64 data URL."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, _BYTES_LIKE):
        raise TypeError(f"expected bytes or a data URL, found {type(data).__name__}")
    return data_url_payload(data) if is_data_url(data) else bytes(data)


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
            spec.modality: (spec.placeholder_token, vocab[spec.placeholder_token])
            for spec in self.family.modalities
        }
        self.modalities = {spec.modality for spec in self.family.modalities}
        # No token stands for more text than this: a longer text is surely over max_prompt_tokens.
        self.max_token_bytes = max(len(token.encode()) for token in vocab)
        extractor = getattr(self.processor, "feature_extractor", None)
        self.sampling_rate: int | None = getattr(extractor, "sampling_rate", None)
        self.audio_window_s = self._audio_window(extractor)
        self.control_tokens = self._special_tokens()
        self._control_pattern = re.compile("|".join(re.escape(t) for t in self.control_tokens) or r"(?!)")
        self._sentinel, self._sentinel_id = self._pick_sentinel(vocab)
        self._min_audio_samples: int | None = None  # found on the first too-short clip
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

    def _audio_window(self, extractor: Any) -> float | None:
        """The longest clip: the feature extractor's window, or less where the family's encoder
        accepts less (``ModalitySpec.max_item_seconds``)."""
        windows = []
        n_samples = getattr(extractor, "n_samples", None)
        if n_samples and self.sampling_rate:
            windows.append(n_samples / self.sampling_rate)
        audio = self.family.modality("audio")
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

    def _special_tokens(self) -> tuple[str, ...]:
        """The tokenizer's special tokens, longest first (so that the longest match wins)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        tokens = {token.content for token in added.values() if getattr(token, "special", False)}
        tokens.update(self.tokenizer.all_special_tokens)
        tokens.update(token for token, _ in self.placeholder_ids.values())
        return tuple(sorted((t for t in tokens if t), key=lambda t: (-len(t), t)))

    def _pick_sentinel(self, vocab: Mapping[str, int]) -> tuple[str, int]:
        """A special token that neither the template nor the processor's expansion ever uses."""
        if not self.control_tokens:
            return "", -1  # nothing to escape, ever
        every_kind = self.chat_prompt("", int("image" in self.modalities), int("audio" in self.modalities))
        busy = set(self._control_pattern.findall(every_kind))
        busy.update(token for token, _ in self.placeholder_ids.values())
        busy.update(getattr(self.processor, f"{kind}_token", None) for kind in ("image", "audio", "video"))
        free = sorted((vocab[t], t) for t in self.control_tokens if t not in busy and t in vocab)
        if not free:
            raise ValueError(f"{self.model}: no special token is free to stand for the user's text")
        token_id, token = free[0]
        return token, token_id

    # -- text ----------------------------------------------------------------------------------
    def chat_prompt(self, text: str, num_images: int, num_audios: int) -> str:
        """One user turn: the images, then the audio clips, then the text; generation prompt on."""
        return self.render(self._user_turn(text, num_images, num_audios).messages)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template on ``messages`` (HF form), generation prompt on."""
        return self.processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def _render_text_only(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The template on ``messages`` with their media parts left out."""
        return self.render(_without_media(messages))

    @staticmethod
    def _user_turn(text: str, num_images: int, num_audios: int) -> _Conversation:
        content: list[dict[str, Any]] = [{"type": "image"}] * num_images
        content += [{"type": "audio"}] * num_audios
        content.append({"type": "text", "text": text})
        return _Conversation([{"role": "user", "content": content}], [_Text("text_input", 0, len(content) - 1, text)],
                             num_images, num_audios)

    def _user_prompt(self, text: str, num_images: int, num_audios: int) -> tuple[str, list[_Run] | None]:
        """The templated prompt, and how to splice the user's text back in when it is escaped."""
        return self._templated(self._user_turn(text, num_images, num_audios))

    def _templated(self, conversation: _Conversation) -> tuple[str, list[_Run] | None]:
        """The templated conversation, and how to splice its escaped texts back in (None: none is)."""
        escaped: list[_Text] = []
        for text in conversation.texts:
            found = self._control_pattern.search(text.text)
            if found is None:
                continue
            if self.user_control_tokens == "reject":
                raise PreprocessError(
                    f"{text.where}: the control token {found.group()!r} at character {found.start()} is not "
                    "accepted in user text (user_control_tokens=reject)"
                )
            escaped.append(text)
        if not escaped:
            return self.render(conversation.messages), None
        messages = copy.deepcopy(conversation.messages)
        for text in escaped:
            if text.part is None:
                messages[text.message]["content"] = self._sentinel
            else:
                messages[text.message]["content"][text.part]["text"] = self._sentinel
        prompt = self.render(messages)
        return prompt, self._runs(prompt, [text.text for text in escaped])

    def _runs(self, prompt: str, texts: Sequence[str]) -> list[_Run]:
        """How to splice ``texts`` (escaped, in order) over their sentinels in ``prompt``'s ids."""
        segments = prompt.split(self._sentinel)
        if len(segments) != len(texts) + 1:
            raise RuntimeError(f"the chat template renders the user text sentinel {self._sentinel!r} "
                               f"{len(segments) - 1} times for {len(texts)} escaped text(s)")
        runs: list[_Run] = []
        k = 0
        while k < len(texts):
            lead = self._control_pattern.split(segments[k])[-1]
            lead_ids = self._tokenize(lead)
            expected = [*lead_ids, self._sentinel_id]
            joined, count = lead + texts[k], 1
            # Only plain text up to the next sentinel: one run, tokenized as one text.
            while k + 1 < len(texts) and not self._control_pattern.search(segments[k + 1]):
                expected += [*self._tokenize(segments[k + 1]), self._sentinel_id]
                joined += segments[k + 1] + texts[k + 1]
                k, count = k + 1, count + 1
            trail = self._control_pattern.split(segments[k + 1])[0]
            expected += self._tokenize(trail)
            runs.append(_Run(count, len(lead_ids), expected, self._tokenize(joined + trail, split_special_tokens=True)))
            k += 1
        return runs

    def _tokenize(self, text: str, *, split_special_tokens: bool = False) -> list[int]:
        if not text:
            return []
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)
        return list(encoded["input_ids"])

    def _splice(self, input_ids: np.ndarray, runs: Sequence[_Run]) -> np.ndarray:
        """``input_ids`` with each run of sentinels (and the plain text around them) replaced by the
        texts' ids, in order."""
        (where,) = np.nonzero(input_ids == self._sentinel_id)
        expected = sum(run.sentinels for run in runs)
        if where.size != expected:
            raise RuntimeError(f"the sentinel {self._sentinel!r} occurs {where.size} times in the prompt ids, "
                               f"expected {expected}")
        pieces, cursor, first = [], 0, 0
        for run in runs:
            start = int(where[first]) - run.lead
            end = start + len(run.expected)
            if start < cursor or input_ids[start:end].tolist() != run.expected:
                raise RuntimeError("the text around the user text sentinel tokenized differently in context")
            pieces += [input_ids[cursor:start], np.asarray(run.ids, dtype=input_ids.dtype)]
            cursor, first = end, first + run.sentinels
        pieces.append(input_ids[cursor:])
        return np.concatenate(pieces)

    # -- request-level limits ------------------------------------------------------------------
    def _check_request(
        self,
        text: str | bytes,
        images: Sequence[bytes | str],
        audios: Sequence[bytes | str],
        pcm: Sequence[tuple[np.ndarray, int]],
        messages: str | bytes | None = None,
    ) -> None:
        """Modalities, item counts and total size: all before anything is decoded (or parsed)."""
        limits = self.limits
        if images and "image" not in self.modalities:
            raise PreprocessError(f"image: the {self.family.name} model takes no images")
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
        text_bytes = _byte_size("text_input", text)
        total = text_bytes + sum(_byte_size(f"image[{i}]", item) for i, item in enumerate(images))
        total += 0 if messages is None else _byte_size("messages", messages)
        total += sum(_byte_size(f"audio[{i}]", item) for i, item in enumerate(audios))
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

    def _conversation(self, messages: str | bytes, num_images: int, num_clips: int) -> _Conversation:
        """``messages`` parsed and checked against the request's media (before any decoding)."""
        conversation = parse_messages(messages, max_messages=self.limits.max_messages)
        for parts, given, noun, clip_note in ((conversation.images, num_images, "image", ""),
                                              (conversation.audios, num_clips, "audio clip", " (audio, then audio_pcm)")):
            if parts != given:
                kind = noun.split()[0]
                raise PreprocessError(
                    f"messages: {_plural(parts, kind + ' part')} but {_plural(given, noun)} given{clip_note}")
        self._check_text_bytes("messages", sum(len(t.text.encode()) for t in conversation.texts))
        return conversation

    # -- images --------------------------------------------------------------------------------
    def decode_image(self, index: int, data: bytes | str) -> Image:
        """``image[index]`` as RGB, its pixel count checked from the header before decoding."""
        from PIL import Image as PILImage

        what = f"image[{index}]"
        payload = self._payload(what, data)
        try:
            with PILImage.open(io.BytesIO(payload), formats=IMAGE_FORMATS) as image:
                self._check_image_pixels(what, *image.size)
                return image.convert("RGB")
        except (PreprocessError, MemoryError):
            raise
        except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
            raise PreprocessError(self._pil_refused(what, payload)) from None
        except PILImage.UnidentifiedImageError:
            raise PreprocessError(self._undecodable_image(what, payload)) from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(f"{self._undecodable_image(what, payload)}: {exc}") from None

    def _pil_refused(self, what: str, payload: bytes) -> str:
        """PIL's own (global) bomb check refused the image: say whose limit it is over."""
        size = _declared_size(payload)
        if size is None:
            return f"{what}: more pixels than the image decoder accepts (PIL.Image.MAX_IMAGE_PIXELS)"
        width, height = size
        limit = self.limits.max_image_pixels
        if width * height > limit:
            return f"{what}: {width * height} pixels ({width}x{height}) exceeds the limit of {limit} (max_image_pixels)"
        return (f"{what}: {width * height} pixels ({width}x{height}) exceeds the image decoder's own limit "
                "(PIL.Image.MAX_IMAGE_PIXELS)")

    @staticmethod
    def _undecodable_image(what: str, payload: bytes) -> str:
        return f"{what}: cannot decode {len(payload)} bytes as an image ({'/'.join(IMAGE_FORMATS)})"

    def _check_image_pixels(self, what: str, width: int, height: int) -> None:
        limit = self.limits.max_image_pixels
        if width * height > limit:
            raise PreprocessError(
                f"{what}: {width * height} pixels ({width}x{height}) exceeds the limit of {limit} (max_image_pixels)"
            )

    # -- audio ---------------------------------------------------------------------------------
    def _decode_audio(self, what: str, data: bytes | str) -> _Clip:
        import soundfile

        payload = self._payload(what, data)
        try:
            with soundfile.SoundFile(io.BytesIO(payload)) as sound:
                rate = self._check_rate(what, sound.samplerate)
                limit = math.floor(self.max_audio_seconds * rate)
                if sound.frames > limit:  # the header's length; the read below is bounded anyway
                    self._too_long(what, sound.frames / rate)
                samples = sound.read(frames=limit + 1, dtype="float32", always_2d=True)
        except (PreprocessError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's
            raise PreprocessError(
                f"{what}: cannot decode {len(payload)} bytes as audio (WAV/FLAC/OGG/MP3): "
                f"{str(exc).rsplit(': ', 1)[-1]}"
            ) from None
        if len(samples) > limit:
            self._too_long(what, None)
        return self._clip(what, samples.mean(axis=1), rate)

    def _clip(self, what: str, samples: np.ndarray, rate: int) -> _Clip:
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise PreprocessError(f"{what}: expected a non-empty mono clip, found shape {samples.shape}")
        rate = self._check_rate(what, rate)
        seconds = samples.size / rate
        if seconds > self.max_audio_seconds:
            self._too_long(what, seconds)
        if not np.isfinite(samples).all():
            bad = int(np.count_nonzero(~np.isfinite(samples)))
            raise PreprocessError(f"{what}: {bad} non-finite samples (NaN/Inf)")
        if self.sampling_rate is not None and rate != self.sampling_rate:
            import soxr

            samples = soxr.resample(samples, rate, self.sampling_rate).astype(np.float32, copy=False)
        return _Clip(what, samples, seconds)

    @staticmethod
    def _check_rate(what: str, rate: Any) -> int:
        try:
            rate = int(rate)
        except (TypeError, ValueError, OverflowError):
            raise PreprocessError(f"{what}: expected an integer sample rate, found {rate!r}") from None
        if not 0 < rate <= MAX_SAMPLE_RATE:
            raise PreprocessError(
                f"{what}: expected a positive sample rate of at most {MAX_SAMPLE_RATE} Hz, found {rate}"
            )
        return rate

    def _too_long(self, what: str, seconds: float | None) -> NoReturn:
        """``seconds``: the clip's length, None when only known to be longer than the limit."""
        limit = self.max_audio_seconds
        name = "max_audio_seconds"
        if self.audio_window_s is not None and limit == self.audio_window_s:
            name += "; the model's audio window"
        length = "the clip" if seconds is None else f"{seconds:.1f} s"
        if seconds is not None and round(seconds, 1) <= limit:  # just over: show the difference
            length = f"{seconds:.6f} s"
        raise PreprocessError(f"{what}: {length} exceeds the limit of {limit:.1f} s per clip ({name})")

    def _decode_clips(self, audios: Sequence[bytes | str], pcm: Sequence[tuple[np.ndarray, int]]) -> list[_Clip]:
        clips = [self._decode_audio(f"audio[{i}]", data) for i, data in enumerate(audios)]
        clips += [self._clip(f"audio_pcm[{i}]", samples, rate) for i, (samples, rate) in enumerate(pcm)]
        total, limit = sum(clip.seconds for clip in clips), self.limits.max_total_audio_seconds
        if total > limit:
            raise PreprocessError(
                f"audio: {total:.1f} s in total exceeds the limit of {limit:.1f} s (max_total_audio_seconds)"
            )
        return clips

    @staticmethod
    def _payload(what: str, data: bytes | str) -> bytes:
        try:
            return payload_bytes(data)
        except (ValueError, TypeError) as exc:
            raise PreprocessError(f"{what}: {exc}") from None

    # -- the processor -------------------------------------------------------------------------
    def _run_processor(self, prompt: str, images: Sequence[Image], clips: Sequence[np.ndarray]) -> Mapping[str, Any]:
        kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "np"}
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

    def _blame_item(self, images: Sequence[Image], clips: Sequence[_Clip]) -> None:
        """Raise a ``PreprocessError`` naming the first item the processor rejects on its own."""
        for index, image in enumerate(images):
            self._blame_image(f"image[{index}]", image)
        for clip in clips:
            self._blame_clip(clip)

    def _blame_image(self, what: str, image: Image) -> None:
        width, height = image.size
        try:
            tokens = self._item_tokens("image", image)
        except _PROCESSOR_REJECTIONS as exc:
            raise PreprocessError(f"{what}: {width}x{height} pixels: the processor rejects it ({exc})") from None
        if tokens == 0:
            raise PreprocessError(f"{what}: {width}x{height} pixels: the processor gives it no placeholder")

    def _blame_clip(self, clip: _Clip) -> None:
        try:
            tokens = self._item_tokens("audio", clip.samples)
        except _PROCESSOR_REJECTIONS as exc:
            raise PreprocessError(
                f"{clip.label}: a {clip.seconds:.3f} s clip: the processor rejects it ({exc})"
            ) from None
        if tokens == 0:
            # Rounded up to the millisecond: a clip of the length printed always passes.
            needed = math.ceil(self._shortest_clip(clip.samples.size) * 1000 / self.sampling_rate) / 1000
            raise PreprocessError(
                f"{clip.label}: a {clip.seconds:.3f} s clip is too short: at least {needed:.3f} s needed "
                "(shorter clips give no audio embedding)"
            )

    def _shortest_clip(self, too_short: int) -> int:
        """Fewest samples (at the model's rate) that give one audio placeholder; found once, by search.

        ``too_short``: a length known to give none.
        """
        if self._min_audio_samples is None:
            window = int((self.audio_window_s or self.max_audio_seconds) * self.sampling_rate)
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
        self, prompt: str, images: Sequence[Image], clips: Sequence[_Clip], *, raw_prompt: bool,
        text_only: Callable[[], str] | None, what: str = "text_input",
    ) -> Mapping[str, Any]:
        """The processor's output. ``text_only``: the templated text as the processor saw it, without
        the media (None: escaped, the processor never saw it); ``what``: the input holding the text."""
        try:
            return self._run_processor(prompt, images, [clip.samples for clip in clips])
        except _PROCESSOR_REJECTIONS as exc:
            failure = exc
        # Error path: which part of the request does the processor reject?
        self._blame_item(images, clips)
        if raw_prompt:  # the caller wrote the prompt, placeholders included
            raise PreprocessError(f"text_input: the processor rejected the prompt and media: {failure}") from None
        if text_only is not None:
            try:
                self._run_processor(text_only(), [], [])
            except _PROCESSOR_REJECTIONS as exc:
                raise PreprocessError(f"{what}: the processor rejects the text ({exc})") from None
        raise failure  # not the request's fault as far as can be told: an internal error

    def _check_placeholders(
        self, input_ids: np.ndarray, images: Sequence[Image], clips: Sequence[_Clip], *, raw_prompt: bool
    ) -> None:
        given = {"image": len(images), "audio": len(clips)}
        for modality, (token, token_id) in self.placeholder_ids.items():
            runs = len(placeholder_runs(input_ids, token_id))
            if runs == given[modality]:
                continue
            self._blame_item(images, clips)  # e.g. a clip too short for one embedding
            if not raw_prompt:
                raise RuntimeError(f"the templated prompt has {runs} {token} runs for {given[modality]} item(s)")
            raise PreprocessError(
                f"text_input: {runs} {token} placeholder(s) in the prompt, "
                f"but {given[modality]} {modality} item(s) given"
            )

    # -- the whole step ------------------------------------------------------------------------
    def __call__(
        self,
        text: str | bytes = "",
        images: Sequence[bytes | str] = (),
        audios: Sequence[bytes | str] = (),
        pcm: Sequence[tuple[np.ndarray, int]] = (),
        *,
        apply_chat_template: bool = True,
        messages: str | bytes | None = None,
    ) -> dict[str, np.ndarray]:
        """``input_ids`` and every feature tensor of the contract, as numpy arrays.

        ``messages``: a conversation (UTF-8 JSON, see the module docstring) instead of ``text``.

        Raises:
            PreprocessError: the request is invalid or over a limit (the message names the input).
        """
        conversation: _Conversation | None = None
        if messages is not None:
            if text is not None and (not isinstance(text, (str, *_BYTES_LIKE)) or len(text)):
                raise PreprocessError("messages: text_input must be absent or empty when messages is given")
            if not apply_chat_template:
                raise PreprocessError("messages: apply_chat_template must not be false when messages is given "
                                      "(the model's chat template renders the conversation)")
            self._check_request("", images, audios, pcm, messages)
            conversation = self._conversation(messages, len(images), len(audios) + len(pcm))
        else:
            self._check_request(text, images, audios, pcm)
            text = decode_text(text)
        pil_images = [self.decode_image(i, data) for i, data in enumerate(images)]
        clips = self._decode_clips(audios, pcm)

        what = "text_input" if conversation is None else "messages"
        runs: list[_Run] | None = None
        text_only: Callable[[], str] | None = None
        if conversation is not None:
            prompt, runs = self._templated(conversation)
            text_only = functools.partial(self._render_text_only, conversation.messages)
        elif apply_chat_template:
            prompt, runs = self._user_prompt(text, len(pil_images), len(clips))
            text_only = functools.partial(self.chat_prompt, text, 0, 0)
        else:
            prompt = text
        processed = self._process(prompt, pil_images, clips, raw_prompt=not apply_chat_template,
                                  text_only=text_only if runs is None else None, what=what)

        input_ids = np.asarray(processed["input_ids"][0], dtype=INPUT_IDS.dtype)
        if runs is not None:
            input_ids = self._splice(input_ids, runs)
        if input_ids.size > self.limits.max_prompt_tokens:
            raise PreprocessError(
                f"{what}: the prompt is {input_ids.size} tokens after expansion (template, text and media "
                f"placeholders), over the limit of {self.limits.max_prompt_tokens} (max_prompt_tokens)"
            )
        self._check_placeholders(input_ids, pil_images, clips, raw_prompt=not apply_chat_template)
        return {INPUT_IDS.name: input_ids, **self._features(processed)}

    def _features(self, processed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every feature tensor of the contract, without padding the model never reads (the
        family's ``compact``); float ones checked finite."""
        processed = dict(processed)
        for modality in self.family.modalities:
            present = {name: processed[name] for name in modality.field_names if processed.get(name) is not None}
            if present:
                processed.update(modality.compact(present))
        outputs = {}
        for spec in FEATURE_TENSORS:
            value = processed.get(spec.name)
            array = empty_feature(spec) if value is None else np.ascontiguousarray(value, dtype=spec.dtype)
            if spec.is_float and not np.isfinite(array).all():
                bad = int(np.count_nonzero(~np.isfinite(array)))
                raise PreprocessError(
                    f"{spec.name}: {bad} non-finite values (NaN/Inf) in the processed features "
                    "(the media's values are out of range)"
                )
            outputs[spec.name] = array
        return outputs
