"""What the HTTP handlers share: the model's tokenizer and limits, the registry view, the
orchestrator, metrics and the concurrency bound. Turns an API request into sub-requests (one
per prompt) and their merged chunk stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.sampling_params import SamplingParams
from router.admission import Admission
from router.chat_template import ChatTemplateOptions, load_chat_template
from router.clients import ClientKeys
from router.config import RouterConfig
from router.errors import APIError
from router.generation_defaults import GenerationDefaults, load_generation_defaults
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.worker_calls import Chunk, SubRequest
from services.engine.model.source import model_name, resolve_model_dir
from services.engine.tokenizer import Tokenizer
from services.registry import RegistryConfig, RegistryView, WorkerRecord, tokenizer_hash

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 2048
CHANNEL_PRUNE_SECONDS = 30.0
CHUNKS_PER_PROMPT = 4  # chunks of a multi-prompt request waiting for its reader, per prompt


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the router needs it: a name, a tokenizer and its context length."""

    name: str  # the id clients send as "model"
    model_id: str  # the id workers publish in their fingerprint
    tokenizer: Tokenizer
    tokenizer_hash: str
    max_model_len: int
    longest_token_bytes: int  # bounds a text's characters per token (router.admission)
    generation: GenerationDefaults = GenerationDefaults()  # what requests leave out

    @classmethod
    def load(cls, config: RouterConfig) -> ModelInfo:
        cache_dir = Path(config.cache_dir or Path.home() / ".cache" / "pdserve")
        model_dir = resolve_model_dir(config.model, cache_dir, convert_in_child=True)
        hf_config = json.loads((model_dir / "config.json").read_text())
        max_len = config.max_model_len or int(
            hf_config.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN)
        )
        model_id = model_name(config.model)
        tokenizer_dir = Path(config.tokenizer).expanduser() if config.tokenizer else model_dir
        tokenizer = Tokenizer(tokenizer_dir)
        if config.chat_template:
            tokenizer.chat_template = load_chat_template(config.chat_template)
        return cls(
            name=config.served_model_name or model_id,
            model_id=model_id,
            tokenizer=tokenizer,
            tokenizer_hash=tokenizer_hash(tokenizer_dir),
            max_model_len=max_len,
            longest_token_bytes=longest_token_bytes(tokenizer),
            generation=load_generation_defaults(config.generation_config, model_dir),
        )


class Gateway:
    """The router's state, built once per process (or per test)."""

    def __init__(
        self, config: RouterConfig, model: ModelInfo, metrics: RouterMetrics | None = None
    ):
        self.config = config
        self.model = model
        self.metrics = metrics or RouterMetrics()
        registry = RegistryConfig(
            redis_url=config.redis_url,
            password=config.redis_password,
            prefix=config.redis_prefix,
            ttl_seconds=config.ttl_seconds,
            cluster_token=config.cluster_token,  # lists only workers that prove they hold it
            heartbeat_seconds=min(1.0, config.ttl_seconds / 2),
        )
        self.view = RegistryView(registry)
        self.orchestrator = Orchestrator(config, self.view, self.metrics, self.rejection)
        orchestrator = self.orchestrator
        self.metrics.watch_workers(lambda role: len(orchestrator.routable(role)))  # type: ignore[arg-type]
        self.metrics.watch_pools(
            lambda pool: orchestrator.num_pool_requests[pool],  # type: ignore[index]
            orchestrator.kv_usage,  # type: ignore[arg-type]
        )
        self.metrics.watch_registry(lambda: self.view.num_rejected)
        self.metrics.track_slos(config.ttft_slo_seconds, config.itl_slo_seconds)
        self.keys = ClientKeys.load(config.api_key, config.api_keys_file)
        self.admission = Admission(config, model.longest_token_bytes, self.metrics)
        self._pruner: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.view.refresh()
        self.view.watch(self.config.refresh_seconds)
        self._pruner = asyncio.create_task(self._prune_channels(), name="prune-channels")

    async def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            await asyncio.gather(self._pruner, return_exceptions=True)
        await self.view.close()
        await self.orchestrator.close()
        self.admission.close()

    async def _prune_channels(self) -> None:
        """Close gRPC channels of workers that left (autoscaled pools churn addresses)."""
        while True:
            await asyncio.sleep(CHANNEL_PRUNE_SECONDS)
            if not self.view.is_stale:
                await self.orchestrator.forget_channels()

    def rejection(self, worker: WorkerRecord) -> str | None:
        """Why this router cannot use ``worker`` (None: it can)."""
        fp = worker.fingerprint
        if fp.model_id != self.model.model_id:
            return f"serves model {fp.model_id!r}, the router serves {self.model.model_id!r}"
        if fp.tokenizer_hash != self.model.tokenizer_hash:
            return "its tokenizer differs from the router's"
        return None

    # -- admission -----------------------------------------------------------------------------

    @property
    def admission_wait_seconds(self) -> float:
        """How long a request may wait for its tokenizer turn and its slots:
        ``--max-queue-wait``, or the request's timeout when that is 0."""
        return self.config.max_queue_wait_seconds or self.config.request_timeout_seconds

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model.name}`.",
                param="model",
                code="model_not_found",
            )

    # -- prompts -------------------------------------------------------------------------------

    def tokenize(
        self, prompt: str | list[int], chat: bool = False, add_special_tokens: bool | None = None
    ) -> list[int]:
        """Token ids of a text (with BOS where the tokenizer adds it: by default for a
        completion, not for a rendered chat) or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            special = not chat if add_special_tokens is None else add_special_tokens
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=special)
        else:
            ids = list(prompt)
            vocab = self.model.tokenizer.vocab_size
            if any(t >= vocab for t in ids):
                raise APIError(
                    400, f"prompt has token ids outside the vocabulary (size {vocab})", "prompt"
                )
        if not ids:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        return ids

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatTemplateOptions | None = None,
    ) -> list[int]:
        """The conversation (and the tools it may call) rendered by the model's chat template,
        tokenized."""
        options = options or ChatTemplateOptions()
        try:
            text = self.model.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=options.add_generation_prompt,
                tools=tools,
                continue_final_message=options.continue_final_message,
                template_kwargs=options.template_kwargs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # the template itself refused the conversation
            raise APIError(400, f"chat template error: {exc}", param="messages") from exc
        return self.tokenize(text, chat=True, add_special_tokens=options.add_special_tokens)

    def max_tokens_for(
        self, prompt_len: int, requested: int | None, param: str, prompt_param: str
    ) -> int:
        """``requested`` checked against the context length (None: all the room left)."""
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(
                413,
                f"the prompt has {prompt_len} tokens; this model's context length is {limit} "
                "tokens, and at least one token must be generated",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return self.model.generation.cap_max_tokens(limit - prompt_len)
        if prompt_len + requested > limit:
            raise APIError(
                400,
                f"this model's context length is {limit} tokens; the prompt has {prompt_len} and "
                f"{param} asks for {requested} more",
                param=param,
                code="context_length_exceeded",
            )
        return self.model.generation.cap_max_tokens(requested)

    def sub_requests(
        self,
        request_id: str,
        prompts: list[list[int]],
        make_params: Any,
        cache_salt: str | None = None,
    ) -> list[SubRequest]:
        """One SubRequest per prompt; ``make_params(prompt_len)`` gives its SamplingParams;
        ``cache_salt``: the prefix-cache tenant of each."""
        subs = []
        for i, ids in enumerate(prompts):
            params: SamplingParams = make_params(len(ids))
            subs.append(SubRequest(f"{request_id}-{i}", ids, params, cache_salt))
        return subs

    async def chunks(self, subs: list[SubRequest]) -> AsyncGenerator[tuple[int, Chunk], None]:
        """Every sub-request's chunks as (OpenAI choice index, chunk), interleaved as they come."""
        n = subs[0].params.n
        if len(subs) == 1:  # the common case: no tasks, no queue
            async with aclosing(self.orchestrator.generate(subs[0])) as stream:
                async for chunk in stream:
                    yield chunk.index, chunk
            return
        # Bounded: a client that reads slowly holds its streams back (the workers merge what it
        # has not read into one output) instead of piling chunks up here.
        queue: asyncio.Queue[tuple[int, Chunk] | BaseException | None] = asyncio.Queue(
            maxsize=CHUNKS_PER_PROMPT * len(subs)
        )

        async def pump(i: int, sub: SubRequest) -> None:
            try:
                async with aclosing(self.orchestrator.generate(sub)) as stream:
                    async for chunk in stream:
                        await queue.put((i * n + chunk.index, chunk))
                await queue.put(None)
            except asyncio.CancelledError:
                raise  # the consumer left: nobody reads the queue any more
            except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, sub)) for i, sub in enumerate(subs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            with suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token stands for: no text has more characters than its tokens
    times this (a normalizer that deletes characters would break the bound; byte-level BPE
    tokenizers, the common kind, have none)."""
    ids = range(tokenizer.vocab_size)
    return max(len(tokenizer.decode([i], skip_special_tokens=False).encode()) for i in ids)


def now_unix() -> int:
    return int(time.time())
