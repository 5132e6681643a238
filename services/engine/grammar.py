"""Structured outputs: a request's ``StructuredOutput`` compiled to an xgrammar grammar, one
matcher per sequence, and the token masks that keep each sampled token inside the grammar.

A matcher is rebuilt from what the sequence holds, never handed over: it is advanced over the
sequence's output tokens it has not seen yet before each mask. So the decode worker's matcher,
built from the same spec and advanced over the prefill worker's first token, is in the state
the prefill worker's would have been in, and a token that replaced the sampled one (a forced
first token on a recompute) is what the matcher sees.

xgrammar (with torch and transformers) is imported at the first structured request, not at
start-up: a worker that never sees one does not pay its few seconds of import.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from common.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 128  # compiled grammars kept per worker (least recently used dropped)
# xgrammar's messages start with its log line's time and C++ source: "[22:45:43] /x/y.cc:83: "
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec does not compile (a bad schema, regex or grammar): the request is refused."""


class Grammars:
    """Compiles specs once each (an LRU cache), makes matchers; thread-safe."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab: dict[str, int],
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = CACHE_SIZE,
    ):
        self._tokenizer_json = tokenizer_json
        self._vocab = vocab
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses (tests and metrics read it)

    def _compiler_or_new(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            encoded = [""] * self.vocab_size
            for token, idx in self._vocab.items():
                if idx < self.vocab_size:
                    encoded[idx] = token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(self._tokenizer_json.read_text())
            info = xgr.TokenizerInfo(
                encoded,
                vocab_type=meta["vocab_type"],
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids,
                add_prefix_space=meta["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``; raises GrammarError when it does not compile. The
        lock guards the cache only: a compile on one thread never blocks a cache hit on another
        (the step thread's), at worst two threads compile the same new spec once each."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            compiler = self._compiler_or_new()
        try:
            compiled = _compile(compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            reason = _XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"the {spec.kind} does not compile: {reason}") from exc
        with self._lock:
            self.compiles += 1
            self._cache[spec] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput, stop_token_ids: list[int]) -> SequenceMatcher:
        """A matcher for one sequence. Where the grammar may end it allows EOS and also the
        request's ``stop_token_ids``, as vLLM's: a user's stop token may close a complete
        structured output (elsewhere one is allowed only as a character the grammar takes)."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        if not stop_token_ids:
            return SequenceMatcher(xgr.GrammarMatcher(compiled))
        stops = sorted(set(self._stop_token_ids) | set(stop_token_ids))
        return SequenceMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops))


def _compile(compiler: Any, spec: StructuredOutput) -> Any:
    # Compact JSON (no free whitespace): a model cannot loop on blank space inside an object.
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise ValueError("choice must be a non-empty list of strings")
        # ensure_ascii=False: an escaped character beyond the BMP is a surrogate pair, which the
        # grammar reads as two code points (bytes no UTF-8 text has)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return compiler.compile_grammar("root ::= " + alternatives)
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.spec)
    raise ValueError(f"unknown kind {spec.kind!r}")


class SequenceMatcher:
    """One sequence's grammar state: how many of its output tokens the matcher has accepted."""

    def __init__(self, matcher: Any):
        self._matcher = matcher
        self.num_accepted = 0
        # The grammar cannot be followed any further: it allows no token of the vocabulary (the
        # next character needs a byte no token holds), or a token outside it came in.
        self.dead_end = False

    def sync(self, output_token_ids: list[int]) -> None:
        """Advance over the output tokens not seen yet (a forced first token, the last draw)."""
        if self.num_accepted > len(output_token_ids):  # never happens: outputs only grow
            self._matcher.reset()
            self.num_accepted = 0
        for token in output_token_ids[self.num_accepted :]:
            if not self.dead_end and not self._matcher.accept_token(token):
                log.warning("token %d is outside the grammar: the sequence cannot follow it", token)
                self.dead_end = True
            self.num_accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed tokens into ``bitmask[row]``; False when nothing is to be masked
        (the grammar has ended) or nothing can be (``dead_end``: no token is allowed)."""
        if self.dead_end or self._matcher.is_terminated():
            return False
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if not bool(bitmask[row].any()):
            self.dead_end = True
            return False
        return True


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, what ``bitmask[row]`` forbids in ``logits[row]``, for ``rows``."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
