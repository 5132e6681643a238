"""Workloads: what each request asks for (a prompt and how many tokens to generate).

Token counts without a tokenizer
--------------------------------
Random prompts are built from a fixed list of short, common English words, each written with a
leading space. GPT-2/Llama/SmolLM-style BPE vocabularies hold each of these as a single token, so
``n`` words is ``n`` tokens to within a few percent. Counting arbitrary text (ShareGPT, custom
files) without a tokenizer uses ``approx_tokens``: words and punctuation marks each count one,
which for English prose lands within roughly 10-25% of a BPE count. Pass ``--tokenizer
path/to/tokenizer.json`` (needs the ``tokenizers`` package) to count exactly; the server's
``usage`` is used for the reported metrics whenever it is sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Single-token words in common BPE vocabularies (with a leading space).
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some time could these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()

PRESETS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    # name: ((input min, input max), (output min, output max)) in tokens
    "summarization": ((2000, 4000), (100, 300)),
    "chatbot": ((50, 200), (100, 500)),
    "codegen": ((200, 500), (500, 2000)),
}
MIXED = ("summarization", "chatbot", "codegen")
DATASETS = ("random", "prefix", "sharegpt", "custom", "multiturn", *PRESETS, "mixed")


@dataclass
class Sample:
    """One request (or, with several ``turns``, one conversation sent turn by turn)."""

    prompt: str
    prompt_len: int
    max_tokens: int
    system: str | None = None  # shared-prefix system prompt, kept apart for chat endpoints
    turns: list[tuple[str, int]] = field(default_factory=list)  # later (user text, max_tokens)
    kind: str = ""  # the preset or dataset it came from (for "mixed")

    def full_prompt(self) -> str:
        """The completions-endpoint prompt: the system prefix, then the user text."""
        return f"{self.system}\n{self.prompt}" if self.system else self.prompt


@dataclass
class DatasetConfig:
    """What ``--dataset-*`` and ``--random-*`` ask for."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 4
    num_turns: int = 3
    multi_turn: bool = False  # sharegpt: keep every human turn as a conversation
    output_len_override: int | None = None  # sharegpt/custom: ignore the file's output lengths
    tokenizer: str | None = None
    seed: int = 0


def approx_tokens(text: str) -> int:
    """Tokenizer-free token estimate (see the module docstring)."""
    return max(1, len(re.findall(r"\w+|[^\w\s]", text)))


def token_counter(tokenizer: str | None) -> Callable[[str], int]:
    """A counter from a ``tokenizer.json`` file, or a model directory holding one (``tokenizers``
    package), else the estimate."""
    if not tokenizer:
        return approx_tokens
    try:
        from tokenizers import Tokenizer  # optional dependency, only when asked for
    except ImportError:
        raise ValueError(
            "--tokenizer needs the tokenizers package: pip install tokenizers"
        ) from None
    try:
        path = Path(tokenizer)
        if path.is_dir():  # a model directory, as vLLM's --tokenizer takes
            path = path / "tokenizer.json"
        if path.exists():
            tok = Tokenizer.from_file(str(path))
        else:
            tok = Tokenizer.from_pretrained(tokenizer)
    except Exception as exc:  # the library raises its own exception types
        raise ValueError(
            f"--tokenizer {tokenizer}: not a tokenizer.json file, a directory with one, or a hub "
            f"name ({exc})"
        ) from None
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def random_text(n: int, rng: np.random.Generator) -> str:
    """``n`` random single-token words (about ``n`` tokens)."""
    if n <= 0:
        return ""
    picks = rng.integers(0, len(WORDS), size=n)
    return " ".join(WORDS[i] for i in picks)


def uniform_lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Integers uniform in ``[L(1-r), L(1+r)]`` (at least 1)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = _bounds(length, ratio)
    return rng.integers(lo, hi + 1, size=n)


def _bounds(length: int, ratio: float) -> tuple[int, int]:
    lo = max(1, int(round(length * (1 - ratio))))
    return lo, max(lo, int(round(length * (1 + ratio))))


def length_ranges(cfg: DatasetConfig) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """The (ISL, OSL) ranges the workload is drawn from, by name (plots outline them); empty
    where the lengths come from a file or grow turn by turn."""
    if cfg.name in PRESETS:
        return {cfg.name: PRESETS[cfg.name]}
    if cfg.name == "mixed":
        return {name: PRESETS[name] for name in MIXED}
    if cfg.name in ("random", "prefix"):
        ilo, ihi = _bounds(cfg.input_len, cfg.range_ratio)
        return {
            cfg.name: (
                (ilo + cfg.prefix_len, ihi + cfg.prefix_len),
                _bounds(cfg.output_len, cfg.range_ratio),
            )
        }
    return {}


def describe(cfg: DatasetConfig) -> dict[str, Any]:
    """What a saved result records of the workload: the settings that shaped it and the length
    ranges drawn from, and nothing else (a preset's ranges, not the random dataset's defaults,
    which a preset never reads). Lengths are integers uniform over each range, both ends in."""
    out: dict[str, Any] = {"name": cfg.name}
    if cfg.name in ("random", "prefix", "multiturn"):
        out |= {"input_len": cfg.input_len, "output_len": cfg.output_len}
        out |= {"range_ratio": cfg.range_ratio}
    if cfg.name in ("random", "prefix"):
        out["prefix_len"] = cfg.prefix_len
    if cfg.name == "prefix":
        out["num_prefixes"] = cfg.num_prefixes
    if cfg.name == "multiturn":
        out["num_turns"] = cfg.num_turns  # each turn's lengths drawn as random's
    if cfg.name in ("sharegpt", "custom"):
        out |= {"path": cfg.path, "output_len_override": cfg.output_len_override}
        out["tokenizer"] = cfg.tokenizer  # None: prompt lengths are estimates
    if cfg.name == "sharegpt":
        out["multi_turn"] = cfg.multi_turn
    if cfg.name == "custom":
        out["output_len"] = cfg.output_len  # for records without max_tokens
    ranges = length_ranges(cfg)
    if cfg.name == "multiturn":
        lo, hi = _bounds(cfg.input_len, cfg.range_ratio), _bounds(cfg.output_len, cfg.range_ratio)
        ranges = {cfg.name: (lo, hi)}
    if ranges:
        out["lengths"] = {
            kind: {"input_tokens": list(ins), "output_tokens": list(outs)}
            for kind, (ins, outs) in ranges.items()
        }
        out["distribution"] = "uniform integers over each range, ends included"
    if cfg.name == "mixed":
        out["mix"] = f"each request one of {', '.join(MIXED)}, with equal chance"
    return out


def random_samples(
    n: int,
    input_lens: np.ndarray,
    output_lens: np.ndarray,
    rng: np.random.Generator,
    prefix: str = "",
    prefix_len: int = 0,
    kind: str = "random",
) -> list[Sample]:
    """Random prompts of the given lengths, each after a common ``prefix``."""
    out = []
    for i in range(n):
        body = random_text(int(input_lens[i]), rng)
        prompt = f"{prefix} {body}" if prefix else body
        out.append(Sample(prompt, prefix_len + int(input_lens[i]), int(output_lens[i]), kind=kind))
    return out


def preset_samples(name: str, n: int, rng: np.random.Generator) -> list[Sample]:
    """A preset's ISL/OSL, each uniform over its range."""
    (ilo, ihi), (olo, ohi) = PRESETS[name]
    ins = rng.integers(ilo, ihi + 1, size=n)
    outs = rng.integers(olo, ohi + 1, size=n)
    return random_samples(n, ins, outs, rng, kind=name)


def shared_prefix_samples(cfg: DatasetConfig, rng: np.random.Generator) -> list[Sample]:
    """``num_prefixes`` system prompts of ``prefix_len`` tokens, reused round-robin, each with a
    random user question (exercises prefix caching)."""
    systems = [random_text(cfg.prefix_len, rng) for _ in range(max(1, cfg.num_prefixes))]
    ins = uniform_lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    outs = uniform_lengths(cfg.output_len, cfg.range_ratio, cfg.num_prompts, rng)
    samples = []
    for i in range(cfg.num_prompts):
        system = systems[i % len(systems)]
        samples.append(
            Sample(
                random_text(int(ins[i]), rng),
                cfg.prefix_len + int(ins[i]),
                int(outs[i]),
                system=system,
                kind="prefix",
            )
        )
    return samples


def multiturn_samples(cfg: DatasetConfig, rng: np.random.Generator) -> list[Sample]:
    """Synthetic conversations of ``num_turns`` user messages; each later turn is sent with the
    earlier questions and the server's answers before it."""
    samples = []
    for _ in range(cfg.num_prompts):
        ins = uniform_lengths(cfg.input_len, cfg.range_ratio, cfg.num_turns, rng)
        outs = uniform_lengths(cfg.output_len, cfg.range_ratio, cfg.num_turns, rng)
        texts = [random_text(int(n), rng) for n in ins]
        later = [(texts[t], int(outs[t])) for t in range(1, cfg.num_turns)]
        samples.append(Sample(texts[0], int(ins[0]), int(outs[0]), turns=later, kind="multiturn"))
    return samples


def _read_records(path: str) -> list[dict]:
    """A JSON list or JSON-lines file (``ValueError`` naming ``--dataset-path`` otherwise)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--dataset-path {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it ({exc})") from None
    try:
        if text.lstrip().startswith("["):
            records = list(json.loads(text))
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not JSON or JSON lines ({exc})") from None
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"--dataset-path {path}: each record must be a JSON object")
    return records


def sharegpt_samples(
    cfg: DatasetConfig, count: Callable[[str], int], rng: np.random.Generator
) -> list[Sample]:
    """ShareGPT format: ``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``.
    The first human turn is the prompt and the gpt answer's length is ``max_tokens``; with
    ``multi_turn`` every human turn is sent in order."""
    if not cfg.path:
        raise ValueError("--dataset-path is required for sharegpt")
    records = _read_records(cfg.path)
    order = rng.permutation(len(records))
    samples: list[Sample] = []
    for idx in order:
        turns = records[idx].get("conversations") or records[idx].get("conversation") or []
        pairs = []
        for a, b in zip(turns[::2], turns[1::2]):
            if a.get("from") in ("human", "user") and b.get("from") in ("gpt", "assistant"):
                out = cfg.output_len_override or count(b.get("value", ""))
                pairs.append((str(a.get("value", "")), max(1, out)))
        if not pairs or not pairs[0][0]:
            continue
        first, out0 = pairs[0]
        later = pairs[1:] if cfg.multi_turn else []
        samples.append(Sample(first, count(first), out0, turns=later, kind="sharegpt"))
        if len(samples) == cfg.num_prompts:
            break
    return samples


def custom_samples(cfg: DatasetConfig, count: Callable[[str], int]) -> list[Sample]:
    """JSONL with ``{"prompt": ..., "max_tokens": ...}`` per line, in file order."""
    if not cfg.path:
        raise ValueError("--dataset-path is required for custom")
    samples = []
    for number, record in enumerate(_read_records(cfg.path)[: cfg.num_prompts], 1):
        if "prompt" not in record:
            raise ValueError(f'--dataset-path {cfg.path}: record {number} has no "prompt"')
        prompt = str(record["prompt"])
        out = cfg.output_len_override or int(record.get("max_tokens") or cfg.output_len)
        samples.append(Sample(prompt, count(prompt), out, kind="custom"))
    return samples


def load(cfg: DatasetConfig) -> list[Sample]:
    """The samples ``cfg`` describes, reproducible for a given ``seed``."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    if cfg.name == "random":
        ins = uniform_lengths(cfg.input_len, cfg.range_ratio, n, rng)
        outs = uniform_lengths(cfg.output_len, cfg.range_ratio, n, rng)
        prefix = random_text(cfg.prefix_len, rng)
        return random_samples(n, ins, outs, rng, prefix, cfg.prefix_len)
    if cfg.name == "prefix":
        return shared_prefix_samples(cfg, rng)
    if cfg.name == "multiturn":
        return multiturn_samples(cfg, rng)
    if cfg.name in PRESETS:
        return preset_samples(cfg.name, n, rng)
    if cfg.name == "mixed":
        kinds = rng.choice(len(MIXED), size=n)
        per_kind = {k: iter(preset_samples(k, n, rng)) for k in MIXED}
        return [next(per_kind[MIXED[k]]) for k in kinds]
    count = token_counter(cfg.tokenizer)
    if cfg.name == "sharegpt":
        return sharegpt_samples(cfg, count, rng)
    if cfg.name == "custom":
        return custom_samples(cfg, count)
    raise ValueError(f"unknown dataset {cfg.name!r}; choose from {', '.join(DATASETS)}")
