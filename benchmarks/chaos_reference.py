"""The chaos soak's prompts and their reference answers, from a path independent of the system
under test (see ``benchmarks/chaos.py``).

``prompt_pool`` draws prompts as token ids (seeded): windows of the project's own docs,
tokenized, with lengths covering every residue modulo the block size (16k + 1 and 16k
included) from 1 up to a few hundred, each asked with n = 1 or 2. ``references`` computes the
greedy answer of every prompt once, with the offline engine (``LLM``: the same model, float32,
one thread) in this process, before the system under test starts: an answer that the system
gets wrong every time can no longer pass as right.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("README.md", "docs/architecture.md", "docs/reliability.md")
BLOCK_SIZE = 16  # the workers' default --block-size: lengths cover each residue of it
SAMPLED_TEMPERATURE = 0.8


@dataclass(frozen=True)
class Prompt:
    """One entry of the pool: a completion prompt as token ids, asked with ``n`` choices."""

    key: str
    token_ids: tuple[int, ...]
    n: int
    seed: int | None = None  # None: greedy; else sampled at SAMPLED_TEMPERATURE with this seed

    @property
    def temperature(self) -> float:
        return 0.0 if self.seed is None else SAMPLED_TEMPERATURE


@dataclass(frozen=True)
class Reference:
    """The offline engine's answer of one choice: text and tokens (each as the router's
    ``logprobs`` names it, ``decode([id])`` with special tokens kept)."""

    text: str
    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]


def prompt_lengths(seed: int, per_residue: int, max_blocks: int) -> list[int]:
    """``per_residue`` lengths for each residue r mod 16: 16k + r with k drawn in
    [0, max_blocks), never 0; the first 16k + 1 and 16k are k = 0 and 1 (lengths 1 and 16)."""
    rng = random.Random(seed)
    lengths = [1, BLOCK_SIZE]
    for residue in range(BLOCK_SIZE):
        for _ in range(per_residue):
            length = BLOCK_SIZE * rng.randrange(max_blocks) + residue
            lengths.append(length or BLOCK_SIZE * max_blocks)
    return lengths


def prompt_pool(
    tokenizer: object, seed: int, per_residue: int = 2, max_blocks: int = 20, sampled: bool = True
) -> list[Prompt]:
    """Windows of the docs' tokens at seeded offsets; n alternates 1, 2. One prompt in four
    extends an earlier one (same start), so repeats also meet cached prefixes. ``sampled``:
    one prompt in three is sampled with a seed (route-independent: the offline engine draws
    the same tokens), the others are greedy."""
    corpus: list[int] = []
    for name in TEXTS:
        corpus += tokenizer.encode((ROOT / name).read_text(), add_special_tokens=False)  # type: ignore[attr-defined]
    rng = random.Random(seed + 1)
    pool: list[Prompt] = []
    for i, length in enumerate(prompt_lengths(seed, per_residue, max_blocks)):
        start = rng.randrange(len(corpus) - length)
        if i % 4 == 3 and pool:
            earlier = rng.choice(pool)
            start = corpus_start(corpus, earlier.token_ids, start)
            start = min(start, len(corpus) - length)
        ids = tuple(corpus[start : start + length])
        sampling_seed = seed * 1000 + i if sampled and i % 3 == 2 else None
        pool.append(Prompt(f"p{i}-len{length}", ids, 1 + i % 2, sampling_seed))
    return pool


def corpus_start(corpus: list[int], ids: tuple[int, ...], fallback: int) -> int:
    """Where ``ids`` starts in ``corpus`` (``fallback`` if it is not found)."""
    first = ids[0]
    for index, token in enumerate(corpus):
        if token == first and tuple(corpus[index : index + len(ids)]) == ids:
            return index
    return fallback


def offline_references(
    seed: int, max_tokens: int, per_residue: int = 2, max_blocks: int = 20, sampled: bool = True
) -> tuple[list[Prompt], dict[str, list[Reference]]]:
    """The pool and each prompt's answer, one Reference per choice, from the offline engine
    (one load, one batch): greedy choices are all the one greedy answer; a seeded prompt is
    asked with its n, as the router is."""
    from common.sampling_params import SamplingParams  # here: torch loads with them
    from services.engine.llm import LLM

    llm = LLM(dtype="float32", num_threads=1)
    tokenizer = llm.get_tokenizer()
    pool = prompt_pool(tokenizer, seed, per_residue, max_blocks, sampled)
    params = [
        SamplingParams(
            n=1 if p.seed is None else p.n,
            temperature=p.temperature,
            seed=p.seed,
            max_tokens=max_tokens,
        )
        for p in pool
    ]
    outputs = llm.generate([list(p.token_ids) for p in pool], params)
    answers = {}
    for prompt, output in zip(pool, outputs):
        choices = []
        for choice in sorted(output.outputs, key=lambda c: c.index):
            ids = choice.token_ids
            tokens = tuple(tokenizer.decode([t], skip_special_tokens=False) for t in ids)
            choices.append(Reference(choice.text, tokens, tuple(ids)))
        answers[prompt.key] = choices * prompt.n if prompt.seed is None else choices
    return pool, answers
