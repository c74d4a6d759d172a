"""The pieces of a chat conversation that both entries validate with pydantic -- the OpenAI gateway
(``mmserve.gateway.protocol``) and ``preprocess``'s ``messages`` and ``tools`` inputs
(``mmserve.serving.preprocess.messages``) -- and how a refused value is told: the place as the client
wrote it (``messages[0].content[1].type``) and what was wrong there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Strict(BaseModel):
    """Unknown fields are refused, never dropped."""

    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ToolMessage(Strict):
    """A tool's answer to the call ``tool_call_id``."""

    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the grammar backend holds required/named calls to the schema either way


class Tool(Strict):
    """An OpenAI function tool, as the chat templates show it to the model."""

    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True)
class Problem:
    """What was refused: ``param`` (``""`` for the value as a whole), ``message``, and an OpenAI
    error code (``unknown_field``, ``missing_field``, ``invalid_value``)."""

    param: str
    message: str
    code: str = "invalid_value"

    def __str__(self) -> str:
        return f"{self.param}: {self.message}" if self.param else self.message


def problem(exc: ValidationError, data: Any) -> Problem:
    """The most specific of pydantic's errors (the deepest: a union reports each branch), placed in
    ``data``, the value that was validated."""
    errors = exc.errors(include_url=False)
    error = max(errors, key=lambda e: (len(e["loc"]), e["type"] != "string_type"))
    param = _param(tuple(error["loc"]), data)
    kind, message = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return Problem(param, "unknown field", "unknown_field")
    if kind == "missing":
        return Problem(param, "required", "missing_field")
    if kind == "union_tag_not_found":  # a message without role, a part without type
        return Problem(f"{param}.{error['ctx']['discriminator'].strip(chr(39))}", "required", "missing_field")
    if kind == "union_tag_invalid":
        message = (
            f"unsupported {error['ctx']['discriminator'].strip(chr(39))} {_shown(error['ctx']['tag'])}; "
            f"expected one of {error['ctx']['expected_tags']}"
        )
    elif kind == "value_error":  # a model's own rule: its text
        message = str(error["ctx"]["error"])
    elif kind in ("list_type", "string_type") and param.endswith(".content"):
        message = f"expected a string or a list of content parts, found {json_kind(error['input'])}"
    elif kind == "literal_error":
        message = f"expected {error['ctx']['expected']}, found {_shown(error['input'])}"
    elif kind.endswith("_type"):
        message = f"{message}, found {json_kind(error['input'])}"
    return Problem(param, message)


def json_kind(value: Any) -> str:
    """What a JSON value is, for messages: "an object", "a number", ..."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an empty array" if not value else "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null" if value is None else type(value).__name__


def _shown(value: Any, limit: int = 40) -> str:
    """A value as a message shows it, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _param(loc: tuple[Any, ...], data: Any) -> str:
    """pydantic's ``loc`` as the client wrote it, e.g. ``("messages", 0, "user", "content",
    "list[...]", 1, "image_url", "image_url", "url")`` -> ``messages[0].content[1].image_url.url``.
    Walks the data: a union's tag (the item's ``type`` or ``role`` after its index) and a name that
    is not a key of the object there (a union's branch) are left out, but for the last one (a
    missing field)."""
    out = ""
    for n, item in enumerate(loc):
        if (
            n > 1
            and isinstance(loc[n - 1], int)
            and isinstance(data, dict)
            and (
                (loc[n - 2] == "messages" and item == data.get("role"))
                or ("tagged-union[" in str(loc[n - 2]) and item == data.get("type"))
            )
        ):
            continue  # the tag of a tagged union (a message's role, a part's type), after the item's index
        if isinstance(item, int):
            out += f"[{item}]"
            data = data[item] if isinstance(data, list) and -len(data) <= item < len(data) else None
        elif (isinstance(data, dict) and item in data) or (n == len(loc) - 1 and "[" not in item):
            out += f".{item}" if out else item
            data = data.get(item) if isinstance(data, dict) else None
    return out
