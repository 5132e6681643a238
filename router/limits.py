"""Bounds on the work one request may ask for, checked at the edge before any of it is done.

A request is refused with a 400 naming the limit and its flag when its body nests deeper than
``max_body_depth``, when it fans out (prompts x n) to more than ``max_fan_out`` sub-requests or
sends more than ``max_prompts`` prompts, when its stop strings are too many or too long, when a
chat has more than ``max_messages`` messages, or when its prompts together hold more than
``max_request_prompt_tokens`` tokens or it may generate more than ``max_request_output_tokens``
(max_tokens x n over its prompts). The structural checks run before tokenization; the token
checks right after it, before any worker is called. Each sub-request then takes one of the
router's ``max_concurrency`` slots.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from router.config import RouterConfig
from router.errors import APIError


def refuse(what: str, value: int, limit: int, flag: str, param: str | None) -> APIError:
    """The 400 for a request over a limit: what, how much, the limit and the flag that sets it."""
    return APIError(
        400,
        f"{what} is {value}, over this server's limit of {limit} ({flag})",
        param=param,
        code="request_too_large",
    )


def check_body_depth(body: bytes, max_depth: int) -> None:
    """Refuse a JSON body nested deeper than ``max_depth`` (before the app parses it: a deep
    enough body would exhaust the parser's recursion). Bodies that are not JSON pass: the app
    answers those with its own 400."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # no deeper than its containers: a byte count spares a parse (it holds the GIL)
    try:
        value = json.loads(body)
    except RecursionError:
        deep = sys.getrecursionlimit()
        raise refuse(
            "the request body's nesting depth", deep, max_depth, "--max-body-depth", None
        ) from None
    except ValueError:
        return
    check_depth(value, max_depth)


def check_depth(body: Any, max_depth: int) -> None:
    """Refuse a JSON value nested deeper than ``max_depth`` (walked without recursion, stopping
    at the first path that is too deep)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise refuse(
                "the request body's nesting depth", depth, max_depth, "--max-body-depth", None
            )
        stack.extend((child, depth + 1) for child in children)


def check_fan_out(config: RouterConfig, num_prompts: int, n: int) -> None:
    """n, prompts and prompts x n against their limits (before anything is tokenized)."""
    if n > config.max_n:
        raise refuse("n", n, config.max_n, "--max-n", "n")
    if num_prompts > config.max_prompts:
        raise refuse(
            "the number of prompts", num_prompts, config.max_prompts, "--max-prompts", "prompt"
        )
    for limit, flag in (
        (config.max_fan_out, "--max-fan-out"),
        (config.max_concurrency, "--max-concurrency"),
    ):
        if num_prompts * n > limit:  # over --max-concurrency, it could never run
            param = "n" if n > 1 else "prompt"  # the field that made it wide
            raise refuse(
                "the number of sub-requests (prompts x n)", num_prompts * n, limit, flag, param
            )


def check_stops(config: RouterConfig, stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > config.max_stop_strings:
        raise refuse(
            "the number of stop strings",
            len(stops),
            config.max_stop_strings,
            "--max-stop-strings",
            "stop",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > config.max_stop_chars:
        raise refuse(
            "a stop string's length", longest, config.max_stop_chars, "--max-stop-chars", "stop"
        )


def check_messages(config: RouterConfig, num_messages: int) -> None:
    if num_messages > config.max_messages:
        raise refuse(
            "the number of messages",
            num_messages,
            config.max_messages,
            "--max-messages",
            "messages",
        )


def check_tokens(
    config: RouterConfig, prompt_lens: Sequence[int], max_tokens: Sequence[int], n: int, param: str
) -> None:
    """The request's prompt tokens and its possible output tokens, all prompts together."""
    total_prompt = sum(prompt_lens)
    if total_prompt > config.max_request_prompt_tokens:
        raise refuse(
            "the request's prompt tokens",
            total_prompt,
            config.max_request_prompt_tokens,
            "--max-request-prompt-tokens",
            "prompt" if len(prompt_lens) > 1 else None,
        )
    total_output = n * sum(max_tokens)
    if total_output > config.max_request_output_tokens:
        raise refuse(
            "the tokens the request may generate (max_tokens x n over its prompts)",
            total_output,
            config.max_request_output_tokens,
            "--max-request-output-tokens",
            param,
        )
