"""What a request yields: the shape vLLM users know (``.outputs[i].text`` and friends)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's ``n`` generated sequences."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None
    # Streaming: the text and tokens added since the previous output of this request.
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Prefill-only requests: the blocks holding the prompt's KV, pinned until released.
    kv_block_ids: list[int] | None = None
