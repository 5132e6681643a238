"""``--chat-template``: a Jinja chat template given to the router instead of the model's own, as
``vllm serve`` takes it: the path of a file, or the template itself."""

from __future__ import annotations

from pathlib import Path

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
