"""The chaos soak's requests (see ``benchmarks/chaos.py``).

``Client`` sends a prompt of the pool (``chaos_reference``: token ids, n = 1 or 2) to
one of the routers and classifies how it ended (``Outcome``): every choice is compared, token
for token (``logprobs: 0`` names each generated token) and as text, with the offline engine's
answer. ``error_key`` groups alike failures.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from chaos_reference import Prompt, Reference
from chaos_system import ChaosConfig

OUTCOMES = ("correct", "wrong", "failed_clear", "failed_unclear", "hung", "disconnected")
ROUTES = ("streamed", "whole")  # the hand-off: KV pulled while the prompt computes, or after


@dataclass
class Choice:
    """One choice of an answer as it came: text and tokens (as ``logprobs.tokens`` names
    them), and whether it finished."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finished: bool = False


@dataclass
class Outcome:
    """How one request ended; ``kind`` is one of OUTCOMES."""

    kind: str
    prompt: str
    stream: bool
    route: str
    seconds: float
    detail: str = ""
    choices: list[Choice] = field(default_factory=list)


class Client:
    """Sends pool prompts to the routers (``urls``: route -> base URL) and judges the answers
    against ``references``."""

    def __init__(
        self,
        urls: dict[str, str],
        model: str,
        config: ChaosConfig,
        refs: dict[str, list[Reference]],
    ):
        self.urls = urls
        self.model = model
        self.config = config
        self.references = refs
        limit = config.concurrency + config.burst + 4
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            timeout=httpx.Timeout(config.request_timeout + 5),  # ours below fires first
            trust_env=False,
        )

    async def send(
        self,
        prompt: Prompt,
        stream: bool,
        route: str,
        hang_up_after: int = 0,
        cancel_after: float = 0.0,
    ) -> Outcome:
        """One request. ``hang_up_after``: close a stream after that many text chunks;
        ``cancel_after``: give up on a non-streaming answer after that many seconds."""
        start = time.monotonic()
        body = {"prompt": list(prompt.token_ids), "model": self.model, "n": prompt.n}
        body |= {"max_tokens": self.config.max_tokens, "logprobs": 0}
        body |= {"temperature": prompt.temperature}
        body |= {"seed": prompt.seed} if prompt.seed is not None else {}
        body |= {"stream": stream}
        url = self.urls[route] + "/v1/completions"
        choices = [Choice() for _ in range(prompt.n)]
        exchange = (
            self._stream(url, body, choices, hang_up_after) if stream else self._post(url, body)
        )
        limit = cancel_after or self.config.request_timeout
        try:
            kind, detail, got = await asyncio.wait_for(exchange, limit)
            choices = got or choices
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            kind = "disconnected" if cancel_after else "hung"
            detail = f"no complete answer in {limit:g} s ({type(exc).__name__})"
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            kind, detail = "failed_unclear", f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
        return self._judge(Outcome(kind, prompt.key, stream, route, seconds, detail, choices))

    def _judge(self, outcome: Outcome) -> Outcome:
        """completed -> correct | wrong: every choice must equal the reference, token for
        token; a clear failure's or a hang-up's streamed tokens must be a prefix of it."""
        refs = self.references[outcome.prompt]
        if outcome.kind not in ("completed", "failed_clear", "disconnected"):
            return outcome
        complete = outcome.kind == "completed"
        for index, (choice, ref) in enumerate(zip(outcome.choices, refs)):
            same = choice.tokens == list(ref.tokens) and choice.text == ref.text
            prefix = list(ref.tokens[: len(choice.tokens)]) == choice.tokens
            if (complete and not same) or (not complete and not prefix):
                outcome.detail = (
                    f"choice {index}: got {choice.tokens!r} ({choice.text!r}), expected "
                    f"{list(ref.tokens)!r} ({ref.text!r}); {outcome.detail}"
                )
                outcome.kind = "wrong"
                return outcome
        if complete:
            outcome.kind = "correct"
        return outcome

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[str, str, list[Choice]]:
        answer = await self.http.post(url, json=body)
        if answer.status_code != 200:
            return (*_error_answer(answer.status_code, answer.text), [])
        choices = [Choice() for _ in range(body["n"])]
        for item in answer.json()["choices"]:
            choice = choices[item["index"]]
            choice.text = item["text"] or ""
            choice.tokens = list(item["logprobs"]["tokens"])
            choice.finished = bool(item.get("finish_reason"))
        if not all(c.finished for c in choices):
            return "failed_unclear", "a choice without a finish_reason", choices
        return "completed", "", choices

    async def _stream(
        self, url: str, body: dict[str, Any], choices: list[Choice], hang_up_after: int
    ) -> tuple[str, str, list[Choice]]:
        """Fills ``choices`` as chunks come (so that a timeout keeps what came)."""
        chunks = 0
        async with self.http.stream("POST", url, json=body) as answer:
            if answer.status_code != 200:
                return (*_error_answer(answer.status_code, (await answer.aread()).decode()), [])
            async for line in answer.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if all(c.finished for c in choices):
                        return "completed", "", choices
                    return "failed_unclear", "[DONE] before every finish_reason", choices
                message = json.loads(data)
                if "error" in message:
                    error = message["error"].get("message", message["error"])
                    return "failed_clear", f"SSE error: {error}", choices
                for item in message.get("choices") or []:
                    choice = choices[item["index"]]
                    choice.text += item.get("text") or ""
                    choice.tokens += (item.get("logprobs") or {}).get("tokens") or []
                    chunks += bool(item.get("text"))
                    choice.finished = choice.finished or bool(item.get("finish_reason"))
                if hang_up_after and chunks >= hang_up_after:
                    return "disconnected", f"hung up after {chunks} chunk(s)", choices
        return "failed_unclear", "the stream ended without [DONE] or an error event", choices

    async def close(self) -> None:
        await self.http.aclose()


def _error_answer(status: int, body: str) -> tuple[str, str]:
    """An HTTP error: clear when its body is an OpenAI error object."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "failed_unclear", f"HTTP {status} without an OpenAI error body: {body[:200]!r}"
    return "failed_clear", f"HTTP {status}: {message}"


def error_key(detail: str) -> str:
    """A failure's detail with ids and numbers blanked, to group alike failures."""
    detail = re.sub(r"\b(prefill|decode|colocated)-[\w-]+", r"\1-*", detail)
    detail = re.sub(r"\b(cmpl|chatcmpl)-[\w-]+", r"\1-*", detail)
    return re.sub(r"\d+(\.\d+)?", "#", detail)[:120]
