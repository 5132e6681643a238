"""What a request yields: the shape vLLM users know (``.outputs[i].text`` and friends).

The engine's ``step()`` returns *deltas*: each ``RequestOutput`` carries only what is new since
the previous one of its request (tokens, text, logprobs; a sequence's finish reason in the one
delta where it ends), so streaming costs nothing that grows with the output.
``RequestOutput.merge`` folds deltas into the whole answer, which is what the offline
``LLM.generate`` returns and what a slow consumer's stream collapses pending deltas into.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One of a request's ``n`` generated sequences (new part, or all of it once merged)."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "grammar_dead_end" (no token follows the structured output's
    # grammar: see docs/structured_outputs.md) or None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None  # one entry per token of token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> None:
        """Append ``later`` (the next delta of the same sequence) to this one."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason


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
    # params.prompt_logprobs set: per prompt token, None for the first, then that token's logprob
    # and the top alternatives; in the first output after the prompt is computed, then None.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside prompt_logprobs: each prompt token's rank in the whole vocabulary (1: the most
    # likely), None for the first.
    prompt_logprob_ranks: list[int | None] | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold ``later`` (the request's next delta) into this output."""
        by_index = {o.index: o for o in self.outputs}
        for out in later.outputs:
            if out.index in by_index:
                by_index[out.index].merge(out)
            else:
                self.outputs.append(out)
        self.outputs.sort(key=lambda o: o.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.kv_block_ids = later.kv_block_ids or self.kv_block_ids
        if not self.prompt_logprobs:
            self.prompt_logprobs = later.prompt_logprobs
            self.prompt_logprob_ranks = later.prompt_logprob_ranks
