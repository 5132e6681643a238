"""Settings of the gateway/router, built once by the CLI (`pdserve router`) or by a test."""

from __future__ import annotations

from dataclasses import dataclass

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the ready line says which)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pdserve:"
    model: str | None = None  # the model the workers serve: tokenizer and chat template
    served_model_name: str | None = None  # default: the model's name
    cache_dir: str | None = None  # where a GGUF model's conversion is cached
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    cluster_token: str | None = None  # sent to the workers (x-pdserve-token)
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_loaded"
    colocated_policy: str = "prefix_aware"
    prefix_load_weight: float = 0.5  # prefix_aware: how much load counts against cached prefix
    max_concurrency: int = 512  # requests in flight; more get 429
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_attempts: int = 3  # tries per pool before the first token reaches the client
    prefill_timeout_seconds: float = 120.0
    request_timeout_seconds: float = 600.0
    refresh_seconds: float = 0.5  # registry view refresh period
    ttl_seconds: float = 5.0  # the workers' registry TTL (how long a view survives Redis loss)
    retry_after_seconds: int = 1
    trace_file: str | None = None  # append finished spans here as JSON lines
    otlp_endpoint: str | None = None  # export spans with OTLP/gRPC to this collector
    log_requests: bool = False  # log prompts and outputs (off: they may be private)
    # Latency SLOs the router judges each request against (None: off): its time to first token,
    # and its mean time between the tokens after the first (TPOT, as pdserve-loadtest's goodput).
    ttft_slo_seconds: float | None = None
    itl_slo_seconds: float | None = None

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode", "colocated"):
            name = getattr(self, f"{pool}_policy")
            if name not in POLICY_NAMES:
                raise ValueError(f"{pool}_policy must be one of {POLICY_NAMES}, got {name!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for slo in ("ttft_slo_seconds", "itl_slo_seconds"):
            value = getattr(self, slo)
            if value is not None and not value > 0:
                raise ValueError(f"{slo} must be > 0 when set, got {value}")
