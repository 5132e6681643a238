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
else the batch holds, so the same row gives the same bits on every path.

Top-k, top-p and min-p each keep the tokens whose logit reaches some value, so together they
give one floor per row (``filter_floors`` in ``kernels/reference.py``, compiled in
``sampling_cpu.c`` without a sort), and the race runs among the logits at or above it. Equal
logits at the edge are kept or dropped together (as vLLM's top-k keeps them); bfloat16 logits
tie often. A request's ``logit_bias`` is added to its raw logits before the penalties (logprobs stay
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
A batch of plain rows (a temperature and filters, nothing else) is filtered and raced on the host
in the model's dtype (a bfloat16 widens to float32 exactly). Any other batch is brought to the
host in float32 first, so penalties and masks run on CPU tensors. Either way a seeded request
gives the same tokens wherever its logits were computed.
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
# The race: (logits [rows, vocab], scale, keys, floors or None; [rows] each) -> tokens
# (``reference.race_rows``).
Race = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# The filters: (logits, scale, top_k, top_p, min_p) -> floors (``reference.filter_floors``).
Floors = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
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
        floors: Floors = reference.filter_floors,
    ):
        # Each row's first maximum, the race and the filters' floors (the compiled CPU
        # kernels', where built).
        self.argmax, self.race, self.floors = argmax, race, floors
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
        if all(_plain(s) for s in seqs):  # the race and filters read the model's dtype as it is
            host = logits.cpu() if logits.dtype in RACE_DTYPES else logits.float().cpu()
            return SampleResult(self._draw(host, seqs), [None] * len(seqs))
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
        token_list = self._draw(logits, seqs)
        logprobs = _gather_logprobs(raw_logprobs, token_list, params)
        return SampleResult(token_list, logprobs, dead_ends)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Each row's token: greedy rows the argmax, the others the race among the logits their
        filters keep."""
        scale, keys = self._race_inputs(seqs)
        params = [s.params for s in seqs]
        filtering = [not p.is_greedy and _has_filter(p) for p in params]
        floors = None
        if any(filtering):
            floors = self.floors(
                logits,
                scale,
                torch.tensor([p.top_k if f else 0 for p, f in zip(params, filtering)]),
                torch.tensor([p.top_p if f else 1.0 for p, f in zip(params, filtering)]),
                torch.tensor([p.min_p if f else 0.0 for p, f in zip(params, filtering)]),
            )
        return self.race(logits, scale, keys, floors).tolist()


def _has_filter(p) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _plain_greedy(seq: Sequence) -> bool:
    """Only an argmax: greedy, and ``_plain``."""
    return seq.params.is_greedy and _plain(seq)


def _plain(seq: Sequence) -> bool:
    """Only a draw: no logprobs, bias, min_tokens, penalties or grammar."""
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
