"""Tool calling as ``vllm serve`` offers it for the Qwen families (``--enable-auto-tool-choice
--tool-call-parser hermes``), on the engine's text.

* ``tool_choice: "none"``: the tools reach the chat template; the text is the answer.
* ``"required"`` and a named function: the engine's structured output holds the text to a JSON
  schema built from the tools (``constraint``, vLLM's ``get_json_schema_from_tools``): an array of
  ``{"name", "parameters"}`` for ``required``, the function's arguments for a named one; the text is
  read back as the calls.
* ``"auto"`` (the default with tools): the model writes ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks (the Hermes format of the Qwen chat templates), read back as calls;
  the text before the first block is the content.

``ToolCallReader`` reads one choice: whole (``message``) or streamed (``feed`` then ``finish``, each
returning the delta to send). Streamed, a named function's arguments go out as they are generated;
an ``auto`` call goes out whole once its closing tag is in, and ``required``'s calls at the end (the
array is parsed whole): a client that joins the deltas, as the SDKs do, gets what vLLM sends.

Hand-written instead of importing vLLM's parsers: those pull in the engine's whole package (12 s and
0.5 GB for the gateway, which otherwise needs neither); ``tests/test_gateway_unit.py`` holds this
module to vLLM's own code (``Hermes2ProToolParser``, ``get_json_schema_from_tools``) on the same
inputs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["none", "auto", "required", "named"]
TOOL_CALL_PARSERS = ("hermes", "none")
"""``--tool-call-parser`` values: ``hermes`` (the Qwen families' format), ``none`` (no ``auto``)."""

START, END = "<tool_call>", "</tool_call>"


def tool_call_id() -> str:
    """A new call id, in vLLM's form (``make_tool_call_id``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def constraint(
    mode: Mode, tools: Sequence[dict[str, Any]], name: str | None, parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    """The JSON schema the engine holds the text to (``structured_outputs.json``), or None (none, auto).
    ``tools``: the request's tools as dicts (``{"type": "function", "function": {...}}``)."""
    functions = [tool["function"] for tool in tools]
    if mode == "named":
        return _arguments_schema(next(f for f in functions if f["name"] == name).get("parameters"))
    if mode != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for function in functions:
        parameters = dict(function.get("parameters") or {})
        for key, value in parameters.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"Tool definition '{key}' has multiple schemas, which is not supported.")
            defs[key] = value
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": _arguments_schema(parameters),  # its $defs moved to the top, as vLLM's
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def hermes_calls(text: str) -> tuple[list[dict[str, Any]], str | None] | None:
    """``text``'s ``<tool_call>`` blocks as calls, and the content before the first (None when
    empty); None when it has none or one is not a JSON call (then the text is the answer)."""
    at = text.find(START)
    if at < 0:
        return None
    calls = []
    for block in text[at:].split(START)[1:]:
        body = block.split(END, 1)[0]
        try:
            value = json.loads(body)
            calls.append(_call(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
    return calls, text[:at] or None


def required_calls(text: str) -> list[dict[str, Any]]:
    """``required``'s JSON array read as calls (none when it is not one)."""
    try:
        value = json.loads(text)
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
    except (ValueError, KeyError, TypeError, RecursionError):
        return []


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallReader:
    """The tool calls of one choice's text (see the module docstring)."""

    mode: Mode
    name: str | None = None  # the named function
    parallel_tool_calls: bool | None = None
    text: str = ""
    sent: int = 0  # auto: characters of text handled (sent as content, or inside a call sent)
    calls: int = 0  # calls sent
    named_id: str | None = None
    _done: bool = field(default=False, repr=False)

    def finish_reason(self, reason: str, *, calls: int, streamed: bool) -> str:
        """vLLM's: ``tool_calls`` when the engine stopped and calls were made (auto), were asked for
        (required, not streamed) or were sent (streamed, but for a named function); else the engine's."""
        if streamed:
            return "tool_calls" if calls and self.mode != "named" and reason == "stop" else reason
        if (self.mode == "auto" and calls) or (self.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason

    # -- the whole text -------------------------------------------------------------------------
    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of the whole text, as vLLM's server answers them."""
        calls: list[dict[str, Any]] = []
        content: str | None = text
        if self.mode == "named":
            calls = [_call(str(self.name), text)] if text.strip() else []
            content = ""
        elif self.mode == "required":
            calls, content = required_calls(text), ""
        elif self.mode == "auto" and (found := hermes_calls(text)) is not None:
            calls, content = found
            if content is not None and not content.strip():
                content = None
        return content, self._limited(calls)

    def _limited(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return calls[:1] if self.parallel_tool_calls is False else calls

    # -- streamed -------------------------------------------------------------------------------
    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta to send for the next piece of text (None: nothing yet)."""
        self.text += text
        if self.mode == "none":
            return {"content": text} if text else None
        if self.mode == "named":
            if not text:
                return None
            if self.named_id is None:
                self.named_id, self.calls = tool_call_id(), 1
                head = {"index": 0, "id": self.named_id, "type": "function"}
                return {"tool_calls": [{**head, "function": {"name": self.name, "arguments": text}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if self.mode == "required":
            return None  # parsed whole at the end
        return self._auto(final=False)

    def finish(self) -> dict[str, Any] | None:
        """The delta to send when the text is complete (None: nothing more)."""
        if self._done:
            return None
        self._done = True
        if self.mode == "required":
            return self._deltas(self._limited(required_calls(self.text)))
        if self.mode == "auto":
            return self._auto(final=True)
        return None

    def _deltas(self, calls: list[dict[str, Any]], content: str | None = None) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if self.parallel_tool_calls is False:
            calls = calls[: max(0, 1 - self.calls)]
        if calls:
            out["tool_calls"] = [{"index": self.calls + k, **call} for k, call in enumerate(calls)]
            self.calls += len(calls)
        return out or None

    def _auto(self, *, final: bool) -> dict[str, Any] | None:
        content, calls = "", list[dict[str, Any]]()
        while rest := self.text[self.sent :]:
            start = rest.find(START)
            if self.calls == 0 and not calls:  # before the first call: the text is content
                if start < 0:
                    cut = len(rest) if final else len(rest) - _held_back(rest)
                    content += rest[:cut]
                    self.sent += cut
                    break
                content += rest[:start]
                self.sent += start
                rest, start = rest[start:], 0
            if start < 0:  # text after the calls: left out, as vLLM's parser leaves it
                if final:
                    self.sent = len(self.text)
                break
            end = rest.find(END, start)
            if end < 0 and not final:
                break  # the call is not complete yet
            body = rest[start + len(START) : end if end >= 0 else len(rest)]
            try:
                value = json.loads(body)
                calls.append(_call(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
            except (ValueError, KeyError, TypeError, RecursionError):
                content += rest  # not a call: the text is the answer
                self.sent = len(self.text)
                break
            self.sent += end + len(END) if end >= 0 else len(rest)
        return self._deltas(calls, content)


def mode_of(chat: Any) -> Mode | None:
    """How a request's choices are read (None: the request has no tools)."""
    if not chat.tools:
        return None
    choice = chat.tool_choice
    if choice is None or isinstance(choice, str):
        return choice or "none"  # type: ignore[return-value]
    return "named"


def reader(chat: Any) -> ToolCallReader | None:
    """A new reader of one of the request's choices (None: the request has no tools)."""
    mode = mode_of(chat)
    if mode is None:
        return None
    name = chat.tool_choice.function.name if mode == "named" else None
    return ToolCallReader(mode, name=name, parallel_tool_calls=chat.parallel_tool_calls)


def sampling(chat: Any) -> dict[str, Any]:
    """What tools add to the request's sampling parameters (vLLM's ``adjust_request`` of the hermes
    parser): special tokens kept in the text, and the constraint of required and named calls."""
    mode = mode_of(chat)
    if mode is None or mode == "none":
        return {}
    tools = [tool.model_dump(exclude_none=True) for tool in chat.tools]
    name = chat.tool_choice.function.name if mode == "named" else None
    schema = constraint(mode, tools, name, chat.parallel_tool_calls)
    return {"skip_special_tokens": False, **({"structured_outputs": {"json": schema}} if schema is not None else {})}
