"""Tool calling as ``vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` (vLLM 0.32)
offers it for the Qwen families, on the engine's text.

The tools reach the chat template (``preprocess``'s ``tools`` input) and, unless ``tool_choice`` is
``none``, ``mm_llm`` (``sampling_parameters``' ``tools``, ``tool_choice``, ``parallel_tool_calls``),
which gives the engine vLLM's own constraint of the calls (``vllm_seam.tool_call_params``: a
structural tag holding ``required`` and named calls to the Hermes format and the tools' schemas,
special tokens kept in the text). The model writes each call as ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` whatever the choice, so every choice but ``none`` reads the text
the same way, as vLLM's ``Hermes2ProToolParser`` does (it serves ``required`` and named calls through
its ``auto`` path): the text before the first call is the content, each block a call.

``ToolCallReader`` reads one choice: whole (``message``) or streamed (``feed``: the delta to send for
each piece of text, the name of a call as soon as it is complete, its arguments as they come).

Hand-written instead of importing vLLM's parser: it pulls in the engine's whole package (12 s and
0.5 GB for the gateway, which otherwise needs neither); ``tests/test_gateway_unit.py`` holds this
module to vLLM's parser on the same texts, whole and streamed in the same pieces, and
``bench/openai_parity.py`` to ``vllm serve``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["none", "auto", "required", "named"]
TOOL_CALL_PARSERS = ("hermes", "none")
"""``--tool-call-parser`` values: ``hermes`` (the Qwen families' format), ``none`` (no ``auto``)."""

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def tool_call_id() -> str:
    """A new call id, in vLLM's form (``make_tool_call_id``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def hermes_calls(text: str) -> tuple[list[dict[str, Any]], str | None] | None:
    """``text``'s ``<tool_call>`` blocks as calls (an unclosed last one too), and the content before
    the first (None when empty); None when it has none or one is not a JSON call (then the text is
    the answer)."""
    at = text.find(START)
    if at < 0:
        return None
    calls = []
    for block in text[at:].split(START)[1:]:
        try:
            value = json.loads(block.split(END, 1)[0])
            calls.append(_call(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
    return calls, text[:at] or None


def _overlap(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _blocks(text: str) -> list[tuple[str, bool]]:
    """(JSON text, complete) of each ``<tool_call>`` block so far: closed, or valid JSON already."""
    blocks, at = [], 0
    while (start := text.find(START, at)) >= 0:
        body = start + len(START)
        end = text.find(END, body)
        if end >= 0:
            blocks.append((text[body:end].strip(), True))
            at = end + len(END)
            continue
        raw = text[body:]
        raw = raw[: len(raw) - _overlap(raw, END)].strip()
        blocks.append((raw, bool(raw) and _is_json(raw)))
        break
    return blocks


def _arguments(block: str, complete: bool) -> str | None:
    """The arguments' text of a block so far (without the brace that closes the call, once complete)."""
    found = _ARGUMENTS.search(block)
    if found is None:
        return None
    raw = block[found.end() :]
    if complete:
        raw = raw.rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
    return raw


@dataclass
class ToolCallReader:
    """The tool calls of one choice's text (see the module docstring)."""

    mode: Mode
    parallel_tool_calls: bool | None = None
    text: str = ""
    content_sent: int = 0  # characters of text sent as content
    names: list[str] = field(default_factory=list)  # of the calls sent
    arguments_sent: list[str] = field(default_factory=list)

    @property
    def calls_sent(self) -> int:
        return len(self.names)

    def finish_reason(self, reason: str, *, calls: int, streamed: bool) -> str:
        """vLLM's: ``tool_calls`` when calls were made (auto) or asked for and the engine stopped
        (required); streamed, when calls were sent and the engine stopped (but for a named one)."""
        if streamed:
            return "tool_calls" if calls and self.mode != "named" and reason == "stop" else reason
        if (self.mode == "auto" and calls) or (self.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of the whole text, as vLLM's server answers them."""
        found = hermes_calls(text)
        calls, content = found if found is not None else ([], text)
        if self.mode == "auto":
            if found is not None and content is not None and not content.strip():
                content = None
        elif not calls and not text.strip():
            content = ""
        else:  # required, named: the text (if it made no call) or what came before the calls
            content = content or ""
        return content, calls[:1] if self.parallel_tool_calls is False else calls

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta to send for the next piece of the text (None: nothing yet)."""
        self.text += text
        deltas = []
        for index, (block, complete) in enumerate(_blocks(self.text)):
            if index == len(self.names):
                name = _NAME.search(block)
                if name is None:
                    break  # a later call waits for this one's name
                self.names.append(name.group(1))
                self.arguments_sent.append("")
                head = {"index": index, "id": tool_call_id(), "type": "function"}
                deltas.append({**head, "function": {"name": name.group(1)}})
            arguments = _arguments(block, complete)
            if arguments is not None and len(arguments) > len(self.arguments_sent[index]):
                deltas.append({"index": index, "function": {"arguments": arguments[len(self.arguments_sent[index]) :]}})
                self.arguments_sent[index] = arguments
        if self.parallel_tool_calls is False:
            deltas = [delta for delta in deltas if delta["index"] == 0]
        out: dict[str, Any] = {}
        if content := self._content():
            out["content"] = content
        if deltas:
            out["tool_calls"] = deltas
        return out or None

    def _content(self) -> str | None:
        """The text not sent yet before the first call (holding back what may begin one)."""
        at = self.text.find(START)
        sendable = len(self.text) - _overlap(self.text, START) if at < 0 else at
        if sendable <= self.content_sent:
            return None
        content = self.text[self.content_sent : sendable]
        self.content_sent = sendable
        return content


def mode_of(chat: Any) -> Mode | None:
    """How a request's choices are read (None: the request has no tools)."""
    if not chat.tools:
        return None
    choice = chat.tool_choice
    if choice is None or isinstance(choice, str):
        return choice or "none"  # type: ignore[return-value]
    return "named"


def reader(chat: Any) -> ToolCallReader | None:
    """A new reader of one of the request's choices (None: no calls to read, the text is the answer:
    no tools, or ``tool_choice: "none"``)."""
    mode = mode_of(chat)
    return None if mode in (None, "none") else ToolCallReader(mode, parallel_tool_calls=chat.parallel_tool_calls)


def sampling(chat: Any) -> dict[str, Any]:
    """What tools add to the request's ``sampling_parameters`` for ``mm_llm`` (nothing for ``none``)."""
    mode = mode_of(chat)
    if mode is None or mode == "none":
        return {}
    choice = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    out = {"tools": [tool.model_dump(exclude_none=True) for tool in chat.tools], "tool_choice": choice}
    if chat.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = chat.parallel_tool_calls
    return out
