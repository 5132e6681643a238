"""Sending requests and timing them: one shared ``httpx.AsyncClient``, SSE parsing, the run loop.

Timing follows ``vllm bench serve``: a request's clock starts just before the HTTP request is
sent (after any ``--max-concurrency`` wait, which is the client's own queue), TTFT ends at the
first SSE message whose choice carries non-empty text, and every later text-carrying message
adds one inter-token latency (ITL) sample.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from loadtest.arrivals import Schedule, achieved_rate, arrivals
from loadtest.control import Stop, is_client_error
from loadtest.datasets import Sample, approx_tokens

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ClientConfig:
    """Where and how to send (the endpoint side of the command line)."""

    base_url: str
    model: str
    endpoint: str = COMPLETIONS
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = False
    temperature: float | None = 0.0
    max_concurrency: int | None = None
    request_timeout: float = 600.0
    num_warmups: int = 0
    disable_tqdm: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class RequestResult:
    """One request's outcome. Times are seconds; ``start`` and ``chunk_times`` are measured from
    the start of the run."""

    index: int
    ok: bool = False
    error: str = ""  # the error type, empty when ``ok``
    error_detail: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    start: float = 0.0
    itls: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    streamed: bool = True
    turn: int = 0
    usage_reported: bool = False

    @property
    def end(self) -> float:
        return self.start + self.e2el

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); undefined for one token or no stream."""
        if not (self.ok and self.streamed and self.output_len > 1):
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


@dataclass
class RunOutput:
    """What a run produced, before any statistics."""

    results: list[RequestResult]
    duration: float  # first send to last completion
    send_times: list[float]
    schedule: Schedule
    achieved_rate: float
    scheduled_rate: float = math.inf  # the rate of the drawn gaps themselves
    warnings: list[str] = field(default_factory=list)
    stopped: str = ""  # why the run ended early (Ctrl-C, a 4xx); empty when it ran to the end
    num_cancelled: int = 0  # requests in flight when it stopped (cancelled, not in results)


def server_message(detail: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body itself."""
    try:
        body = json.loads(detail)
    except ValueError:
        return detail.strip()
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return str(body["detail"])
    return detail.strip()


def make_client(cfg: ClientConfig) -> httpx.AsyncClient:
    """One client for the whole run: connection reuse, and no pool limit below the concurrency
    we mean to create (httpx's default of 100 connections would silently cap it)."""
    limit = cfg.max_concurrency if cfg.max_concurrency else None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        timeout=httpx.Timeout(cfg.request_timeout, connect=min(cfg.request_timeout, 30.0)),
        headers=headers,
        trust_env=False,  # a proxy from the environment would be measured too
    )


def request_body(cfg: ClientConfig, prompt: str | list[dict[str, str]], max_tokens: int) -> dict:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "stream": cfg.stream}
    if cfg.chat:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _text_of(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta") or choice.get("message") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


def _classify(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "connection_closed"
    if isinstance(exc, json.JSONDecodeError):
        return "bad_json"
    return type(exc).__name__


async def send(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    prompt_len: int,
    result: RequestResult,
    t0: float,
    count: Callable[[str], int] | None = None,
) -> RequestResult:
    """Send one request and fill ``result`` in (never raises except on cancellation)."""
    result.prompt_len = prompt_len
    result.streamed = cfg.stream
    start = time.perf_counter()
    result.start = start - t0
    last = start
    usage: dict[str, Any] | None = None
    pieces: list[str] = []
    try:
        async with client.stream(
            "POST", cfg.url, json=request_body(cfg, prompt, max_tokens)
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error, result.error_detail = f"http_{resp.status_code}", body[:500]
                result.e2el = time.perf_counter() - start
                return result
            if cfg.stream:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ": comment" keep-alives
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    message = json.loads(data)
                    if "error" in message:
                        result.error = "stream_error"
                        result.error_detail = json.dumps(message["error"])[:500]
                        break
                    if message.get("usage"):
                        usage = message["usage"]
                    choices = message.get("choices") or []
                    text = _text_of(choices[0], cfg.chat) if choices else ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    result.chunk_times.append(now - t0)
                    pieces.append(text)
                    last = now
            else:
                message = json.loads(await resp.aread())
                usage = message.get("usage")
                choices = message.get("choices") or []
                pieces.append(_text_of(choices[0], cfg.chat) if choices else "")
                result.ttft = time.perf_counter() - start  # not observable without a stream
                result.chunk_times.append(time.perf_counter() - t0)
    except Exception as exc:  # every failure is a result, counted by type (not cancellation)
        result.error, result.error_detail = _classify(exc), repr(exc)[:500]
    result.e2el = time.perf_counter() - start
    result.generated_text = "".join(pieces)
    if result.error:
        return result
    if usage and usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
        result.usage_reported = True
    elif count is not None:
        result.output_len = count(result.generated_text)
    else:
        # Without usage or a tokenizer, each text-carrying chunk is taken as one token.
        result.output_len = len(pieces)
    if not result.generated_text:
        result.error = "empty_response"
        return result
    result.ok = True
    return result


async def _conversation(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    sample: Sample,
    index: int,
    t0: float,
    count: Callable[[str], int] | None,
) -> list[RequestResult]:
    """One sample: a single request, or a multi-turn conversation where each turn carries the
    earlier questions and the server's answers."""
    turns = [(sample.prompt, sample.max_tokens), *sample.turns]
    messages: list[dict[str, str]] = []
    if sample.system:
        messages.append({"role": "system", "content": sample.system})
    transcript = ""  # the completions endpoint's prompt: the conversation as plain text
    results: list[RequestResult] = []
    for turn, (text, max_tokens) in enumerate(turns):
        messages.append({"role": "user", "content": text})
        transcript = sample.full_prompt() if turn == 0 else f"{transcript}\n{text}"
        prompt: str | list[dict[str, str]] = list(messages) if cfg.chat else transcript
        if turn == 0:
            prompt_len = sample.prompt_len
        elif count is not None:
            prompt_len = count(transcript)
        else:  # the history the server already counted, plus the new question (estimated)
            prompt_len = results[-1].prompt_len + results[-1].output_len + approx_tokens(text)
        result = RequestResult(index=index, turn=turn)
        await send(client, cfg, prompt, max_tokens, prompt_len, result, t0, count)
        results.append(result)
        if not result.ok:
            break  # a conversation cannot go on without the answer
        messages.append({"role": "assistant", "content": result.generated_text})
        transcript += result.generated_text
    return results


async def run(
    cfg: ClientConfig,
    samples: list[Sample],
    schedule: Schedule,
    num_prompts: int | None,
    duration: float | None = None,
    seed: int = 0,
    count: Callable[[str], int] | None = None,
    stop: Stop | None = None,
) -> RunOutput:
    """Send ``samples`` (cycled when there are fewer than requests) on ``schedule`` until
    ``num_prompts`` have been sent or ``duration`` seconds have passed, then wait for the
    requests in flight. Every request ends (``request_timeout``), so every run ends.

    ``stop`` (set by Ctrl-C, see ``loadtest.control``) ends the run early: nothing more is sent,
    the requests in flight are cancelled, and what completed is returned with ``stopped`` set.
    The first answer that is a client error (a 4xx other than 408/429: wrong model, key or
    body) stops the run the same way, with the server's message as the reason."""
    if num_prompts is None and duration is None:
        raise ValueError("a run needs --num-prompts and/or --duration")
    if not samples:
        raise ValueError("the dataset produced no samples")
    if num_prompts is None and math.isinf(schedule.rate) and not schedule.ramped:
        if not cfg.max_concurrency:
            raise ValueError("--duration with --request-rate inf needs --max-concurrency")
    stop = stop or Stop()
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[RequestResult] = []
    send_times: list[float] = []
    scheduled: list[float] = []
    tasks: list[asyncio.Task] = []
    async with make_client(cfg) as client:
        if cfg.num_warmups:
            await _warmup(client, cfg, samples, limit)
        progress = Progress(num_prompts, cfg.disable_tqdm)

        async def converse(index: int) -> None:
            progress.start()
            done = await _conversation(client, cfg, samples[index % len(samples)], index, t0, count)
            results.extend(done)
            progress.end(done)
            refused = next((r for r in done if _refused(r)), None)
            if refused is not None:
                stop.set(
                    f"the server answered {refused.error[5:]} to request {index}: "
                    f"{server_message(refused.error_detail)}"
                )

        async def task(index: int) -> None:
            if limit is None:
                await converse(index)
            else:
                async with limit:
                    await converse(index)

        async def send_all() -> None:
            async for index, offset in arrivals(schedule, num_prompts, rng, deadline):
                send_times.append(time.perf_counter() - t0)
                scheduled.append(offset)
                tasks.append(asyncio.create_task(task(index)))

        t0 = time.perf_counter()
        deadline = time.monotonic() + duration if duration else None
        if duration and schedule.ramped and schedule.ramp_duration is None:
            schedule = Schedule(**{**schedule.__dict__, "ramp_duration": duration})
        sender = asyncio.create_task(send_all())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({sender, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not stop.is_set:
                sender.result()
                waiters: set[asyncio.Future[Any]] = {stopper}
                waiters.add(asyncio.gather(*tasks, return_exceptions=True))
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            num_cancelled = progress.in_flight if stop.is_set else 0
            for pending in (sender, stopper, *tasks):
                pending.cancel()
            await asyncio.gather(sender, stopper, *tasks, return_exceptions=True)
            progress.close()
    results.sort(key=lambda r: (r.index, r.turn))
    end = max((r.end for r in results), default=0.0)
    output = RunOutput(results, end, send_times, schedule, achieved_rate(send_times))
    output.scheduled_rate = achieved_rate(scheduled)
    output.stopped, output.num_cancelled = stop.reason, num_cancelled
    if not stop.is_set:  # a stopped run's arrivals were cut short on purpose
        output.warnings = rate_check(output.scheduled_rate, output.achieved_rate, len(send_times))
    for warning in output.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    return output


def _refused(result: RequestResult) -> bool:
    status = result.error[5:] if result.error.startswith("http_") else ""
    return status.isdigit() and is_client_error(int(status))


def rate_check(scheduled: float, achieved: float, sent: int) -> list[str]:
    """The self-check: the client must not be the bottleneck. ``scheduled`` is the rate of the
    gaps actually drawn (a short Poisson run's own rate differs from the requested one by chance,
    which is not the client's fault); falling more than 10% short of it means the event loop
    could not send on time. Arrivals are timed before any --max-concurrency wait, so the check
    holds with a cap too."""
    if math.isinf(scheduled) or sent < 10:
        return []
    if achieved < 0.9 * scheduled:
        return [
            f"achieved arrival rate {achieved:.2f} req/s is more than 10% below the scheduled "
            f"{scheduled:.2f} req/s: the client is a bottleneck (give it a core of its own, or "
            "split the load over several processes)"
        ]
    return []


async def _warmup(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    samples: list[Sample],
    limit: asyncio.Semaphore | None,
) -> None:
    """``num_warmups`` short requests before timing starts (results discarded)."""

    async def one(i: int) -> None:
        sample = samples[i % len(samples)]
        r = RequestResult(index=-1)
        prompt: Any = [{"role": "user", "content": sample.prompt}] if cfg.chat else sample.prompt
        if limit is None:
            await send(client, cfg, prompt, min(sample.max_tokens, 16), sample.prompt_len, r, 0)
        else:
            async with limit:
                await send(client, cfg, prompt, min(sample.max_tokens, 16), sample.prompt_len, r, 0)

    await asyncio.gather(*(one(i) for i in range(cfg.num_warmups)))


class Progress:
    """A tqdm bar on stderr: requests finished, with those in flight and the errors so far."""

    def __init__(self, total: int | None, disable: bool) -> None:
        self.in_flight = 0
        self.errors = 0
        self.bar: Any = None
        if not disable:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)
            self._show()

    def start(self) -> None:
        self.in_flight += 1
        self._show()

    def end(self, done: list[RequestResult]) -> None:
        self.in_flight -= 1
        self.errors += sum(not r.ok for r in done)
        if self.bar is not None:
            self.bar.update(1)
        self._show()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                {"in flight": self.in_flight, "errors": self.errors}, refresh=False
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
