"""The ``messages`` input: a conversation as UTF-8 JSON, validated (pydantic, the pieces shared with
the OpenAI gateway in ``mmserve.chat``) into the HF form the chat templates take (the form vLLM's
server gives them), and the ``tools`` input, the function tools the template shows the model. Every
error names the place: ``messages`` (the JSON as a whole, the media counts), ``messages[i]`` (a
message), ``messages[i].content[j]`` (a part), ``tools[k]`` (a tool)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from mmserve.chat import Strict, TextPart, Tool, ToolMessage, json_kind, problem
from mmserve.serving.preprocess.limits import PreprocessError

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


class MediaPart(Strict):
    """An image, audio or video part: the media themselves travel in their own input, in order."""

    type: Literal["image", "audio", "video"]


UserPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]
Parts = Annotated[list[TextPart], Field(min_length=1)]


class SystemMessage(Strict):
    role: Literal["system"]
    content: str | Parts


class UserMessage(Strict):
    role: Literal["user"]
    content: str | Annotated[list[UserPart], Field(min_length=1)]


class ToolCallFunction(Strict):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI's JSON string, or HF's object


class ToolCall(Strict):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content in (None, []) and not self.tool_calls:
            raise ValueError("content is null or empty (allowed only in an assistant message with tool_calls)")
        return self


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class _Messages(BaseModel):
    messages: list[Message]


class _Tools(BaseModel):
    tools: Annotated[list[Tool], Field(min_length=1)]


def parse_messages(raw: str | bytes, *, max_messages: int) -> Conversation:
    """The ``messages`` input (UTF-8 JSON) validated: every error names the message and the part."""
    value = _json("messages", raw)
    if not isinstance(value, list) or not value:
        raise PreprocessError(f"messages: expected a non-empty JSON array of messages, found {json_kind(value)}")
    if len(value) > max_messages:
        raise PreprocessError(f"messages: {len(value)} messages exceed the limit of {max_messages} (max_messages)")
    data = {"messages": value}
    try:
        parsed = _Messages.model_validate(data).messages
    except ValidationError as exc:
        raise PreprocessError(str(problem(exc, data))) from None
    if parsed[-1].role not in ("user", "tool"):
        raise PreprocessError(
            f"messages[{len(parsed) - 1}]: the conversation must end with a user (or tool) message, found "
            f"{_a(parsed[-1].role)} message (the model answers the last user message)"
        )
    conversation = Conversation([], [], 0, 0)
    for i, message in enumerate(parsed):
        where = f"messages[{i}]"
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if isinstance(message, ToolMessage):
            if isinstance(message.content, list):  # vLLM's form: the templates take a string
                out["content"] = "\n".join(part.text for part in message.content)
            out["tool_call_id"] = message.tool_call_id
        if isinstance(message, AssistantMessage) and message.tool_calls:
            out["tool_calls"] = [
                _tool_call(f"{where}.tool_calls[{k}]", i, call, conversation)
                for k, call in enumerate(message.tool_calls)
            ]
            if not message.content:
                out["content"] = []  # vLLM's form of a call without text
        if isinstance(out["content"], str):
            conversation.texts.append(
                Text(f"{where}.content", i, None, _checked_text(f"{where}.content", out["content"]))
            )
        else:
            out["content"] = [
                _part(f"{where}.content[{j}]", i, j, part, conversation) for j, part in enumerate(out["content"])
            ]
        conversation.messages.append(out)
    return conversation


def _part(
    where: str, message: int, index: int, part: TextPart | MediaPart, conversation: Conversation
) -> dict[str, Any]:
    if isinstance(part, TextPart):
        conversation.texts.append(Text(where, message, index, _checked_text(where, part.text)))
        return {"type": "text", "text": part.text}
    if part.type == "image":
        conversation.images += 1
    elif part.type == "audio":
        conversation.audios += 1
    else:
        conversation.videos += 1
    return {"type": part.type}


def _tool_call(where: str, message: int, call: ToolCall, conversation: Conversation) -> dict[str, Any]:
    """A tool call with its ``arguments`` as an object (vLLM's form for the chat templates: a JSON
    string parsed, ``{}`` when empty or not an object)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else None
        except (json.JSONDecodeError, RecursionError):
            arguments = None  # as vLLM: a malformed call in the history must not fail every later turn
    normalized = {
        **({"id": call.id} if call.id is not None else {}),
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments if isinstance(arguments, dict) else {}},
    }
    text = _checked_text(where, json.dumps(normalized, ensure_ascii=False))
    conversation.structured.append(Text(where, message, None, text))
    return normalized


def parse_tools(raw: str | bytes) -> tuple[list[dict[str, Any]], list[Text]]:
    """The ``tools`` input (UTF-8 JSON): a non-empty array of OpenAI function tools
    ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``, and
    its texts (each tool as JSON) for the control-token check."""
    data = {"tools": _json("tools", raw)}
    if not isinstance(data["tools"], list) or not data["tools"]:
        raise PreprocessError(f"tools: expected a non-empty JSON array of tools, found {json_kind(data['tools'])}")
    try:
        _Tools.model_validate(data)
    except ValidationError as exc:
        raise PreprocessError(str(problem(exc, data))) from None
    texts = [
        Text(f"tools[{k}]", -1, None, _checked_text(f"tools[{k}]", json.dumps(tool, ensure_ascii=False)))
        for k, tool in enumerate(data["tools"])
    ]
    return data["tools"], texts


def _json(what: str, raw: str | bytes) -> Any:
    try:
        return json.loads(decode_text(raw, what))
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:
        raise PreprocessError(f"{what}: not valid JSON (nested too deeply)") from None


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
