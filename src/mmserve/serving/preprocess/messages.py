"""The ``messages`` input: a conversation as UTF-8 JSON, validated into the HF form the chat
templates take. Every error names the place: ``messages`` (the JSON as a whole, the media counts),
``messages[i]`` (a message), ``messages[i].content[j]`` (a part)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.serving.preprocess.limits import PreprocessError

ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image", "audio", "video")
_PART_KEYS = {"text": {"type", "text"}, "image": {"type"}, "audio": {"type"}, "video": {"type"}}
BYTES_LIKE = (bytes, bytearray)


@dataclass(frozen=True)
class Text:
    """One text of a conversation: where it is (for errors and to replace it) and what it says."""

    where: str  # "messages[1].content[2]", "messages[0].content", "text_input"
    message: int
    part: int | None  # None: the message's content is this string
    text: str


@dataclass
class Conversation:
    """A validated conversation: the messages in the HF form the chat templates take."""

    messages: list[dict[str, Any]]
    texts: list[Text]  # every text, in order
    images: int  # image parts
    audios: int  # audio parts
    videos: int = 0  # video parts


def user_turn(text: str, num_images: int, num_audios: int, num_videos: int = 0) -> Conversation:
    """One user turn: the images, the videos, the audio clips, then the text (``text_input``'s layout)."""
    content: list[dict[str, Any]] = [{"type": "image"}] * num_images
    content += [{"type": "video"}] * num_videos
    content += [{"type": "audio"}] * num_audios
    content.append({"type": "text", "text": text})
    return Conversation(
        [{"role": "user", "content": content}],
        [Text("text_input", 0, len(content) - 1, text)],
        num_images,
        num_audios,
        num_videos,
    )


def without_media(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their media parts left out (a message left empty keeps an empty text)."""
    plain = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [part for part in content if part["type"] == "text"] or [{"type": "text", "text": ""}]
        plain.append({"role": message["role"], "content": content})
    return plain


def decode_text(text: object, what: str = "text_input") -> str:
    """``text_input`` (or the input ``what``) as a ``str``; invalid UTF-8 is an error naming the byte offset."""
    if isinstance(text, str):
        return text
    if not isinstance(text, BYTES_LIKE):
        raise PreprocessError(f"{what}: expected a UTF-8 string, found {type(text).__name__}")
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreprocessError(
            f"{what}: invalid UTF-8 at byte {exc.start} (0x{exc.object[exc.start]:02x}): {exc.reason}"
        ) from None


def parse_messages(raw: str | bytes, *, max_messages: int) -> Conversation:
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
    texts: list[Text] = []
    counts = {"image": 0, "audio": 0, "video": 0}
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = _role(where, message)
        content = message["content"]
        if isinstance(content, str):
            texts.append(Text(f"{where}.content", i, None, _checked_text(f"{where}.content", content)))
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise PreprocessError(
                f"{where}: content is not a string or an array of parts (found {_json_kind(content)})"
            )
        if not content:
            raise PreprocessError(
                f"{where}: content is an empty array (expected a string or a non-empty array of parts)"
            )
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _part_type(at, part)
            if kind == "text":
                if "text" not in part:
                    raise PreprocessError(f"{at}: missing text")
                if not isinstance(part["text"], str):
                    raise PreprocessError(f"{at}: text is not a string (found {_json_kind(part['text'])})")
                texts.append(Text(at, i, j, _checked_text(at, part["text"])))
                parts.append({"type": "text", "text": part["text"]})
            else:
                if role != "user":
                    raise PreprocessError(
                        f"{at}: {_a(kind)} part in {_a(role)} message (media go in user messages only)"
                    )
                counts[kind] += 1
                parts.append({"type": kind})
        messages.append({"role": role, "content": parts})
    if messages[-1]["role"] != "user":
        raise PreprocessError(
            f"messages[{len(messages) - 1}]: the conversation must end with a user message, found "
            f"{_a(messages[-1]['role'])} message (the model answers the last user message)"
        )
    return Conversation(messages, texts, counts["image"], counts["audio"], counts["video"])


def check_media_counts(conversation: Conversation, num_images: int, num_clips: int, num_videos: int = 0) -> None:
    """The conversation's media parts match the media the request carries."""
    for parts, given, noun, clip_note in (
        (conversation.images, num_images, "image", ""),
        (conversation.audios, num_clips, "audio clip", " (audio, then audio_pcm)"),
        (conversation.videos, num_videos, "video", ""),
    ):
        if parts != given:
            kind = noun.split()[0]
            raise PreprocessError(
                f"messages: {_plural(parts, kind + ' part')} but {_plural(given, noun)} given{clip_note}"
            )


def _role(where: str, message: Any) -> str:
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
    return role


def _part_type(at: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise PreprocessError(f"{at}: expected a JSON object with a type, found {_json_kind(part)}")
    if "type" not in part:
        raise PreprocessError(f"{at}: missing type")
    kind = part["type"]
    if not isinstance(kind, str) or kind not in PART_TYPES:
        raise PreprocessError(f"{at}: unknown type {_shown(kind)} (expected 'text', 'image', 'audio' or 'video')")
    extra = sorted(set(part) - _PART_KEYS[kind])
    if extra:
        allowed = " and ".join(sorted(_PART_KEYS[kind]))
        raise PreprocessError(f"{at}: unknown key(s) {extra} ({_a(kind)} part has only {allowed})")
    return kind


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
        raise PreprocessError(
            f"{where}: a lone surrogate (\\u{ord(text[exc.start]):04x}) at character {exc.start} is not text"
        ) from None
    return text


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
