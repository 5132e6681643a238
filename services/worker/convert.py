"""Conversions between the gRPC messages and the engine's own types (no logic beyond mapping).

proto3 cannot tell an unset number from zero, so for ``n``, ``top_p``, ``repetition_penalty`` and
``max_tokens`` a zero means "the default".
"""

from __future__ import annotations

from collections.abc import Iterator

from protos import pdserve_pb2 as pb
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field, like SamplingParams itself."""
    return SamplingParams(
        n=p.n or 1,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        max_tokens=p.max_tokens or 16,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=p.skip_special_tokens,
    )


def params_to_proto(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        max_tokens=s.max_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def logprobs_to_proto(entry: dict[int, float] | None) -> pb.TokenLogprobs:
    if not entry:
        return pb.TokenLogprobs()
    return pb.TokenLogprobs(
        entries=[pb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items()]
    )


def logprobs_from_proto(msg: pb.TokenLogprobs) -> dict[int, float] | None:
    return {e.token_id: e.logprob for e in msg.entries} or None


def chunks_from_output(
    output: RequestOutput, kv_source: str, first: bool
) -> Iterator[pb.GenerateChunk]:
    """One chunk per sequence that has something new (tokens, text or its finish)."""
    for o in output.outputs:
        if not (o.token_ids_delta or o.text_delta or o.finish_reason or first):
            continue
        new_logprobs = (o.logprobs or [])[len(o.token_ids) - len(o.token_ids_delta) :]
        yield pb.GenerateChunk(
            index=o.index,
            token_ids=o.token_ids_delta,
            text=o.text_delta,
            logprobs=[logprobs_to_proto(e) for e in new_logprobs] if o.logprobs else [],
            finish_reason=o.finish_reason or "",
            stop_reason="" if o.stop_reason is None else str(o.stop_reason),
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens,
            kv_source=kv_source,
        )
