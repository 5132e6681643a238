"""Decides when a sequence is done and what of its text may be shown yet.

A stop string may arrive split across tokens, so text that could be the start of a stop string
is held back from streaming until it is clear either way; the matched stop string itself is never
shown.
"""

from __future__ import annotations

from services.engine.sequence import FinishReason, Sequence


def check_stop_token(
    seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[FinishReason, int | None] | None:
    """Finish reason from the last token alone (EOS, stop ids, max_tokens, context), or None."""
    token = seq.token_ids[-1]
    params = seq.params
    if not params.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP, None
    if token in params.stop_token_ids:
        return FinishReason.STOP, token
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """(index, stop) of the earliest stop string that ends in the last ``num_new_chars``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def num_held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop string."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held
