"""The engine's two prefill attention paths, for the simulator's step cost.

The CPU engine computes prefill attention with ``kernels.reference.paged_attention_prefill``
(the compiled CPU kernels do decode only). A step whose only prefill is one fresh prompt takes
its fast path: causal SDPA, ``n (n + 1) / 2`` query-key pairs. Every other step with prefill
(two or more prompts in one step, or a chunk after earlier chunks of its prompt) takes the
padded path: the prompts are padded into one ``[S, max_q]`` batch that attends to
``[S, max_ctx]`` keys under an explicit mask, so it computes ``S x max_q x max_ctx`` pairs.

The step profiles time single fresh prompts, so their pair term (``prefill_pair_s``) is the
fast path's. :class:`PaddedPrefillCost` swaps it, in padded-path steps, for the padded pairs at
``ratio`` times the fast path's cost per pair. ``benchmarks/prefill_attention_paths.py`` measures
that ratio on the real engine (the attention's own time, one prompt alone vs two in one step):
0.6-0.83 on the Zen 4 VM (a padded pair is cheaper, but there are more of them: two prompts of
986 and 583 tokens in one step cost ~1.2 s more than apart on one core, and two of 768 tokens
1.65x their attention apart).
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.sim.timing import StepCost, WorkerTiming

# benchmarks/prefill_attention_paths.py on the Zen 4 VM, shared and busy: the median of four runs
# at 1 thread and N=768 (0.62, 0.72, 0.83, 0.83); 0.60 at N=256; 0.49 and 0.65 at 2 threads, whose
# two threads the other load disturbed most. A ratio of two times, so a uniform slowdown cancels.
PADDED_PAIR_RATIO = 0.77


def is_padded(prefill_chunks: list[tuple[int, int]]) -> bool:
    """Whether a step's prefill takes the padded path: several chunks, or one not from 0."""
    return len(prefill_chunks) > 1 or (len(prefill_chunks) == 1 and prefill_chunks[0][0] > 0)


class PaddedPrefillCost:
    """``inner``'s step cost with its causal pairs replaced by padded ones where the engine pads
    (see the module doc); ``pair_s``: ``inner``'s seconds per causal pair."""

    def __init__(self, inner: StepCost, pair_s: float, ratio: float = PADDED_PAIR_RATIO):
        if pair_s < 0 or ratio < 0:
            raise ValueError(f"pair_s and ratio must be >= 0, got {pair_s}, {ratio}")
        self.inner, self.pair_s, self.ratio = inner, pair_s, ratio

    def seconds(self, prefill_chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        total = self.inner.seconds(prefill_chunks, decode_contexts)
        if not is_padded(prefill_chunks):
            return total
        causal = sum(n * (start + (n + 1) / 2) for start, n in prefill_chunks)
        max_q = max(n for _, n in prefill_chunks)
        max_ctx = max(start + n for start, n in prefill_chunks)
        padded = len(prefill_chunks) * max_q * max_ctx
        return total + self.pair_s * (self.ratio * padded - causal)


def with_padded_prefill(timing: WorkerTiming, ratio: float = PADDED_PAIR_RATIO) -> WorkerTiming:
    """``timing`` with the padded path, where its step model has a pair term (a simulated
    worker's linear ``StepTimeModel``; a measured profile's curves have none: unchanged)."""
    pair_s = getattr(timing.step, "prefill_pair_s", None)
    if pair_s is None:
        return timing
    return replace(timing, step=PaddedPrefillCost(timing.step, pair_s, ratio))
