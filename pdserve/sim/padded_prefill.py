"""The engine's prefill attention paths, for the simulator's step cost.

The CPU engine computes float32 prefill attention with ``kernels.reference.paged_attention_prefill``
(bfloat16 too, where its compiled kernel measured slower). Fresh prompts of one length take the
fast path: causal SDPA, ``n (n + 1) / 2`` query-key pairs each. Any other prefill (prompts of
different lengths, or a chunk after earlier chunks of its prompt) is padded into ``[S, max_q]``
queries over ``[S, max_ctx]`` keys under an explicit mask: ``S x max_q x max_ctx`` pairs. Since
the engine groups sequences of similar lengths first (``kernels.reference.length_groups``), each
group pads only to its own longest; before, a step padded all its prompts together
(``grouped=False``: what the recorded goodput sweep ran).

The step profiles time single fresh prompts, so their pair term (``prefill_pair_s``) is the
fast path's. :class:`PaddedPrefillCost` swaps it, for padded groups, for the padded pairs at
``ratio`` times the fast path's cost per pair. ``benchmarks/prefill_attention_paths.py`` measures
that ratio on the real engine (the attention's own time, one prompt alone vs two in one step):
0.6-0.83 on the Zen 4 VM (a padded pair is cheaper, but there are more of them: two prompts of
986 and 583 tokens in one step cost ~1.2 s more than apart on one core, and two of 768 tokens
1.65x their attention apart).
"""

from __future__ import annotations

from dataclasses import replace

from kernels.reference import length_groups
from pdserve.sim.timing import StepCost, WorkerTiming

# benchmarks/prefill_attention_paths.py on the Zen 4 VM, shared and busy: the median of four runs
# at 1 thread and N=768 (0.62, 0.72, 0.83, 0.83); 0.60 at N=256; 0.49 and 0.65 at 2 threads, whose
# two threads the other load disturbed most. A ratio of two times, so a uniform slowdown cancels.
PADDED_PAIR_RATIO = 0.77


def is_padded(prefill_chunks: list[tuple[int, int]], grouped: bool = True) -> bool:
    """Whether prefill chunks ``(start, tokens)`` in one call take the padded path: anything but
    fresh prompts (start 0) of one length (``grouped``, the engine now), or anything but one fresh
    prompt alone (before)."""
    if not grouped:
        return len(prefill_chunks) > 1 or prefill_chunks[0][0] > 0
    lengths = {n for _, n in prefill_chunks}
    return any(start > 0 for start, _ in prefill_chunks) or len(lengths) > 1


def padded_groups(
    prefill_chunks: list[tuple[int, int]], grouped: bool = True
) -> list[list[tuple[int, int]]]:
    """The chunks as the engine pads them together: by ``length_groups``, or all in one call."""
    if not grouped or len(prefill_chunks) < 2:
        return [prefill_chunks] if prefill_chunks else []
    q_lens = [n for _, n in prefill_chunks]
    context_lens = [start + n for start, n in prefill_chunks]
    return [[prefill_chunks[s] for s in g] for g in length_groups(q_lens, context_lens)]


class PaddedPrefillCost:
    """``inner``'s step cost with its causal pairs replaced by padded ones where the engine pads
    (see the module doc); ``pair_s``: ``inner``'s seconds per causal pair; ``grouped``: the
    engine pads groups of similar lengths (now), or all of a step's prefill at once (before)."""

    def __init__(
        self, inner: StepCost, pair_s: float, ratio: float = PADDED_PAIR_RATIO, grouped: bool = True
    ):
        if pair_s < 0 or ratio < 0:
            raise ValueError(f"pair_s and ratio must be >= 0, got {pair_s}, {ratio}")
        self.inner, self.pair_s, self.ratio, self.grouped = inner, pair_s, ratio, grouped

    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        total = self.inner.seconds(prefill_chunks, decode_contexts)
        for group in padded_groups(prefill_chunks, self.grouped):
            if not is_padded(group, self.grouped):
                continue
            causal = sum(n * (start + (n + 1) / 2) for start, n in group)
            max_q = max(n for _, n in group)
            max_ctx = max(start + n for start, n in group)
            padded = len(group) * max_q * max_ctx
            total += self.pair_s * (self.ratio * padded - causal)
        return total


def with_padded_prefill(
    timing: WorkerTiming, ratio: float = PADDED_PAIR_RATIO, grouped: bool = True
) -> WorkerTiming:
    """``timing`` with the padded path, where its step model has a pair term (a simulated
    worker's linear ``StepTimeModel``; a measured profile's curves have none: unchanged)."""
    pair_s = getattr(timing.step, "prefill_pair_s", None)
    if pair_s is None:
        return timing
    return replace(timing, step=PaddedPrefillCost(timing.step, pair_s, ratio, grouped))
