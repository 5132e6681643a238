"""Frozen configuration objects for the engine, one per component.

Each setting is declared once, here, on its field (``common.settings``): the CLI flags and
``PDSERVE_*`` variables are generated from these fields at the entry point, and the objects are
passed down; nothing below reads the environment. Torch-free, so every entry point (the router
included) can build them without loading the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common.settings import parse_size, setting

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "pdserve"


def default_num_threads() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's core count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from the model directory's config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 has biases on q/k/v only; Llama has none.
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: how many blocks of how many tokens."""

    block_size: int = setting(16, "tokens per KV block")
    num_blocks: int | None = setting(None, "KV blocks in the pool (none: from --kv-cache-memory)")
    kv_cache_memory_bytes: int = setting(
        1 << 30,
        "memory for the KV pool when --num-blocks is not given (bytes, or 512M, 2G ...)",
        flag="--kv-cache-memory",
        parse=parse_size,
        metavar="SIZE",
    )
    enable_prefix_caching: bool = setting(
        True,
        "keep computed prompt blocks for later prompts that share them (the prefix cache)",
        flag="--no-prefix-caching",
    )
    num_swap_blocks: int = setting(0, "host-memory blocks for swap preemption (0: no swapping)")
    # Keep the KV pool in this file (under /dev/shm) so same-host peers can map it (shm transport).
    shared_memory_path: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = setting(64, "sequences in the running batch, at most")
    max_num_batched_tokens: int = setting(2048, "tokens computed per step, at most")
    max_prompt_tokens_beside_decodes: int | None = setting(
        None,
        "prompt tokens a step computes, at most, while sequences decode (the rest of a prompt in "
        "later chunks): each such step delays every decoding stream's next token by its prompt "
        "part (none: the whole --max-num-batched-tokens; `pdserve decode` makes it 256)",
    )
    enable_chunked_prefill: bool = setting(
        True,
        "compute a long prompt in chunks over several steps (off: each prompt in one step)",
        flag="--no-chunked-prefill",
    )
    preemption_mode: str = setting(
        "recompute",
        "what a preempted sequence loses: its KV (recompute) or its place (swap to host memory)",
        choices=("recompute", "swap"),
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        cap = self.max_prompt_tokens_beside_decodes
        if cap is not None and cap < 1:
            raise ValueError(f"max_prompt_tokens_beside_decodes must be >= 1, got {cap}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; one object built at the entry point."""

    model: str | None = setting(
        None, "Hugging Face directory or GGUF file (none: SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = setting(
        None, "a directory holding the tokenizer.json to use (none: the model's own)"
    )
    dtype: str = setting("float32", "weights, activations and KV cache", choices=DTYPES)
    device: str = setting("cpu", "torch device of the model and KV cache: cpu, cuda, cuda:1 ...")
    num_threads: int = setting(
        default_factory=default_num_threads,
        help="torch threads of this process (default: the cores it may run on)",
        flag="--threads",
    )
    max_model_len: int | None = setting(None, "context length (none: the model's own)")
    seed: int = setting(0, "seed of the sampler for requests without a seed of their own")
    cache_dir: str | None = setting(
        None, "converted models and compiled CPU kernels (none: ~/.cache/pdserve)"
    )
    cpu_kernels: bool = setting(
        True,
        "compile the CPU kernels (decode attention, the layer glue, the small-batch bfloat16 "
        "linear) at first start, into <cache-dir>/kernels (off: the PyTorch reference)",
    )
    cpu_matmul: str = setting(
        "auto",
        "path of the CPU GEMMs: auto (the fastest per layer shape and row count, timed at first "
        "start and kept in <cache-dir>/kernels), native (oneDNN in the weights' dtype), float32 "
        "(oneDNN on weights widened once: twice their memory) or mkl (torch's F.linear in float32)",
        choices=("auto", "native", "float32", "mkl"),
    )
    quantization: str = setting(
        "none",
        "weights of the decoder layers' linears: none (in --dtype) or int8 (CPU: per-channel int8 "
        "weights and per-token int8 activations, int8 GEMMs; the LM head stays in --dtype)",
        choices=QUANTIZATIONS,
    )
    cpu_kernels_cc: str | None = setting(
        None, "C compiler that builds the CPU kernel (none: cc, gcc or clang, the first on PATH)"
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(
                f"--quantization {self.quantization} runs on the CPU only, not on {self.device!r}"
            )

    def tokenizer_dir(self, model_dir: Path) -> Path:
        """Where the tokenizer is: --tokenizer, else the model's directory."""
        return Path(self.tokenizer).expanduser() if self.tokenizer else model_dir

    @property
    def cache_path(self) -> Path:
        """``cache_dir``, or ~/.cache/pdserve."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else DEFAULT_CACHE_DIR
