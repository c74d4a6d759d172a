"""The ``messages`` input: a conversation as UTF-8 JSON, validated into the HF form the chat
templates take (the form vLLM's server gives them), and the ``tools`` input, the function tools the
template shows the model. Every error names the place: ``messages`` (the JSON as a whole, the media
counts), ``messages[i]`` (a message), ``messages[i].content[j]`` (a part), ``tools[k]`` (a tool)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserve.serving.preprocess.limits import PreprocessError

ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}
"""Keys a message of the role may have besides role and content."""
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
    structured: list[Text] = field(default_factory=list)
    """Texts the template renders as JSON (tool calls, tools): never escaped (see ``escaping``)."""
    tools: list[dict[str, Any]] | None = None
    """The function tools, for the template (``apply_chat_template(tools=...)``)."""


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
        if not isinstance(content, str) and content:
            content = [part for part in content if part["type"] == "text"] or [{"type": "text", "text": ""}]
        plain.append({**message, "content": content})
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
    structured: list[Text] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = _role(where, message)
        extra: dict[str, Any] = {}
        if "tool_calls" in message:
            extra["tool_calls"] = _tool_calls(where, message["tool_calls"], i, structured)
            if not extra["tool_calls"]:
                del extra["tool_calls"]  # as vLLM: the template's plain assistant path
        if role == "tool":
            extra["tool_call_id"] = _tool_call_id(where, message.get("tool_call_id"))
        content = message["content"]
        if content in (None, []) and "tool_calls" in extra:
            messages.append({"role": role, "content": [], **extra})  # vLLM's form of a call without text
            continue
        if role == "tool" and isinstance(content, list):
            content = _tool_result_text(where, content)
        if isinstance(content, str):
            texts.append(Text(f"{where}.content", i, None, _checked_text(f"{where}.content", content)))
            messages.append({"role": role, "content": content, **extra})
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
        messages.append({"role": role, "content": parts, **extra})
    if messages[-1]["role"] not in ("user", "tool"):
        raise PreprocessError(
            f"messages[{len(messages) - 1}]: the conversation must end with a user (or tool) message, found "
            f"{_a(messages[-1]['role'])} message (the model answers the last user message)"
        )
    return Conversation(messages, texts, counts["image"], counts["audio"], counts["video"], structured=structured)


def parse_tools(raw: str | bytes) -> tuple[list[dict[str, Any]], list[Text]]:
    """The ``tools`` input (UTF-8 JSON): a non-empty array of OpenAI function tools
    ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``, and
    its texts (each tool as JSON) for the control-token check."""
    text = decode_text(raw, "tools")
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise PreprocessError(f"tools: not valid JSON ({reason})") from None
    if not isinstance(value, list) or not value:
        raise PreprocessError(f"tools: expected a non-empty JSON array of tools, found {_json_kind(value)}")
    tools, texts = [], []
    for k, tool in enumerate(value):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise PreprocessError(f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}')
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise PreprocessError(f"{where}: unknown key(s) {extra} (a tool has only type and function)")
        function = tool["function"]
        extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if extra:
            raise PreprocessError(f"{where}.function: unknown key(s) {extra}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise PreprocessError(f"{where}.function.name: expected a non-empty string")
        if not isinstance(function.get("description", ""), str):
            raise PreprocessError(f"{where}.function.description: expected a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise PreprocessError(f"{where}.function.parameters: expected a JSON schema (an object)")
        tools.append(tool)
        texts.append(Text(where, -1, None, _checked_text(where, json.dumps(tool, ensure_ascii=False))))
    return tools, texts


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
    if "role" not in message:
        raise PreprocessError(f"{where}: missing role")
    role = message["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise PreprocessError(
            f"{where}: unknown role {_shown(role)} (expected 'system', 'user', 'assistant' or 'tool')"
        )
    allowed = {"role", "content", *_MESSAGE_KEYS.get(role, ())}
    extra = sorted(set(message) - allowed)
    if extra:
        also = " and ".join(sorted(_MESSAGE_KEYS.get(role, ())))
        raise PreprocessError(
            f"{where}: unknown key(s) {extra} (a message has only role and content"
            + (f", {_a(role)} message also {also})" if also else ")")
        )
    if "content" not in message:
        raise PreprocessError(f"{where}: missing content")
    if message["content"] is None and role == "assistant" and not message.get("tool_calls"):
        raise PreprocessError(f"{where}: content is null (allowed only in an assistant message with tool_calls)")
    return role


def _tool_calls(where: str, calls: Any, message: int, structured: list[Text]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, with each call's ``arguments`` as an object (vLLM's
    form for the chat templates: a JSON string parsed, ``{}`` when empty or not an object)."""
    if not isinstance(calls, list):
        raise PreprocessError(f"{where}.tool_calls: expected an array, found {_json_kind(calls)}")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise PreprocessError(f'{at}: expected {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        extra = sorted(set(call) - {"id", "type", "function"})
        if extra:
            raise PreprocessError(f"{at}: unknown key(s) {extra} (a tool call has only id, type and function)")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PreprocessError(f"{at}.function: expected an object with a name (a string)")
        extra = sorted(set(function) - {"name", "arguments"})
        if extra:
            raise PreprocessError(f"{at}.function: unknown key(s) {extra} (a function has only name and arguments)")
        if not isinstance(call.get("id", ""), str):
            raise PreprocessError(f"{at}.id: expected a string")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                arguments = None  # as vLLM: a malformed call in the history must not fail every later turn
        elif arguments is not None and not isinstance(arguments, (dict, str)):
            raise PreprocessError(f"{at}.function.arguments: expected a JSON string or an object")
        arguments = arguments if isinstance(arguments, dict) else {}
        normalized = {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        structured.append(Text(at, message, None, _checked_text(at, json.dumps(normalized, ensure_ascii=False))))
        out.append(normalized)
    return out


def _tool_call_id(where: str, value: Any) -> str:
    if value is None:
        raise PreprocessError(f"{where}: missing tool_call_id (a tool message answers a call by its id)")
    if not isinstance(value, str):
        raise PreprocessError(f"{where}.tool_call_id: expected a string, found {_json_kind(value)}")
    return value


def _tool_result_text(where: str, content: list[Any]) -> str:
    """A tool message's text parts joined by newlines (vLLM's form: the templates take a string)."""
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if _part_type(at, part) != "text":
            raise PreprocessError(f"{at}: {_a(part['type'])} part in a tool message (a tool answers in text)")
        if not isinstance(part.get("text"), str):
            raise PreprocessError(f"{at}: text is not a string (found {_json_kind(part.get('text'))})")
        texts.append(part["text"])
    return "\n".join(texts)


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
