"""Per-request disaggregation: whether a request's prompt is computed on a prefill worker (its
KV then pulled by the decode worker) or by the decode worker itself.

A prefill worker pays off for long prompts: their compute would stall a decode worker's batch.
For a short prompt, or one whose prefix the decode worker already caches, the queue at the
prefill pool, the KV transfer and the extra hop cost more than computing the few uncached
tokens where the tokens will be decoded anyway. A policy sees what the router knows when the
request arrives: the prompt's length, how much of it the chosen decode worker caches (the
registry's prefix index and the router's own memory of where it sent prompts), the prompt
tokens the least busy prefill worker still has in flight from this router, and how many
sequences the decode worker is already running (a local prefill stalls every one of them).

Policies are one class each (``always``, ``conditional``), chosen by ``--disaggregation``; every
decision is counted (``pdserve_router_disaggregation_decisions_total{decision, reason}``) and
set on the request's trace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

DISAGGREGATION_POLICIES = ("conditional", "always")


@dataclass(frozen=True)
class RequestFacts:
    """What a disaggregation policy may look at for one request."""

    prompt_tokens: int
    cached_tokens: int  # of them, already in the chosen decode worker's prefix cache
    prefill_queue_tokens: int  # prompt tokens in flight on the least busy prefill worker
    decode_sequences: int = 0  # running + waiting on the chosen decode worker
    local_queue_tokens: int = 0  # prompt tokens it computes itself, sent but not yet answered

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


@dataclass(frozen=True)
class Decision:
    remote: bool  # True: prefill on a prefill worker; False: on the decode worker
    reason: str  # a short word, the metrics label

    @property
    def label(self) -> str:
        return "remote" if self.remote else "local"


class DisaggregationPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def decide(self, facts: RequestFacts) -> Decision:
        """Where this request's prompt is computed."""


class AlwaysDisaggregate(DisaggregationPolicy):
    """Every prompt on a prefill worker (the classic disaggregated deployment)."""

    name = "always"

    def decide(self, facts: RequestFacts) -> Decision:
        return Decision(True, "always")


class ConditionalDisaggregation(DisaggregationPolicy):
    """Prefill on the decode worker when that is cheaper than going through the prefill pool:

    - ``local_tokens``: a prompt with at most this many uncached tokens is computed locally
      (reason ``short``, or ``cached`` when its decode worker caches the rest) - unless a short
      one finds the decode worker with ``local_tokens`` or more prompt tokens still to compute
      itself: a burst of short prompts, each of which would stall the worker's streams in turn
      while the prefill pool idles. It goes to the prefill pool (``local_queue``), unless that
      pool is busy (next rule);
    - ``busy_tokens``: when even the least busy prefill worker has more prompt tokens in flight
      than this, a prompt of at most ``busy_tokens`` uncached tokens is computed locally
      (``prefill_busy``) if the decode worker's own queue, this prompt included, is no longer
      than the prefill worker's: in a burst both workers compute prompts, each taking the next
      one when its queue is the shorter, so neither idles while the other has a queue. Unless
      the decode worker already runs ``decode_busy_sequences`` or more sequences: its prefill
      would stall all of them, so the prompt waits for the prefill pool (``decode_busy``);
    - anything else on a prefill worker (``long``, or ``local_queue`` for a short one).
    """

    name = "conditional"

    def __init__(self, local_tokens: int, busy_tokens: int, decode_busy_sequences: int = 2**31):
        self.local_tokens = local_tokens
        self.busy_tokens = busy_tokens
        self.decode_busy_sequences = decode_busy_sequences

    def decide(self, facts: RequestFacts) -> Decision:
        uncached = facts.uncached_tokens
        short = uncached <= self.local_tokens
        if short and facts.prompt_tokens > self.local_tokens:
            return Decision(False, "cached")
        if short and facts.local_queue_tokens < self.local_tokens:
            return Decision(False, "short")
        if self._sooner_here(facts, uncached):
            if facts.decode_sequences >= self.decode_busy_sequences:
                return Decision(True, "decode_busy")
            return Decision(False, "prefill_busy")
        return Decision(True, "local_queue" if short else "long")

    def _sooner_here(self, facts: RequestFacts, uncached: int) -> bool:
        """The prefill pool is busy and the decode worker's own queue, with this prompt, is no
        longer than the least busy prefill worker's."""
        waiting = facts.prefill_queue_tokens
        return (
            waiting > self.busy_tokens
            and uncached <= self.busy_tokens
            and facts.local_queue_tokens + uncached <= waiting
        )


def make_disaggregation_policy(
    name: str, local_tokens: int, busy_tokens: int, decode_busy_sequences: int = 2**31
) -> DisaggregationPolicy:
    if name == "always":
        return AlwaysDisaggregate()
    if name == "conditional":
        return ConditionalDisaggregation(local_tokens, busy_tokens, decode_busy_sequences)
    raise ValueError(f"unknown disaggregation policy {name!r}; one of {DISAGGREGATION_POLICIES}")
