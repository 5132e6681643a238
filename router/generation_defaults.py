"""Sampling defaults from the model's ``generation_config.json``, as ``vllm serve`` applies them.

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or
``repetition_penalty`` out gets the model's value instead of OpenAI's (temperature 1.0 ...),
and the model's ``max_new_tokens`` caps every request's output length, as vLLM does. Where the
defaults come from is ``--generation-config``: ``auto`` (the model directory's file, the
default), ``vllm`` (none: OpenAI's and vLLM's own defaults) or a directory holding a
``generation_config.json``. Read once, when the router starts; applied when a request is
parsed, before its SamplingParams are built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from common.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
SOURCES = ("auto", "vllm")  # or a directory
# The request fields a model may default, and what the file calls them.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
Request = TypeVar("Request", bound=BaseModel)


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's sampling defaults; None: the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens: a cap on every request

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> GenerationDefaults:
        values: dict[str, Any] = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
        if config.get("max_new_tokens") is not None:
            values["max_tokens"] = int(config["max_new_tokens"])
        defaults = cls(**values)
        sampling = {k: v for k, v in defaults.as_dict().items() if k in SAMPLING_KEYS}
        SamplingParams(**sampling, max_tokens=defaults.max_tokens or 1)  # ValueError names it
        return defaults

    def as_dict(self) -> dict[str, Any]:
        """The defaults that are set (for the router's start-up log line)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def apply(self, request: Request) -> Request:
        """``request`` with the sampling fields it left out set to the model's values."""
        unset = {
            k: getattr(self, k)
            for k in SAMPLING_KEYS
            if getattr(self, k) is not None and getattr(request, k, None) is None
        }
        return request.model_copy(update=unset) if unset else request

    def cap_max_tokens(self, max_tokens: int) -> int:
        """The output length a request gets: its own (or the room left), at most the model's."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


def load_generation_defaults(source: str, model_dir: Path) -> GenerationDefaults:
    """The defaults ``--generation-config source`` names for the model in ``model_dir``."""
    if source == "vllm":
        return GenerationDefaults()
    folder = model_dir if source == "auto" else Path(source).expanduser()
    path = folder / FILE_NAME
    if not path.is_file():
        if source == "auto":
            return GenerationDefaults()  # the model has none: OpenAI's defaults stand
        raise ValueError(f"--generation-config {source}: no {FILE_NAME} in that directory")
    try:
        config = json.loads(path.read_text())
        return GenerationDefaults.from_dict(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a usable {FILE_NAME}: {exc}") from exc
