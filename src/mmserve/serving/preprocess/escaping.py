"""Control tokens typed in user text: tokenized as plain text (``escape``) or refused (``reject``).

Escaping runs only when a text holds one of the tokenizer's special-token strings: the template is
rendered with a one-token sentinel in place of that text, the processor runs on it, and the
sentinel's id (with the plain text around it up to the nearest special token, so that token
boundaries are the natural ones) is replaced by the text tokenized with ``split_special_tokens``.
Sentinels with only plain text between them form one run, tokenized as one text.
Tool calls and tools are rendered by the template as JSON: a control token there is refused under
either policy.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mmserve.serving.preprocess.limits import PreprocessError
from mmserve.serving.preprocess.messages import Conversation

ControlTokenPolicy = Literal["escape", "reject"]
CONTROL_TOKEN_POLICIES: tuple[str, ...] = ("escape", "reject")


@dataclass
class Run:
    """Escaped texts whose sentinels have only plain text between them: where the run sits in the
    processor's ids, and what replaces it."""

    sentinels: int  # how many sentinels (escaped texts) the run holds
    lead: int  # ids of the plain text between the previous special token and the first sentinel
    expected: list[int]  # the processor's ids of the run: lead, sentinel, (plain text, sentinel)..., trail
    ids: list[int]  # lead + text (+ plain text + text)... + trail, special-token strings as plain text


def special_tokens(tokenizer: Any, placeholders: Iterable[str]) -> tuple[str, ...]:
    """The tokenizer's special tokens and the placeholders, longest first (the longest match wins)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    tokens = {token.content for token in added.values() if getattr(token, "special", False)}
    tokens.update(tokenizer.all_special_tokens)
    tokens.update(placeholders)
    return tuple(sorted((t for t in tokens if t), key=lambda t: (-len(t), t)))


class ControlTokens:
    """The special-token strings of one tokenizer, and the sentinel that stands for escaped text.

    Args:
        tokenizer: the processor's tokenizer.
        placeholders: the family's media placeholder tokens.
        template_text: the chat template rendered with every kind of part; with ``reserved`` (the
            processor's own media tokens), the tokens the sentinel must never be.
    """

    def __init__(
        self, tokenizer: Any, placeholders: Collection[str], template_text: str, reserved: Iterable[str | None] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens = special_tokens(tokenizer, placeholders)
        self.pattern = re.compile("|".join(re.escape(t) for t in self.tokens) or r"(?!)")
        self.sentinel, self.sentinel_id = "", -1  # nothing to escape, ever
        if self.tokens:
            busy = {*self.pattern.findall(template_text), *placeholders, *reserved}
            vocab: Mapping[str, int] = tokenizer.get_vocab()
            free = sorted((vocab[t], t) for t in self.tokens if t not in busy and t in vocab)
            if not free:
                raise ValueError("no special token is free to stand for the user's text")
            self.sentinel_id, self.sentinel = free[0]

    def template(
        self, conversation: Conversation, policy: str, render: Callable[[Sequence[Mapping[str, Any]]], str]
    ) -> tuple[str, list[Run] | None]:
        """The conversation rendered by ``render``, and how to splice its escaped texts back in
        (None: no text is escaped). Under ``policy="reject"`` a control token is an error."""
        for text in conversation.structured:
            found = self.pattern.search(text.text)
            if found is not None:  # rendered as JSON by the template: no text of its own to escape
                raise PreprocessError(
                    f"{text.where}: the control token {found.group()!r} is not accepted in tool calls and "
                    "tools (the chat template renders them as JSON, where it can't be escaped)"
                )
        escaped = []
        for text in conversation.texts:
            found = self.pattern.search(text.text)
            if found is None:
                continue
            if policy == "reject":
                raise PreprocessError(
                    f"{text.where}: the control token {found.group()!r} at character {found.start()} is not "
                    "accepted in user text (user_control_tokens=reject)"
                )
            escaped.append(text)
        if not escaped:
            return render(conversation.messages), None
        messages = copy.deepcopy(conversation.messages)
        for text in escaped:
            if text.part is None:
                messages[text.message]["content"] = self.sentinel
            else:
                messages[text.message]["content"][text.part]["text"] = self.sentinel
        prompt = render(messages)
        return prompt, self._runs(prompt, [text.text for text in escaped])

    def _runs(self, prompt: str, texts: Sequence[str]) -> list[Run]:
        """How to splice ``texts`` (escaped, in order) over their sentinels in ``prompt``'s ids."""
        segments = prompt.split(self.sentinel)
        if len(segments) != len(texts) + 1:
            raise RuntimeError(
                f"the chat template renders the user text sentinel {self.sentinel!r} "
                f"{len(segments) - 1} times for {len(texts)} escaped text(s)"
            )
        runs: list[Run] = []
        k = 0
        while k < len(texts):
            lead = self.pattern.split(segments[k])[-1]
            lead_ids = self._tokenize(lead)
            expected = [*lead_ids, self.sentinel_id]
            joined, count = lead + texts[k], 1
            # Only plain text up to the next sentinel: one run, tokenized as one text.
            while k + 1 < len(texts) and not self.pattern.search(segments[k + 1]):
                expected += [*self._tokenize(segments[k + 1]), self.sentinel_id]
                joined += segments[k + 1] + texts[k + 1]
                k, count = k + 1, count + 1
            trail = self.pattern.split(segments[k + 1])[0]
            expected += self._tokenize(trail)
            runs.append(Run(count, len(lead_ids), expected, self._tokenize(joined + trail, split_special_tokens=True)))
            k += 1
        return runs

    def _tokenize(self, text: str, *, split_special_tokens: bool = False) -> list[int]:
        if not text:
            return []
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)
        return list(encoded["input_ids"])

    def splice(self, input_ids: np.ndarray, runs: Sequence[Run]) -> np.ndarray:
        """``input_ids`` with each run of sentinels (and the plain text around them) replaced by the
        texts' ids, in order."""
        (where,) = np.nonzero(input_ids == self.sentinel_id)
        expected = sum(run.sentinels for run in runs)
        if where.size != expected:
            raise RuntimeError(
                f"the sentinel {self.sentinel!r} occurs {where.size} times in the prompt ids, expected {expected}"
            )
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
