"""Tool calls a model writes as text (``tool_choice: auto``), read back per chat format.

Each model family writes its calls its own way; ``--tool-call-parser`` names the format:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (Hermes 2 Pro, Qwen 2 / 2.5 and most ChatML tool templates);
- ``llama3_json``: Llama 3.1 / 3.2's JSON calls, ``{"name": ..., "parameters": {...}}`` as the
  whole answer, optionally after ``<|python_tag|>``, several separated by ``;``.

An answer that starts like a call but does not parse (bad JSON, no name, arguments that are not
an object) is returned as plain text: a malformed call is the model's answer, never an error.
A parser also tells the streamer how much of a growing text is surely plain content
(`ToolParser.split`), so text streams as usual until a call may have begun.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's ``function.arguments``)


@dataclass(frozen=True)
class Parsed:
    """A whole answer read: its plain text (None when only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The whole answer's content and calls; ``Parsed(text)`` when it holds no valid call."""

    @abstractmethod
    def split(self, text: str, start: int = 0) -> tuple[int, bool]:
        """For streaming a growing ``text``: how many leading characters are surely plain content,
        and whether a call has begun right after them (then the rest waits for the end).
        ``start``: characters already known to be content (not searched again)."""


class HermesParser(ToolParser):
    name = "hermes"
    START = "<tool_call>"
    # a call's block: up to its end tag, or to the end of the text (a stop string ate the tag)
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text)
        calls = [call_of(_loads(m.group(1))) for m in self.BLOCK.finditer(text, start)]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed(_content(text[:start]), [c for c in calls if c is not None])

    def split(self, text: str, start: int = 0) -> tuple[int, bool]:
        begin = text.find(self.START, start)
        if begin >= 0:
            return begin, True
        return len(text) - held_back(text, self.START), False


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        tag = text.find(self.TAG)
        if tag >= 0:
            before, body = text[:tag], text[tag + len(self.TAG) :]
        elif text.lstrip().startswith("{"):
            before, body = "", text
        else:
            return Parsed(text)
        calls = _json_calls(body)
        return Parsed(_content(before), calls) if calls else Parsed(text)

    def split(self, text: str, start: int = 0) -> tuple[int, bool]:
        tag = text.find(self.TAG, start)
        if tag >= 0:
            return tag, True
        if start == 0:  # nothing sent yet: the answer may still open with a call
            stripped = text.lstrip()
            if stripped.startswith("{"):
                return 0, True
            if self.TAG.startswith(stripped):  # nothing yet, or the tag's beginning
                return 0, False
        return len(text) - held_back(text, self.TAG), False


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}
PARSER_NAMES = ("auto", *PARSERS)


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser ``name`` names; ``auto``: the one the chat template writes calls for (a
    template that shows ``<|python_tag|>`` or asks for ``"parameters"`` without ``<tool_call>``
    is Llama 3's), else ``hermes``."""
    if name != "auto":
        return PARSERS[name]
    template = chat_template or ""
    llama = "<|python_tag|>" in template or '"parameters"' in template
    if llama and "<tool_call>" not in template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


def call_of(value: Any) -> ParsedCall | None:
    """``{"name": str, "arguments" | "parameters": object or its JSON text}`` as a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that could be ``marker``'s beginning."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _json_calls(body: str) -> list[ParsedCall]:
    """Calls written as JSON objects separated by ``;`` or white space ([] if any is bad)."""
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or (calls and body[pos] == ";")):
            pos += 1
        if pos == len(body):
            return calls
        try:
            value, pos = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return []
        call = call_of(value)
        if call is None:
            return []
        calls.append(call)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json can read
        return None


def _content(text: str) -> str | None:
    return text if text.strip() else None
