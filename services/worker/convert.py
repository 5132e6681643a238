"""Engine outputs and KV layouts to and from their proto messages (workers only; the sampling
parameters' conversions, which the router needs too, are in ``common.wire``)."""

from __future__ import annotations

from collections.abc import Iterator

from common.wire import logprobs_to_proto, prompt_logprobs_to_proto, set_stop_reason
from kvtransfer.base import KVLayout
from protos import pdserve_pb2 as pb
from services.engine.outputs import RequestOutput


def chunks_from_output(
    output: RequestOutput, kv_source: str, first: bool
) -> Iterator[pb.GenerateChunk]:
    """One chunk per sequence that has something new (tokens, text or its finish); ``output``
    is a delta, so each chunk carries exactly its tokens and their logprobs; the prompt's
    logprobs, when the output has them, go with the first chunk."""
    prompt_logprobs = prompt_logprobs_to_proto(output.prompt_logprobs, output.prompt_logprob_ranks)
    for o in output.outputs:
        if not (o.token_ids or o.text or o.finish_reason or first or prompt_logprobs):
            continue
        chunk = pb.GenerateChunk(
            index=o.index,
            token_ids=o.token_ids,
            text=o.text,
            logprobs=[logprobs_to_proto(e) for e in o.logprobs or []],
            finish_reason=o.finish_reason or "",
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens,
            kv_source=kv_source,
            prompt_logprobs=prompt_logprobs,
        )
        set_stop_reason(chunk, o.stop_reason)
        prompt_logprobs = []
        yield chunk


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype)
