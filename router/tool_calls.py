"""A chat request's ``tools`` and ``tool_choice``, checked at the edge, and what they ask of the
rest of the router: the tools the chat template renders, and the grammar that makes a
``required`` or named choice a valid call whatever the model.

- ``none`` (the default without tools): no call; the tools are not shown to the model.
- ``auto`` (the default with tools): the template shows the tools; the answer is read for calls
  by the ``--tool-call-parser`` (router.tool_parsers) and is plain text when it holds none.
- a named function: the output is constrained to that function's parameters schema (the answer
  is the call's arguments).
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` objects,
  each naming a tool and holding arguments valid for its schema (one call when
  ``parallel_tool_calls`` is false).

The grammar goes to the workers as any structured output (``StructuredOutput``), so it holds on
every route; router.tool_output turns the constrained text back into OpenAI's ``tool_calls``.
Messages carrying ``tool_calls`` (assistant) or a ``tool_call_id`` (tool) are rendered through
the template the way transformers passes them (arguments as objects).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictStr

from common.sampling_params import StructuredOutput
from router.errors import APIError

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
Mode = Literal["none", "auto", "required", "named"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr  # JSON text, as the API returned it


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (sent back in ``messages``)."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: StrictStr = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: its mode, its tools (OpenAI's dicts, in order) and the
    function a named choice names."""

    mode: Mode
    tools: tuple[dict[str, Any], ...] = ()
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none with ``none``)."""
        return None if self.mode == "none" else list(self.tools)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of a required or named call (None: the output is free)."""
        if self.mode == "named":
            [tool] = [t for t in self.tools if t["function"]["name"] == self.function]
            return StructuredOutput("json_schema", json.dumps(_parameters(tool)))
        if self.mode != "required":
            return None
        one_call = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": _parameters(tool),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema))


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters: dict[str, Any] = tool["function"].get("parameters") or EMPTY_PARAMETERS
    return parameters


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    grammar_param: str | None,
) -> ToolPlan:
    """The request's plan, or a 400 naming the field at fault. ``grammar_param``: the field
    of the request's own structured output (response_format, structured_outputs), if any."""
    if tools is not None and not tools:
        raise APIError(400, "Invalid 'tools': empty array; give at least one tool", "tools")
    checked = tuple(_checked_tool(i, tool) for i, tool in enumerate(tools or []))
    _check_encodable(checked, "tools")
    names: set[str] = set()
    for i, tool in enumerate(checked):
        name = tool["function"]["name"]
        if name in names:
            raise APIError(400, f"duplicate function name {name!r}", f"tools.{i}.function.name")
        names.add(name)
    parallel = parallel_tool_calls is not False
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if choice == "none":
        return ToolPlan("none", checked, parallel=parallel)
    if not checked:
        msg = "Invalid value for 'tool_choice': it is only allowed when 'tools' are specified"
        raise APIError(400, msg, "tool_choice")
    if choice == "auto":
        return ToolPlan("auto", checked, parallel=parallel)
    plan = _forced_plan(choice, checked, names, parallel)
    if grammar_param is not None:
        msg = f"{grammar_param} cannot be combined with a required or named tool_choice"
        raise APIError(400, msg, grammar_param)
    return plan


def _forced_plan(
    choice: str | dict[str, Any],
    tools: tuple[dict[str, Any], ...],
    names: set[str],
    parallel: bool,
) -> ToolPlan:
    """The plan of ``required`` or a named function (the other choices are refused here)."""
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if isinstance(choice, str):
        msg = f"Invalid value for 'tool_choice': {choice!r}; use none, auto, required or a function"
        raise APIError(400, msg, "tool_choice")
    if choice.get("type") != "function":
        raise APIError(
            400, "Invalid value for 'tool_choice.type': expected 'function'", "tool_choice.type"
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            400, "'tool_choice.function.name' is a required field", "tool_choice.function.name"
        )
    if name not in names:
        msg = f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'"
        raise APIError(400, msg, "tool_choice.function.name")
    return ToolPlan("named", tools, function=name, parallel=parallel)


def _checked_tool(index: int, tool: ToolDefinition) -> dict[str, Any]:
    """``tool`` as the dict the template and the grammar read, once its fields are valid."""
    if tool.type != "function":
        msg = f"Invalid value for 'tools.{index}.type': {tool.type!r}; only 'function' is supported"
        raise APIError(400, msg, f"tools.{index}.type")
    function = tool.function
    if not NAME.fullmatch(function.name):
        msg = (
            f"Invalid 'tools.{index}.function.name': {function.name[:80]!r} must be 1 to 64 "
            "letters, digits, underscores or dashes"
        )
        raise APIError(400, msg, f"tools.{index}.function.name")
    if function.parameters is not None:
        _check_parameters(function.name, function.parameters, f"tools.{index}.function.parameters")
    return {"type": "function", "function": function.model_dump(exclude_none=True)}


def _check_parameters(name: str, schema: dict[str, Any], param: str) -> None:
    """What a function's parameters must be to compile: a JSON Schema of an object. (Deeper
    faults are found by the workers' grammar compiler, also as a 400, when it is used.)"""
    problem = None
    if schema.get("type", "object") != "object":
        problem = f"its type must be 'object', got {schema.get('type')!r}"
    elif not isinstance(schema.get("properties", {}), dict):
        problem = "'properties' must be an object"
    else:
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            problem = "'required' must be an array of strings"
    if problem is not None:
        raise APIError(400, f"Invalid schema for function {name!r}: {problem}", param)


def message_tool_fields(
    index: int, role: str, tool_calls: list[MessageToolCall] | None, tool_call_id: str | None
) -> dict[str, Any]:
    """What a message adds to its template dict: an assistant's calls (their arguments as
    objects, as transformers' templates expect), a tool result's ``tool_call_id``."""
    fields: dict[str, Any] = {}
    _check_encodable([c.model_dump() for c in tool_calls or []], f"messages.{index}.tool_calls")
    _check_encodable(tool_call_id, f"messages.{index}.tool_call_id")
    if tool_calls:
        if role != "assistant":
            msg = "only assistant messages carry tool_calls"
            raise APIError(400, msg, f"messages.{index}.tool_calls")
        fields["tool_calls"] = [_template_call(call) for call in tool_calls]
    if role == "tool":
        if tool_call_id is None:
            msg = f"'messages.{index}.tool_call_id' is a required field"
            raise APIError(400, msg, f"messages.{index}.tool_call_id")
        fields["tool_call_id"] = tool_call_id
    return fields


def _check_encodable(value: Any, param: str) -> None:
    """JSON may carry lone surrogates (``"\\ud800"``); no tokenizer takes them."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "must be valid Unicode text (it has a lone surrogate)", param) from None


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # passed on as sent: the template decides
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}
