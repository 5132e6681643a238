"""OpenAI response bodies and stream chunks, built from the orchestrator's `Chunk`s.

`ResponseBuilder` knows one API request's shape (completions or chat, n, logprobs) and turns
chunks into either stream events (``data: {...}``) or, accumulated, the final response.

Prompts (``expect_prompts``): with ``echo`` a completion's text and legacy logprobs start with
the prompt's (the first prompt token has no logprob: ``null``, as OpenAI and vLLM answer), and
``max_tokens: 0`` drops the one generated token; vLLM's ``prompt_logprobs`` come as its
``prompt_logprobs`` list (per completion choice, top level for chat). A prompt's logprobs
arrive once, on a chunk of the worker that computed it; the first to come is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from common.wire import StopReason
from router.tool_output import ToolOutput, ToolStream
from router.worker_calls import Chunk
from services.engine.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]
Entry = list[tuple[int, float]]  # one token's (token, logprob) pairs, the token first


@dataclass
class Prompt:
    """One prompt of the request, for echo and prompt logprobs."""

    token_ids: list[int]
    text: str  # what echo shows (the prompt as sent; token prompts decoded)
    logprobs: list[Entry] | None = None  # filled from the chunk that brings them
    ranks: list[int | None] | None = None  # beside them: each token's rank in the vocabulary


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event, as OpenAI frames it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: StopReason = None  # vLLM's: the stop string or stop token id that ended it
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    started: bool = False  # chat streams open each choice with the assistant role


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # pdserve's own: per prompt, how it got its KV and the phases on its way to the first
    # tokens, in ms (docs/metrics.md, "Per-response timings"); OpenAI's clients keep extra keys.
    timings: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.timings:
            usage["pdserve_timings"] = self.timings
        return usage


class ResponseBuilder:
    """Formats one API request's output; ``index`` is OpenAI's choice index."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        created: int,
        model: str,
        num_choices: int,
        tokenizer: Tokenizer,
        num_logprobs: int | None,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ):
        self.kind = kind
        self.id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs  # top alternatives per token; None: no logprobs
        self.with_logprobs = num_logprobs is not None
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk: the usage so far (vLLM's)
        self.tokens_as_ids = False  # logprobs name tokens "token_id:<id>" (vLLM's option)
        self.return_token_ids = False  # vLLM's: the prompt's and each choice's token ids
        self.choices = [Choice() for _ in range(num_choices)]
        self.usage = Usage()
        self._object = "text_completion" if kind == "completion" else "chat.completion"
        self.prompts: list[Prompt] = []
        self.echo = False
        self.drop_output = False  # echo with max_tokens 0: the prompt alone
        self.num_prompt_logprobs: int | None = None
        self.tool_output: ToolOutput | None = None  # chat with tools: text read as calls
        self._tool_streams: list[ToolStream] = []

    def expect_tool_calls(self, output: ToolOutput) -> None:
        """Read each choice's text as tool calls (router.tool_output)."""
        self.tool_output = output
        self._tool_streams = [output.stream() for _ in self.choices]

    def expect_prompts(
        self,
        prompts: list[Prompt],
        echo: bool = False,
        drop_output: bool = False,
        num_prompt_logprobs: int | None = None,
    ) -> None:
        """The request's prompts (one per ``len(choices) / len(prompts)`` choices), what to
        show of them (``echo``), whether to drop the generated token (``max_tokens`` 0) and
        whether their logprobs were asked for."""
        self.prompts = prompts
        self.echo = echo
        self.drop_output = drop_output
        self.num_prompt_logprobs = num_prompt_logprobs

    def _prompt_of(self, index: int) -> Prompt | None:
        if not self.prompts:
            return None
        return self.prompts[index // (len(self.choices) // len(self.prompts))]

    def _take(self, index: int, chunk: Chunk) -> Chunk:
        """Keep the prompt's logprobs a chunk brings; what of the chunk is shown."""
        prompt = self._prompt_of(index)
        if prompt is not None and prompt.logprobs is None and chunk.prompt_logprobs:
            prompt.logprobs, prompt.ranks = chunk.prompt_logprobs, chunk.prompt_ranks
        if self.drop_output:
            return Chunk(chunk.index, "", [], [], chunk.finish_reason, chunk.stop_reason)
        return chunk

    def add(self, index: int, chunk: Chunk) -> None:
        """Accumulate a chunk (non-streaming responses and usage)."""
        chunk = self._take(index, chunk)
        choice = self.choices[index]
        choice.text += chunk.text
        choice.num_tokens += len(chunk.token_ids)
        choice.token_ids += chunk.token_ids
        choice.logprobs += chunk.logprobs
        if chunk.finish_reason:
            choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
        self.usage.completion_tokens += len(chunk.token_ids)

    # -- streaming -----------------------------------------------------------------------------

    def stream_event(self, index: int, chunk: Chunk) -> bytes | None:
        """The SSE event for a chunk (None when it carries nothing a client would see)."""
        choice = self.choices[index]
        offset = len(choice.text)
        chunk = self._take(index, chunk)
        self.add(index, chunk)
        tokens = chunk.token_ids if self.return_token_ids else []
        if not (
            chunk.text or chunk.finish_reason or chunk.logprobs or tokens or not choice.started
        ):
            return None
        logprobs = None
        if self.with_logprobs and chunk.logprobs:
            logprobs = self._logprobs(chunk.logprobs, offset)
        if self.kind == "completion":
            prompt = self._prompt_of(index) if self.echo else None
            if prompt is not None:  # echo: the prompt comes first, then the offsets move on
                offset += len(prompt.text)
                if self.with_logprobs and chunk.logprobs:
                    logprobs = self._logprobs(chunk.logprobs, offset)
            text = chunk.text
            if prompt is not None and not choice.started:
                text = prompt.text + text
                if self.with_logprobs:
                    logprobs = self._echo_logprobs(prompt, chunk.logprobs)
            body = {"index": index, "text": text, "logprobs": logprobs}
            if self.return_token_ids:  # vLLM's: the prompt's with the choice's first event
                own = self._prompt_of(index)
                if own is not None and not choice.started:
                    body["prompt_token_ids"] = own.token_ids
                body["token_ids"] = tokens
            choice.started = True
            return sse(self._choice_event(body, chunk.finish_reason, chunk.stop_reason))
        # Chat streams as OpenAI's do: the role alone first, then content deltas, then an
        # empty delta carrying the finish reason.
        events = []
        if not choice.started:
            choice.started = True
            role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            events.append(self._choice_event(role, None))
            if self.return_token_ids and self.prompts:  # vLLM's: on each choice's first chunk
                events[-1]["prompt_token_ids"] = self.prompts[0].token_ids
        deltas: list[dict[str, Any]] = [{"content": chunk.text}] if chunk.text or logprobs else []
        finish_reason = chunk.finish_reason
        if self._tool_streams:  # tool calls: the text goes through the choice's ToolStream
            deltas = self._tool_streams[index].feed(chunk.text)
            if finish_reason:
                last, finish_reason = self._tool_streams[index].finish(finish_reason)
                deltas += last
        if (logprobs or tokens) and not deltas:
            deltas = [{}]
        for j, delta in enumerate(deltas):
            body = {"index": index, "delta": delta, "logprobs": logprobs if j == 0 else None}
            if self.return_token_ids:  # each of the chunk's tokens once, in its first event
                body["token_ids"] = tokens if j == 0 else []
            events.append(self._choice_event(body, None))
        if finish_reason:
            end = {"index": index, "delta": {}, "logprobs": None}
            if self.return_token_ids:
                end["token_ids"] = []
            events.append(self._choice_event(end, finish_reason, chunk.stop_reason))
        return b"".join(sse(e) for e in events) or None

    def _choice_event(
        self, body: dict[str, Any], finish_reason: str | None, stop_reason: StopReason = None
    ) -> dict[str, Any]:
        body["finish_reason"] = finish_reason
        if finish_reason is not None:  # vLLM's field, with the choice's finish
            body["stop_reason"] = stop_reason
        return self._envelope([body], streaming=True)

    def usage_event(self) -> bytes:
        """The last event when ``stream_options.include_usage``: no choices, the usage."""
        payload = self._envelope([], streaming=True)
        payload["usage"] = self.usage.to_dict()
        return sse(payload)

    def error_event(self, message: str, status: int, kind: str) -> bytes:
        return sse({"error": {"message": message, "type": kind, "param": None, "code": status}})

    # -- the whole response --------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            body: dict[str, Any] = {"index": index}
            prompt = self._prompt_of(index)
            echoed = prompt if self.echo and self.kind == "completion" else None
            if self.kind == "completion":
                body["text"] = (echoed.text if echoed else "") + choice.text
            else:
                body["message"] = {"role": "assistant", "content": choice.text}
            finish_reason = choice.finish_reason
            if self.tool_output is not None:
                body["message"], finish_reason = self.tool_output.message(
                    choice.text, finish_reason
                )
            body["logprobs"] = None
            if self.with_logprobs:
                body["logprobs"] = (
                    self._echo_logprobs(echoed, choice.logprobs)
                    if echoed
                    else self._logprobs(choice.logprobs)
                )
            body["finish_reason"] = finish_reason
            body["stop_reason"] = choice.stop_reason
            if self.return_token_ids:  # vLLM's; chat has the prompt's at the top level
                body["token_ids"] = choice.token_ids
                if self.kind == "completion" and prompt is not None:
                    body["prompt_token_ids"] = prompt.token_ids
            if self.kind == "completion" and prompt and self.num_prompt_logprobs is not None:
                body["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
            choices.append(body)
        payload = self._envelope(choices, streaming=False)
        if self.kind == "chat" and self.prompts and self.num_prompt_logprobs is not None:
            payload["prompt_logprobs"] = self._vllm_prompt_logprobs(self.prompts[0])
        if self.kind == "chat" and self.prompts and self.return_token_ids:
            payload["prompt_token_ids"] = self.prompts[0].token_ids
        payload["usage"] = self.usage.to_dict()
        return payload

    # -- internals -----------------------------------------------------------------------------

    def _envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        kind = self._object + (".chunk" if streaming and self.kind == "chat" else "")
        payload: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if streaming and self.include_usage:
            payload["usage"] = self.usage.to_dict() if self.continuous_usage else None
        return payload

    def _token(self, token_id: int, text: str | None = None) -> str:
        """How a logprob names a token: its text (``text``, when decoded already), or (vLLM's
        return_tokens_as_token_ids) ``token_id:<id>``, exact where texts are partial."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._text(token_id) if text is None else text

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _named_with_offsets(self, token_ids: list[int], start: int) -> tuple[list[str], list[int]]:
        """Each token's name and its position in the text (legacy ``text_offset``), from
        ``start``: each token decoded once."""
        names, offsets = [], []
        for token_id in token_ids:
            text = self._text(token_id)
            names.append(self._token(token_id, text))
            offsets.append(start)
            start += len(text)
        return names, offsets

    def _top(self, entry: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The ``num_logprobs`` most likely tokens (the workers send the sampled one first, then
        the top ones it is not among)."""
        return sorted(entry, key=lambda item: -item[1])[: self.num_logprobs or 0]

    def _legacy_top(self, entry: list[tuple[int, float]]) -> dict[str, float]:
        """Completions' ``top_logprobs``: the sampled (or prompt) token and the ``logprobs``
        most likely ones, up to logprobs + 1 entries, as OpenAI's legacy API and vLLM."""
        chosen = entry[0][0]
        top = [entry[0], *(item for item in self._top(entry) if item[0] != chosen)]
        return {self._token(t): _json_logprob(lp) for t, lp in top}

    def _logprobs(self, entries: list[list[tuple[int, float]]], offset: int = 0) -> dict[str, Any]:
        entries = [e for e in entries if e]
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, offsets = self._named_with_offsets([e[0][0] for e in entries], offset)
        return {
            "tokens": tokens,
            "token_logprobs": [e[0][1] for e in entries],
            "top_logprobs": [self._legacy_top(e) for e in entries],
            "text_offset": offsets,
        }

    def _prompt_entries(self, prompt: Prompt) -> list[Entry]:
        """Per prompt token: its (token, logprob) pairs; [] for the first (and for all when no
        worker sent any: a one-token prompt has none)."""
        entries = prompt.logprobs or []
        return [entries[i] if i < len(entries) else [] for i in range(len(prompt.token_ids))]

    def _echo_logprobs(self, prompt: Prompt, generated: list[Entry]) -> dict[str, Any]:
        """OpenAI's legacy logprobs over the prompt and then the generated tokens: a prompt
        token without a logprob (the first) has ``null`` for it and its top alternatives."""
        tokens, offsets = self._named_with_offsets(prompt.token_ids, 0)
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for entry in self._prompt_entries(prompt):
            token_logprobs.append(entry[0][1] if entry else None)
            top.append(self._legacy_top(entry) if entry else None)
        rest = self._logprobs(generated, len(prompt.text))
        return {
            "tokens": tokens + rest["tokens"],
            "token_logprobs": token_logprobs + rest["token_logprobs"],
            "top_logprobs": top + rest["top_logprobs"],
            "text_offset": offsets + rest["text_offset"],
        }

    def _vllm_prompt_logprobs(self, prompt: Prompt) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank (1: the most likely), decoded_token}} with the token and its ``prompt_logprobs``
        top alternatives. The token's rank, when it is not among them, is the worker's count
        over the whole vocabulary (None from a worker that sent none)."""
        result: list[dict[str, Any] | None] = []
        worker_ranks = prompt.ranks or []
        for i, entry in enumerate(self._prompt_entries(prompt)):
            if not entry:
                result.append(None)
                continue
            ranked = sorted(entry, key=lambda item: -item[1])[: self.num_prompt_logprobs]
            ranks: dict[int, int | None] = {t: r for r, (t, _) in enumerate(ranked, start=1)}
            if entry[0][0] not in ranks and i < len(worker_ranks):
                ranks[entry[0][0]] = worker_ranks[i]
            result.append(
                {
                    str(t): {
                        "logprob": lp,
                        "rank": ranks.get(t),
                        "decoded_token": self._text(t),  # text also with token ids, as vLLM
                    }
                    for t, lp in entry
                }
            )
        return result

    def _chat_entry(self, entry: list[tuple[int, float]]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            raw = list(self.tokenizer.token_bytes(token_id))  # a character's part: its bytes
            token = self._token(token_id)
            return {"token": token, "logprob": _json_logprob(logprob), "bytes": raw}

        first = item(*entry[0])
        first["top_logprobs"] = [item(t, lp) for t, lp in self._top(entry)]
        return first


def _json_logprob(logprob: float) -> float:
    """JSON has no -inf: a token a grammar forbids (among the top alternatives when it allows
    fewer) shows as -9999.0, as OpenAI's API and vLLM show it."""
    return max(logprob, -9999.0)
