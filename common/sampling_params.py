"""Per-request sampling settings, validated on construction (the field is named in every error)."""

from __future__ import annotations

from dataclasses import dataclass, field


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded with ``seed`` (an int64): ``seed +
    index``, wrapped within int64, so a seed near 2**63 with n > 1 still fits everywhere a seed
    goes (the proto's int64, torch's generators)."""
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound)

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / the golden ratio, odd)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: each output bit depends on every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, index: int, position: int) -> int:
    """The seed (a uint64) of the draw of output token ``position`` (0: the first) of sequence
    ``index`` of a request seeded with ``seed``: ``mix(mix(sequence_seed) + (position + 1) *
    gamma)``, splitmix64's step. A pure function of the three (counter-based), so a draw does
    not depend on the worker that makes it or on the draws before it: the route (local, pulled,
    recomputed) and preemption leave seeded output unchanged. It goes through ``sequence_seed``,
    so a request re-sent with ``sequence_seed(seed, k)`` draws for its sequence ``i`` what the
    original's sequence ``i + k`` would (the router does that for n > 1). Torch's CPU generator
    keeps only the low 32 bits of a seed; those are well mixed too."""
    base = _mix64(sequence_seed(seed, index) & _MASK64)
    return _mix64((base + (position + 1) * _GAMMA) & _MASK64)


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output, compiled to a token mask by the workers (xgrammar).

    ``kind`` is one of ``STRUCTURED_KINDS``; ``spec`` is what it constrains to: a JSON schema
    (json_schema, as JSON text), a regex, a JSON list of strings (choice), an EBNF grammar, or ""
    (json_object: any JSON object). Equal specs share one compiled grammar per worker.
    """

    kind: str
    spec: str = ""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    The defaults are vLLM's: temperature 1.0 (set 0 for greedy), up to 16 new tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return beside the sampled token
    skip_special_tokens: bool = True
    # token id -> added to its logit before any other processing (OpenAI's logit_bias)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # The prompt tokens' log-probabilities (from the second token on) with this many top
    # alternatives each (vLLM's prompt_logprobs); None: not computed.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends a sequence before
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that matched stays in
    structured: StructuredOutput | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or not -100 <= bias <= 100:
                rule = "maps token ids (>= 0) to biases in [-100, 100]"
                raise ValueError(f"logit_bias {rule}, got {token}: {bias}")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured kind must be one of {STRUCTURED_KINDS}, got {self.structured.kind!r}"
            )
        # With a grammar, the grammar decides where the output ends: once it is complete only
        # EOS is allowed, so holding EOS back would leave no token to sample (and the rest of
        # the output unconstrained) instead of a longer valid answer.
        if self.structured is not None and self.min_tokens:
            raise bad("min_tokens", "must be 0 with a structured output (the grammar ends it)")
        if self.structured is not None and self.ignore_eos:
            raise bad("ignore_eos", "must be false with a structured output (the grammar ends it)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
