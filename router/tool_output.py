"""A chat answer's text turned into OpenAI's ``tool_calls``, whole or streamed.

`ToolOutput` knows a request's `ToolPlan` and parser; for each choice it makes the response's
``message`` (calls with ids ``call_...``, ``content`` null when only calls, ``finish_reason``
``tool_calls`` but for a named function) or a `ToolStream` that turns the choice's text pieces
into stream deltas:

- named: the text is the call's arguments (the grammar made it so), whole or not; the first
  delta opens the call (id, name), the next ones carry the arguments piece by piece. The finish
  reason stays the workers' (``stop``, or ``length`` when ``max_tokens`` cut the arguments), as
  OpenAI's API answers a forced function, and as ``vllm serve`` does.
- required: the text is a JSON array of calls; they are sent whole when the choice ends.
- auto: text streams as content until the parser sees that a call may begin; the rest is held
  and read when the choice ends: calls if it parses, else the held text as content.

With required or auto, output that does not read as calls (cut by ``max_tokens``, or a
malformed call the model wrote) comes back as plain content with the workers' finish reason.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.tool_calls import ToolPlan
from router.tool_parsers import Parsed, ParsedCall, ToolParser, call_of

Delta = dict[str, Any]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(call: ParsedCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id(), "type": "function", "function": function}


@dataclass(frozen=True)
class ToolOutput:
    plan: ToolPlan
    parser: ToolParser

    def read(self, text: str) -> Parsed:
        """The choice's whole text as content and calls."""
        if self.plan.mode == "named":  # as streamed: a call from the first piece on, cut or not
            return (
                Parsed(None, [ParsedCall(self.plan.function or "", text)]) if text else Parsed("")
            )
        if self.plan.mode == "required":
            value = _loads(text)
            calls = [call_of(v) for v in value] if isinstance(value, list) else []
            if not calls or any(c is None for c in calls):
                return Parsed(text)
            return Parsed(None, [c for c in calls if c is not None])
        parsed = self.parser.parse(text)
        if any(c.name not in self.plan.names for c in parsed.calls):  # a tool it was not given
            return Parsed(text)
        if not self.plan.parallel and len(parsed.calls) > 1:
            return Parsed(parsed.content, parsed.calls[:1])
        return parsed

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's ``message`` and its finish reason."""
        parsed = self.read(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish_reason
        calls = [_call(c) for c in parsed.calls]
        message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
        return message, finish_reason if self.plan.mode == "named" else "tool_calls"

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass
class ToolStream:
    """One choice's stream: text in, deltas out."""

    output: ToolOutput
    text: str = ""
    num_sent: int = 0  # characters of ``text`` sent as content
    held: bool = False  # a call may have begun at ``num_sent``: the rest waits for the end
    name_sent: bool = False  # named: the call's opening delta went out
    call: str = field(default_factory=call_id)

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        mode = self.output.plan.mode
        if not piece or mode == "required":
            return []
        if mode == "named":
            function: dict[str, Any] = {"arguments": piece}
            opening: dict[str, Any] = {"index": 0, "function": function}
            if not self.name_sent:
                self.name_sent = True
                function["name"] = self.output.plan.function
                opening.update(id=self.call, type="function")
            return [{"tool_calls": [opening]}]
        if self.held:
            return []
        num_content, self.held = self.output.parser.split(self.text, self.num_sent)
        return self._content_until(num_content)

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        """The last deltas and the finish reason, when the choice ends."""
        mode = self.output.plan.mode
        if mode == "named":
            return [], finish_reason
        parsed = self.output.read(self.text)
        if not parsed.calls:
            return self._content_until(len(self.text)), finish_reason
        calls = [{"index": i, **_call(c)} for i, c in enumerate(parsed.calls)]
        return [{"tool_calls": calls}], "tool_calls"

    def _content_until(self, end: int) -> list[Delta]:
        if end <= self.num_sent:
            return []
        piece, self.num_sent = self.text[self.num_sent : end], end
        return [{"content": piece}]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json can read
        return None
