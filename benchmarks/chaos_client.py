"""The chaos soak's requests (see ``benchmarks/chaos.py``).

The fixed prompt pool (``Prompt``, ``prompt_pool``), ``Client``, which sends a prompt to the
router and classifies how it ended (``Outcome``), and ``error_key``, to group alike failures.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
from chaos_system import ChaosConfig

OUTCOMES = ("correct", "wrong", "failed_clear", "failed_unclear", "hung", "disconnected")

SYSTEM = "You are a concise assistant. Answer in one short sentence, without any preamble."
COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I would like a cup of coffee.",
    "List three primary colors:",
    "The derivative of x^2 is",
    "Paged attention stores the KV cache in fixed-size blocks so that",
    "A prefill worker computes the prompt; a decode worker then pulls its KV cache and",
]
CHAT_QUESTIONS = [
    "What is the capital of Italy?",
    "Name a prime number greater than ten.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Why do leaves change colour in autumn?",
    "What is 12 times 7?",
    "Give me a synonym for 'quick'.",
]


# -- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One entry of the fixed pool: where it goes and what it asks."""

    key: str
    chat: bool
    content: dict[str, Any]  # {"prompt": ...} or {"messages": [...]}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def prompt_pool() -> list[Prompt]:
    """8 completions and 8 chats; the chats share a system prompt (a cached prefix)."""
    pool = [
        Prompt(f"completion-{i}", False, {"prompt": p}) for i, p in enumerate(COMPLETION_PROMPTS)
    ]
    for i, question in enumerate(CHAT_QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        pool.append(Prompt(f"chat-{i}", True, {"messages": messages}))
    return pool


@dataclass
class Outcome:
    """How one request ended; ``kind`` is one of OUTCOMES."""

    kind: str
    prompt: str
    stream: bool
    seconds: float
    detail: str = ""
    text: str = ""


class Client:
    """Sends pool prompts to the router and classifies what comes back."""

    def __init__(self, url: str, model: str, config: ChaosConfig):
        self.url = url
        self.model = model
        self.config = config
        self.references: dict[str, str] = {}  # prompt key -> greedy text
        limit = config.concurrency + config.burst + 4
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            timeout=httpx.Timeout(config.request_timeout + 5),  # ours below fires first
            trust_env=False,
        )

    async def send(
        self, prompt: Prompt, stream: bool, hang_up_after: int = 0, cancel_after: float = 0.0
    ) -> Outcome:
        """One request. ``hang_up_after``: close a stream after that many text chunks;
        ``cancel_after``: give up on a non-streaming answer after that many seconds."""
        start = time.monotonic()
        body = {**prompt.content, "model": self.model, "max_tokens": self.config.max_tokens}
        body |= {"temperature": 0, "stream": stream}
        exchange = self._stream(prompt, body, hang_up_after) if stream else self._post(prompt, body)
        limit = cancel_after or self.config.request_timeout
        try:
            kind, text, detail = await asyncio.wait_for(exchange, limit)
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            kind, text = ("disconnected", "") if cancel_after else ("hung", "")
            detail = f"no complete answer in {limit:g} s ({type(exc).__name__})"
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            kind, text, detail = "failed_unclear", "", f"{type(exc).__name__}: {exc}"
        outcome = Outcome(kind, prompt.key, stream, time.monotonic() - start, detail, text)
        return self._judge(outcome)

    def _judge(self, outcome: Outcome) -> Outcome:
        """completed -> correct | wrong; a clear failure's streamed text must be a prefix."""
        reference = self.references.get(outcome.prompt)
        if reference is None or outcome.kind not in ("completed", "failed_clear"):
            return outcome
        if outcome.kind == "completed":
            outcome.kind = "correct" if outcome.text == reference else "wrong"
        elif not reference.startswith(outcome.text):
            outcome.kind = "wrong"
        if outcome.kind == "wrong":
            outcome.detail = f"got {outcome.text!r}, expected {reference!r}; {outcome.detail}"
        return outcome

    async def _post(self, prompt: Prompt, body: dict[str, Any]) -> tuple[str, str, str]:
        answer = await self.http.post(self.url + prompt.path, json=body)
        if answer.status_code != 200:
            return _error_answer(answer.status_code, answer.text)
        choice = answer.json()["choices"][0]
        text = (choice["message"]["content"] if prompt.chat else choice["text"]) or ""
        return "completed", text, ""

    async def _stream(
        self, prompt: Prompt, body: dict[str, Any], hang_up_after: int
    ) -> tuple[str, str, str]:
        text, chunks, finished = "", 0, False
        async with self.http.stream("POST", self.url + prompt.path, json=body) as answer:
            if answer.status_code != 200:
                return _error_answer(answer.status_code, (await answer.aread()).decode())
            async for line in answer.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if finished:
                        return "completed", text, ""
                    return "failed_unclear", text, "[DONE] before any finish_reason"
                message = json.loads(data)
                if "error" in message:
                    error = message["error"].get("message", message["error"])
                    return "failed_clear", text, f"SSE error: {error}"
                for choice in message.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") if prompt.chat else choice.get("text")
                    text += piece or ""
                    chunks += bool(piece)
                    finished = finished or bool(choice.get("finish_reason"))
                if hang_up_after and chunks >= hang_up_after:
                    return "disconnected", text, f"hung up after {chunks} chunk(s)"
        return "failed_unclear", text, "the stream ended without [DONE] or an error event"

    async def close(self) -> None:
        await self.http.aclose()


def _error_answer(status: int, body: str) -> tuple[str, str, str]:
    """An HTTP error: clear when its body is an OpenAI error object."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "failed_unclear", "", f"HTTP {status} without an OpenAI error body: {body[:200]!r}"
    return "failed_clear", "", f"HTTP {status}: {message}"


def error_key(detail: str) -> str:
    """A failure's detail with ids and numbers blanked, to group alike failures."""
    detail = re.sub(r"\b(prefill|decode|colocated)-[\w-]+", r"\1-*", detail)
    detail = re.sub(r"\b(cmpl|chatcmpl)-[\w-]+", r"\1-*", detail)
    return re.sub(r"\d+(\.\d+)?", "#", detail)[:120]
