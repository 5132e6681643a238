"""Incremental detokenization that never emits half a UTF-8 character.

Decoding one token at a time breaks characters that span several byte-level tokens (emoji,
CJK) and drops the leading space of word pieces. So each step decodes a short window of recent
tokens twice, with and without the new ones, and emits the difference only once it no longer
ends in the replacement character U+FFFD. Only that window is kept: the cost per token does not
grow with the output.
"""

from __future__ import annotations

from services.engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context for the first output tokens


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window: tokens already turned into text (left context) then those not yet.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        before = decode(self._ids[: self._read_offset], skip)
        after = decode(self._ids, skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character, or a token that adds no text
        del self._ids[: self._read_offset]  # the new window starts at the last read position
        self._read_offset = len(self._ids)
        return after[len(before) :]
