"""From logits to next tokens, one row per sequence, each with its own SamplingParams.

Order of operations: a grammar's mask -> raw log-probabilities (returned with ``logprobs``) ->
repetition, frequency and presence penalties -> greedy rows take the argmax -> temperature ->
top-k, top-p, min-p -> a draw. The logprobs are the model's, but for a row with a grammar they
are over the tokens it allows (the others -inf), as vLLM's: what a ``choice`` of "yes" or "no"
returns is then the two answers' odds, summing to one.

Draws use the exponential race: the argmax over the vocabulary of p / E with E ~ Exp(1) per
entry, that is of ``logits / temperature - log E``, which is a draw from p. Its noise is keyed,
not streamed: E comes from a hash of (the row's key, the token id) (``race_rows`` in
``kernels/reference.py`` and, compiled, ``kernels/csrc/sampling_cpu.c``), so a row's token depends
on its key and its logits only, never on the batch around it. A seeded row's key is
``draw_seed(seed, index, position)`` (the request's seed, the sequence's index, its number of
output tokens so far): a prompt computed locally, pulled or recomputed after a failed pull, and a
preempted sequence, all give the same tokens. Unseeded rows take keys from the sampler's
generator. The winner changes only where the top two scores nearly tie, so logits that differ
in the last bits (another batch's GEMM, a pulled prompt) give the same token. Inverting the
cumulative distribution at one uniform number would be as cheap but is not that robust: the
cumulative sum carries every earlier token's rounding, and ``make chaos`` found seeded answers
that differed from the offline engine's. Noise drawn per entry from a generator cost more than
the model's step at 96 rows; the compiled race reads the logits once
(``benchmarks/sampler_cost.py``). A row's score is its raw logit times 1 / temperature whatever
else the batch holds (a top-k, top-p or min-p row only has the tokens its filters drop set to
-inf), so the same row gives the same bits on every path. A
request's ``logit_bias`` is added to its raw logits before the penalties (logprobs stay
unbiased), and while a sequence has fewer than ``min_tokens`` output tokens its EOS and stop
token ids are masked out.

Structured outputs: a row with a grammar has the tokens its grammar forbids masked
(services/engine/grammar.py), greedy rows included. The masks are computed on a thread of
their own while the model runs (``prepare``, called before the forward pass); a row not prepared
(an n > 1 fork) is masked at sampling time. A row whose grammar allows no token at all (it
needs a byte no token of the vocabulary holds) is a dead end: its token is not to be used, and
the result names the row (``SampleResult.dead_ends``) for the engine to end the sequence.

A batch of plain greedy rows takes the argmax of the logits as the model computed them, on their
device and in the model's dtype (on CPU the compiled kernel, ``kernels.cpu_ops``, where built).
A batch of plain rows, greedy or with only a temperature, is raced on the host in the model's
dtype (a bfloat16 widens to float32 exactly). Any other batch is brought to the host in float32
first, so penalties, masks and filters run on CPU tensors. Either way a seeded request gives the
same tokens wherever its logits were computed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from common.sampling_params import draw_seed
from kernels import reference
from kernels.openmp import serial_thread
from services.engine.grammar import Grammars, SequenceMatcher, allocate_bitmask, apply_bitmask
from services.engine.sequence import Sequence

# A prepared mask row is for a sequence at a given length: (seq_id, num_output_tokens).
MaskKey = tuple[int, int]
# The race: (logits [rows, vocab], scale [rows], keys [rows]) -> tokens (``reference.race_rows``).
Race = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RACE_DTYPES = (torch.float32, torch.bfloat16)  # what the race reads without widening first


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # sampled token and top alternatives, per row
    dead_ends: frozenset[int] = frozenset()  # rows whose grammar allows no token: no draw


@dataclass
class _Masks:
    """The grammar masks of some sequences: a row per masked one, and the dead ends."""

    rows: dict[MaskKey, torch.Tensor]
    dead_ends: set[MaskKey]


class Sampler:
    """Samples one token per row of ``logits`` for the matching sequence."""

    eos_token_ids: frozenset[int] = frozenset()  # the engine sets the model's (min_tokens)

    def __init__(
        self,
        seed: int = 0,
        grammars: Grammars | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] = reference.argmax_rows,
        race: Race = reference.race_rows,
    ):
        # Each row's first maximum, and the race (the compiled CPU kernel's, where built).
        self.argmax, self.race = argmax, race
        self.generator = torch.Generator().manual_seed(seed)  # unseeded rows' keys
        self.grammars = grammars
        self._matchers: dict[int, SequenceMatcher] = {}
        self._mask_thread: ThreadPoolExecutor | None = None
        self._prepared: Future[_Masks] | None = None

    def forget(self, seq: Sequence) -> None:
        """``seq`` has ended: drop its grammar state (a seeded draw keeps none between steps)."""
        self._matchers.pop(seq.seq_id, None)

    def prepare(self, seqs: list[Sequence]) -> None:
        """Start computing the grammar masks of ``seqs`` (those the next call samples) on the
        mask thread, to overlap the model's forward pass."""
        structured = [s for s in seqs if s.params.structured is not None]
        if not structured or self.grammars is None:
            self._prepared = None
            return
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(  # serial: beside the step, see kernels.openmp
                1, thread_name_prefix="grammar-mask", initializer=serial_thread
            )
        self._prepared = self._mask_thread.submit(self._fill_masks, structured)

    def _fill_masks(self, seqs: list[Sequence]) -> _Masks:
        """Each sequence's mask row, synced to its output so far; none where nothing is masked."""
        assert self.grammars is not None
        bitmask = allocate_bitmask(len(seqs), self.grammars.vocab_size)
        masks = _Masks({}, set())
        for i, seq in enumerate(seqs):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None:
                spec = seq.params.structured
                assert spec is not None  # only structured sequences come here
                matcher = self.grammars.matcher(spec, seq.params.stop_token_ids)
                self._matchers[seq.seq_id] = matcher
            matcher.sync(seq.output_token_ids)
            key = (seq.seq_id, seq.num_output_tokens)
            if matcher.fill(bitmask, i):
                masks.rows[key] = bitmask[i]
            elif matcher.dead_end:
                masks.dead_ends.add(key)
        return masks

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> frozenset[int]:
        """Mask, in place, what each structured row's grammar forbids; return the dead ends."""
        prepared, self._prepared = self._prepared, None
        structured = [i for i, s in enumerate(seqs) if s.params.structured is not None]
        if not structured or self.grammars is None:
            return frozenset()
        masks = prepared.result() if prepared is not None else _Masks({}, set())
        keys = [(seqs[i].seq_id, seqs[i].num_output_tokens) for i in structured]
        known = masks.rows.keys() | masks.dead_ends
        missing = [seqs[i] for i, key in zip(structured, keys) if key not in known]
        if missing:
            more = self._fill_masks(missing)
            masks.rows.update(more.rows)
            masks.dead_ends |= more.dead_ends
        bitmask = allocate_bitmask(len(seqs), self.grammars.vocab_size)
        masked = []
        for i, key in zip(structured, keys):
            if key in masks.rows:
                bitmask[i] = masks.rows[key]
                masked.append(i)
        if masked:
            apply_bitmask(logits, bitmask, masked)
        return frozenset(i for i, key in zip(structured, keys) if key in masks.dead_ends)

    def _race_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's scale (1 / temperature; 0 for a greedy row: the argmax) and noise key
        (int64 holding the uint64: the seeded draw's ``draw_seed``, else from the generator)."""
        params = [s.params for s in seqs]
        scale = torch.tensor([0.0 if p.is_greedy else 1 / p.temperature for p in params])
        keys = torch.randint(-(2**63), 2**63 - 1, (len(seqs),), generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                key = draw_seed(seq.params.seed, seq.index, seq.num_output_tokens)
                keys[i] = key - 2**64 if key >= 2**63 else key
        return scale, keys

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """``logits`` in the model's dtype: a batch of plain greedy rows is reduced as it is (a
        bfloat16 widens to float32 exactly, so the argmax is the same); any other is widened."""
        if all(_plain_greedy(s) for s in seqs):
            return SampleResult(self.argmax(logits).tolist(), [None] * len(seqs))
        if all(_plain(s) for s in seqs):  # the race reads the model's dtype as it is
            host = logits.cpu() if logits.dtype in RACE_DTYPES else logits.float().cpu()
            return SampleResult(
                self.race(host, *self._race_inputs(seqs)).tolist(), [None] * len(seqs)
            )
        logits = logits.float().cpu()
        params = [s.params for s in seqs]
        dead_ends = self._apply_grammars(logits, seqs)  # before the logprobs, as vLLM's
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = apply_min_tokens(logits, seqs, self.eos_token_ids)
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(logits, seqs)
        filtered = [i for i, p in enumerate(params) if not p.is_greedy and _has_filter(p)]
        if filtered:
            logits = _drop_filtered(logits, filtered, params)
        token_list = self.race(logits, *self._race_inputs(seqs)).tolist()
        logprobs = _gather_logprobs(raw_logprobs, token_list, params)
        return SampleResult(token_list, logprobs, dead_ends)


def _has_filter(p) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _drop_filtered(logits: torch.Tensor, rows: list[int], params: list) -> torch.Tensor:
    """``logits`` with -inf where the top-k, top-p and min-p filters of ``rows`` drop a token
    (judged on logits / temperature, as the filters are defined); the kept logits unchanged."""
    temperature = torch.tensor([params[i].temperature for i in rows])[:, None]
    kept = apply_top_k_top_p_min_p(
        logits[rows] / temperature,
        top_k=[params[i].top_k for i in rows],
        top_p=[params[i].top_p for i in rows],
        min_p=[params[i].min_p for i in rows],
    )
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(kept == float("-inf"), float("-inf"))
    return logits


def _plain(seq: Sequence) -> bool:
    """Greedy or sampled with a temperature only: no filter and nothing ``_plain_greedy``
    excludes."""
    p = seq.params
    return (p.is_greedy or not _has_filter(p)) and _plain_greedy_but_temperature(seq)


def _plain_greedy(seq: Sequence) -> bool:
    """Only an argmax: no logprobs, bias, min_tokens, penalties or grammar."""
    return seq.params.is_greedy and _plain_greedy_but_temperature(seq)


def _plain_greedy_but_temperature(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.logprobs is None
        and not p.logit_bias
        and seq.num_output_tokens >= p.min_tokens
        and not p.needs_penalties
        and p.structured is None
    )


def apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (a new tensor)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[i, ids] += bias.to(logits.device)
    return logits


def apply_min_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """vLLM's min_tokens: a sequence short of them cannot draw EOS or a stop token id."""
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            logits[i, sorted(banned)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (prompt and output, Hugging Face's rule) and OpenAI's frequency and
    presence penalties (output only)."""
    num_rows, vocab = logits.shape
    out_counts = torch.zeros(num_rows, vocab)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.needs_penalties:
            continue
        output = torch.tensor(seq.output_token_ids, dtype=torch.long)
        if output.numel():
            out_counts[i].scatter_add_(0, output, torch.ones(output.numel()))
        if p.repetition_penalty != 1:
            seen[i, torch.tensor(seq.token_ids, dtype=torch.long)] = True
    rep = torch.tensor([s.params.repetition_penalty for s in seqs])[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([s.params.frequency_penalty for s in seqs])[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs])[:, None]
    return logits - freq * out_counts - presence * (out_counts > 0).float()


TOP_CANDIDATES = 1024  # the tokens each row's filters look at first (the fast path)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k, top-p and min-p filters drop.

    Each filter keeps a prefix of the row's tokens in descending order, so the filters first
    look at the row's ``TOP_CANDIDATES`` largest logits only (``topk``, not a sort of the
    vocabulary: top_p 0.9 over 96 rows of SmolLM2's logits took 0.5-0.6x the sort's time,
    ``benchmarks/sampler_cost.py``). That is exact wherever
    the kept prefix ends inside the candidates, which each row checks; a row where it does not
    (a flat distribution, a top_k above the candidates) takes the full sort."""
    if not (any(k > 0 for k in top_k) or any(p < 1 for p in top_p) or any(m > 0 for m in min_p)):
        return logits
    rows, vocab = logits.shape
    if vocab <= TOP_CANDIDATES:
        return _filter_sorted(logits, top_k, top_p, min_p)
    values, order = logits.topk(TOP_CANDIDATES, dim=-1)  # descending
    kept_by_k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])[:, None]
    position = torch.arange(TOP_CANDIDATES)[None, :]
    drop = position >= kept_by_k
    # Probabilities over what top-k keeps: its candidates' where k fits, else the whole row's.
    within = values.masked_fill(drop, float("-inf")).logsumexp(dim=-1, keepdim=True)
    if bool((kept_by_k > TOP_CANDIDATES).any()):  # a pass over every logit: only if needed
        whole = logits.logsumexp(dim=-1, keepdim=True)
        normalizer = torch.where(kept_by_k <= TOP_CANDIDATES, within, whole)
    else:
        normalizer = within
    probs = (values - normalizer).exp().masked_fill(drop, 0.0)
    drop |= (probs.cumsum(dim=-1) - probs) >= _top_p_thresholds(top_p)
    drop |= probs < torch.tensor(min_p)[:, None] * probs[:, :1]
    # Exact where the last candidate is dropped (the kept prefix ended before it) and top-k's
    # set is known (k within the candidates, or none).
    exact = drop[:, -1] & ((kept_by_k[:, 0] <= TOP_CANDIDATES) | (kept_by_k[:, 0] == vocab))
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, order, values.masked_fill(drop, float("-inf")))
    # A row with no filter (beside rows with some) keeps its whole row.
    unfiltered = [i for i in range(rows) if top_k[i] <= 0 and top_p[i] >= 1 and min_p[i] <= 0]
    if unfiltered:
        out[unfiltered] = logits[unfiltered]
        exact[unfiltered] = True
    if not bool(exact.all()):
        slow = (~exact).nonzero().flatten().tolist()
        out[slow] = _filter_sorted(
            logits[slow],
            [top_k[i] for i in slow],
            [top_p[i] for i in slow],
            [min_p[i] for i in slow],
        )
    return out


def _top_p_thresholds(top_p: list[float]) -> torch.Tensor:
    """Each row's top_p as a column, 1 (off) as infinity: a float32 cumulative sum can round up
    to 1 before the last token, and top_p=1 must still keep every token."""
    return torch.tensor([p if p < 1 else float("inf") for p in top_p])[:, None]


def _filter_sorted(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """``apply_top_k_top_p_min_p`` over each row's whole vocabulary, sorted."""
    use_k = any(k > 0 for k in top_k)
    use_p = any(p < 1 for p in top_p)
    use_min_p = any(m > 0 for m in min_p)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    vocab = logits.shape[-1]
    if use_k:
        k = torch.tensor([kk if kk > 0 else vocab for kk in top_k])
        drop |= torch.arange(vocab)[None, :] >= k[:, None]
    if use_p or use_min_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        if use_p:
            # Drop a token when the tokens before it already reach top_p (the first always stays).
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= _top_p_thresholds(top_p)
        if use_min_p:
            drop |= probs < torch.tensor(min_p)[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _gather_logprobs(
    raw: torch.Tensor | None, tokens: list[int], params: list
) -> list[dict[int, float] | None]:
    if raw is None:
        return [None] * len(tokens)
    result: list[dict[int, float] | None] = []
    for i, (token, p) in enumerate(zip(tokens, params)):
        if p.logprobs is None:
            result.append(None)
            continue
        entry = {token: float(raw[i, token])}
        if p.logprobs > 0:
            values, ids = raw[i].topk(p.logprobs)
            for v, t in zip(values.tolist(), ids.tolist()):
                entry.setdefault(t, v)
        result.append(entry)
    return result
