"""What a flow hands back to the gateway: ``Chunk`` (new output of one sequence), ``SubRequest``
(one prompt of an API request, filled in with how it was served), and how a worker's Generate
and PrefillResponse messages become them.

No tensors here: token ids and text only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams
from common.wire import StopReason, stop_reason_of
from protos import pdserve_pb2 as pb
from services.registry import Role


@dataclass
class Chunk:
    """New output of one of a request's ``n`` sequences."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]]  # per token: (token, logprob), sampled token first
    finish_reason: str | None = None
    stop_reason: StopReason = None  # with finish_reason "stop": the stop string or token id
    # The prompt's logprobs, on the chunk of the worker that computed the prompt: per prompt
    # token (token, logprob) pairs, the token first; the first token's list is empty.
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int | None] | None = None  # beside them: each prompt token's rank


@dataclass
class SubRequest:
    """One prompt of an API request, as the workers see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefix-cache tenant: every worker call and route key has it
    num_cached_tokens: int = 0  # filled in: prompt tokens a worker's prefix cache already held
    worker_ids: list[str] = field(default_factory=list)  # filled in: who served it
    kv_source: str = ""  # filled in: pulled | recomputed | local | colocated
    timings: dict[str, float] = field(default_factory=dict)  # filled in: phase -> seconds
    deadline: float | None = None  # filled in at its first call: time.monotonic() to end by


def entries(message: pb.TokenLogprobs) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in message.entries]


def prompt_entries(messages: Sequence[pb.TokenLogprobs]) -> list[list[tuple[int, float]]] | None:
    """A worker's prompt logprobs (from the second token on), or None when it sent none."""
    return [[], *(entries(m) for m in messages)] if messages else None


def prompt_ranks(messages: Sequence[pb.TokenLogprobs]) -> list[int | None] | None:
    """Beside ``prompt_entries``: each prompt token's rank in the vocabulary (None: not sent)."""
    return [None, *(m.rank or None for m in messages)] if messages else None


def first_message(sub: SubRequest, pool: Role, message: pb.GenerateChunk) -> None:
    """What the first chunk of a Generate stream says about the request's way to it."""
    t = message.timings
    if pool == "colocated":
        sub.num_cached_tokens = message.num_cached_tokens
        sub.kv_source = "colocated"
    elif not sub.kv_source:  # n > 1 after a finished sequence 0 keeps "pulled"
        sub.kv_source = message.kv_source
    if sub.kv_source in ("local", "colocated"):
        sub.num_cached_tokens = message.num_cached_tokens
        sub.timings.update(decode_queue=t.queue_s, decode_first_step=t.compute_s)
        return
    sub.timings.update(
        kv_transfer=t.transfer_s,
        kv_transfer_exposed=t.transfer_exposed_s,
        decode_queue=t.queue_s,
        decode_first_step=t.compute_s,
    )


def chunk_of(message: pb.GenerateChunk, with_logprobs: bool) -> Chunk:
    return Chunk(
        index=message.index,
        text=message.text,
        token_ids=list(message.token_ids),
        logprobs=[entries(lp) for lp in message.logprobs] if with_logprobs else [],
        finish_reason=message.finish_reason or None,
        stop_reason=stop_reason_of(message),
        prompt_logprobs=prompt_entries(message.prompt_logprobs),
        prompt_ranks=prompt_ranks(message.prompt_logprobs),
    )


def first_chunk(sub: SubRequest, answer: pb.PrefillResponse) -> Chunk:
    """A prefill worker's first token, as the request's first chunk."""
    sub.num_cached_tokens = answer.num_cached_tokens
    sub.timings["prefill_queue"] = answer.timings.queue_s
    sub.timings["prefill_compute"] = answer.timings.compute_s
    return Chunk(
        index=0,
        text=answer.first_text,
        token_ids=[answer.first_token],
        logprobs=[entries(answer.logprobs)] if sub.params.logprobs is not None else [],
        finish_reason=answer.finish_reason or None,
        stop_reason=stop_reason_of(answer),
        prompt_logprobs=prompt_entries(answer.prompt_logprobs),
        prompt_ranks=prompt_ranks(answer.prompt_logprobs),
    )
