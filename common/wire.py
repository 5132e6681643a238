"""The control plane's shared vocabulary: sampling parameters, logprobs and stop reasons to and
from their proto messages, and the cluster-token header every internal call carries.

proto3 cannot tell an unset number from zero, so for ``n``, ``top_p``, ``repetition_penalty`` and
``max_tokens`` a zero means "the default".
"""

from __future__ import annotations

from common.sampling_params import SamplingParams, StructuredOutput
from protos import pdserve_pb2 as pb

TOKEN_HEADER = "x-pdserve-token"  # gRPC metadata key of the cluster token
Metadata = tuple[tuple[str, str], ...]


def check_cluster_token(token: str | None, insecure: bool) -> None:
    """Refuse to start without a cluster token unless running ``--insecure`` was asked for."""
    if not token and not insecure:
        raise ValueError(
            "no cluster token: set PDSERVE_CLUSTER_TOKEN or --cluster-token-file (the same on "
            "the router and every worker), or pass --insecure to run an open internal plane"
        )


def token_metadata(token: str | None) -> Metadata:
    """The call metadata that presents ``token`` (nothing when the plane runs --insecure)."""
    return ((TOKEN_HEADER, token),) if token else ()


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
        logit_bias=dict(p.logit_bias),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        min_tokens=p.min_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        structured=(
            StructuredOutput(p.structured.kind, p.structured.spec)
            if p.HasField("structured")
            else None
        ),
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
        logit_bias=s.logit_bias,
        min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
    )
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.structured is not None:
        msg.structured.kind = s.structured.kind
        msg.structured.spec = s.structured.spec
    return msg


def logprobs_to_proto(entry: dict[int, float] | None, rank: int | None = None) -> pb.TokenLogprobs:
    """One token's logprobs; ``rank``: a prompt token's rank in the vocabulary."""
    if not entry:
        return pb.TokenLogprobs()
    return pb.TokenLogprobs(
        entries=[pb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items()], rank=rank or 0
    )


def prompt_logprobs_to_proto(
    entries: list[dict[int, float] | None] | None, ranks: list[int | None] | None
) -> list[pb.TokenLogprobs]:
    """An engine output's prompt logprobs (None first) as the wire has them: from the second
    prompt token on, each with its rank."""
    ranks = ranks or [None] * len(entries or [])
    return [logprobs_to_proto(e, r) for e, r in zip((entries or [])[1:], ranks[1:])]


def logprobs_from_proto(msg: pb.TokenLogprobs) -> dict[int, float] | None:
    return {e.token_id: e.logprob for e in msg.entries} or None


StopReason = str | int | None  # vLLM's stop_reason: the stop string or stop token id matched


def set_stop_reason(message: pb.GenerateChunk | pb.PrefillResponse, reason: StopReason) -> None:
    """``reason`` into ``message``'s stop_string or stop_token_id (neither for None)."""
    if isinstance(reason, str):
        message.stop_string = reason
    elif reason is not None:
        message.stop_token_id = reason


def stop_reason_of(message: pb.GenerateChunk | pb.PrefillResponse) -> StopReason:
    if message.HasField("stop_token_id"):
        return message.stop_token_id
    return message.stop_string or None
