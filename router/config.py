"""Settings of the gateway/router, declared once (``common.settings``): `pdserve router` builds
its flags and ``PDSERVE_*`` variables from these fields; tests build the object directly. The
settings it shares with the workers (registry, cluster token, tracing: ``common.shared_settings``)
and with the engine (the model) are declared there and taken with ``same_setting``."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import parse_size, same_setting, setting
from common.shared_settings import ClusterSettings, RegistrySettings, TracingSettings
from router.disaggregation import DISAGGREGATION_POLICIES
from router.tool_parsers import PARSER_NAMES
from services.engine.config import EngineConfig

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware")
LOG_FORMATS = ("text", "json")
LIMITS = (
    "max_body_bytes",
    "max_body_depth",
    "max_prompts",
    "max_n",
    "max_fan_out",
    "max_stop_strings",
    "max_stop_chars",
    "max_messages",
    "max_request_prompt_tokens",
    "max_request_output_tokens",
)


@dataclass(frozen=True)
class RouterConfig:
    host: str = setting("127.0.0.1", "bind address")
    port: int = setting(8000, "HTTP port (0: any free port; the ready line says which)")
    redis_url: str = same_setting(RegistrySettings, "redis_url")
    redis_password: str | None = same_setting(RegistrySettings, "redis_password")
    redis_prefix: str = same_setting(RegistrySettings, "redis_prefix")
    model: str | None = same_setting(
        EngineConfig,
        "model",
        note="the workers' model: the router loads its tokenizer and chat template",
    )
    served_model_name: str | None = setting(None, "the model's id in the API (none: its name)")
    tokenizer: str | None = same_setting(
        EngineConfig, "tokenizer", note="the router tokenizes and templates prompts with it"
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template, as a file or the template itself, instead of the model's "
        "(none: the model's)",
        metavar="FILE|TEMPLATE",
    )
    generation_config: str = setting(
        "auto",
        "where the sampling values of requests that leave them out come from: auto (the "
        "model's generation_config.json, if it has one), vllm (none: OpenAI's) or a directory "
        "holding a generation_config.json",
        metavar="auto|vllm|DIR",
    )
    cache_dir: str | None = same_setting(EngineConfig, "cache_dir")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on /v1/* (better given by env than by flag)"
    )
    api_keys_file: str | None = setting(
        None,
        "a JSON file of API keys, each with a name, a weight (its share of the router) and a "
        "cache salt (see docs/reliability.md); with --api-key too, both are accepted",
        metavar="PATH",
    )
    cluster_token: str | None = same_setting(ClusterSettings, "cluster_token")
    ops_need_token: bool = setting(
        False,
        "/metrics and /v1/workers answer only 'Authorization: Bearer <cluster token>' "
        "(/health and /ready stay open for probes)",
    )
    insecure: bool = same_setting(ClusterSettings, "insecure")
    prefill_policy: str = setting(
        "prefix_aware", "routing policy of the prefill pool", choices=POLICY_NAMES
    )
    decode_policy: str = setting(
        "least_loaded", "routing policy of the decode pool", choices=POLICY_NAMES
    )
    colocated_policy: str = setting(
        "prefix_aware", "routing policy of the colocated pool", choices=POLICY_NAMES
    )
    prefix_load_weight: float = setting(
        0.5, "prefix_aware: how much a worker's load counts against its cached prefix"
    )
    disaggregation: str = setting(
        "conditional",
        "where a prompt is computed when both pools exist: conditional (on its decode worker "
        "when short, mostly cached there, or the prefill pool is busy) or always (on a "
        "prefill worker)",
        choices=DISAGGREGATION_POLICIES,
    )
    local_prefill_tokens: int = setting(
        256,
        "conditional: a prompt with at most this many tokens its decode worker does not cache "
        "is computed by that decode worker, unless it already has this many prompt tokens of "
        "its own to compute (a burst: then on a prefill worker)",
    )
    prefill_busy_tokens: int = setting(
        2048,
        "conditional: when the least busy prefill worker has more prompt tokens in flight than "
        "this, a prompt with no more uncached tokens than that goes to its decode worker if "
        "that worker's own queue, with it, is no longer than the prefill worker's",
    )
    decode_busy_sequences: int = setting(
        16,
        "conditional: a decode worker running this many sequences or more does not prefill "
        "for a busy prefill pool (its prefill would stall all of them)",
    )
    stream_kv: bool = setting(
        True,
        "pull a prompt's KV while it is computed, block by block (else after the prefill)",
        flag="--no-stream-kv",
    )
    max_concurrency: int = setting(
        512, "sub-requests in flight (prompts x n), at most; more get 429"
    )
    # Admission (router.admission): a fair share of slots per client, a bounded wait.
    max_queue_wait_seconds: float = setting(
        60.0,
        "seconds a request may wait to start: one predicted to wait longer for its first token "
        "gets 503 at once, and one waiting this long for a slot gets 503 (0: no waiting, 429 "
        "when every slot is taken)",
        flag="--max-queue-wait",
    )
    max_client_share: float = setting(
        0.5,
        "the share of --max-concurrency one client (an API key, else an address) may hold at "
        "once, times its key's weight: slots cannot be taken back, so without it a client "
        "alone could take every slot and keep newcomers waiting",
    )
    max_queued_requests: int = setting(
        256, "requests waiting for slots or for the tokenizer, all clients together"
    )
    tokenizer_threads: int = setting(
        2, "threads that tokenize and template prompts, off the event loop"
    )
    # Bounds on one request's work, checked before any of it is done (router.limits): a
    # request over one gets a 400 naming the limit and its flag.
    max_body_bytes: int = setting(
        4 << 20, "request bodies larger than this get 413", parse=parse_size, metavar="SIZE"
    )
    max_body_depth: int = setting(32, "nesting depth of a request's JSON body")
    max_prompts: int = setting(64, "prompts in one completions request")
    max_n: int = setting(16, "sequences per prompt (n)")
    max_fan_out: int = setting(
        64, "sub-requests of one request (prompts x n); each takes a concurrency slot"
    )
    max_stop_strings: int = setting(16, "stop strings of one request")
    max_stop_chars: int = setting(256, "characters of one stop string")
    max_messages: int = setting(1024, "messages of one chat request")
    max_request_prompt_tokens: int = setting(
        131072, "prompt tokens of one request, all its prompts together"
    )
    max_request_output_tokens: int = setting(
        262144, "tokens one request may generate: max_tokens x n, all its prompts together"
    )
    max_model_len: int | None = same_setting(EngineConfig, "max_model_len")
    max_attempts: int = setting(3, "tries per pool before the first token reaches the client")
    prefill_timeout_seconds: float = setting(120.0, "seconds a Prefill call may take")
    request_timeout_seconds: float = setting(600.0, "seconds a whole request may take")
    refresh_seconds: float = setting(0.5, "registry view refresh period")
    ttl_seconds: float = same_setting(
        RegistrySettings,
        "ttl_seconds",
        note="the router keeps its view this long through a Redis outage",
    )
    retry_after_seconds: int = setting(1, "Retry-After of 429 and 503 answers")
    trace_file: str | None = same_setting(TracingSettings, "trace_file")
    otlp_endpoint: str | None = same_setting(TracingSettings, "otlp_endpoint")
    log_requests: bool = setting(False, "log each prompt's text (prompts may be private)")
    tool_call_parser: str = setting(
        "auto",
        "how a tool call the model writes as text is read (tool_choice auto): hermes "
        "(<tool_call> JSON: Hermes, Qwen 2.x), llama3_json (Llama 3.1/3.2 JSON) or auto (the "
        "one the chat template writes, else hermes)",
        choices=PARSER_NAMES,
    )
    log_format: str = setting(
        "text",
        "the access log's lines, one per request: text (for people) or json (for log pipelines)",
        choices=LOG_FORMATS,
    )
    # Latency SLOs the router judges each request against (None: off): its time to first token,
    # and its mean time between the tokens after the first (TPOT, as pdserve-loadtest's goodput).
    ttft_slo_seconds: float | None = setting(
        None,
        "time-to-first-token SLO: export the share of recent requests meeting it "
        "(pdserve_router_slo_attainment) and count those over it",
    )
    itl_slo_seconds: float | None = setting(
        None,
        "inter-token latency SLO, on each request's mean time between tokens after the first "
        "(TPOT); exported like --ttft-slo-seconds",
    )

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode", "colocated"):
            name = getattr(self, f"{pool}_policy")
            if name not in POLICY_NAMES:
                raise ValueError(f"{pool}_policy must be one of {POLICY_NAMES}, got {name!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue_wait_seconds < 0:
            raise ValueError(
                f"max_queue_wait_seconds must be >= 0, got {self.max_queue_wait_seconds}"
            )
        if not 0 < self.max_client_share <= 1:
            raise ValueError(f"max_client_share must be in (0, 1], got {self.max_client_share}")
        for name in ("max_queued_requests", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ops_need_token and not self.cluster_token:
            raise ValueError("ops_need_token needs a cluster token (PDSERVE_CLUSTER_TOKEN)")
        for name in LIMITS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for slo in ("ttft_slo_seconds", "itl_slo_seconds"):
            value = getattr(self, slo)
            if value is not None and not value > 0:
                raise ValueError(f"{slo} must be > 0 when set, got {value}")
