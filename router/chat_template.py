"""``--chat-template``: a Jinja chat template given to the router instead of the model's own, as
``vllm serve`` takes it: the path of a file, or the template itself."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JINJA_MARKS = ("{{", "{%")


def load_chat_template(value: str) -> str:
    """The template ``value`` names: ``value`` itself when it is one, else a file's text."""
    if any(mark in value for mark in JINJA_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template {value}: no such file, and not a Jinja template ('{{{{' or '{{%')"
        )
    return path.read_text()


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How one chat request is rendered and tokenized (vLLM's request fields of these names)."""

    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # go on with the last message instead
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    add_special_tokens: bool = False  # the template writes BOS itself


def chat_text_length(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters a conversation and its tools put into the template: what the admission
    bounds before tokenizing (router.admission.check_text)."""
    chars = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
    return chars + (len(json.dumps(tools)) if tools else 0)
