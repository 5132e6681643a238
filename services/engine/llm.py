"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from common.sampling_params import SamplingParams
from common.settings import from_fields
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput


class LLM:
    """Batch generation for scripts, tests, benchmarks and notebooks.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct). Keyword arguments are the
    fields of the engine's configs (``EngineConfig``, ``CacheConfig``, ``SchedulerConfig``) by
    name: ``dtype``, ``num_threads``, ``max_model_len``, ``seed``, ``cache_dir``,
    ``block_size``, ``num_blocks``, ``kv_cache_memory_bytes``, ``enable_prefix_caching``,
    ``num_swap_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_chunked_prefill``, ``preemption_mode``.
    """

    def __init__(self, model: str | None = None, **options: Any):
        if options.get("num_threads") is None:  # None: the cores this process may run on
            options.pop("num_threads", None)
        self._start(from_fields(EngineConfig, model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM for an already built EngineConfig (what the CLI makes from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._next_id = 0

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order.

        ``prompts`` is a string, a list of token ids, or a list of either; ``sampling_params`` is
        one SamplingParams for all, or one per prompt. Every prompt is validated before any runs.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:  # all or nothing: leave no half-added batch behind
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}  # the step's deltas, merged
        num_finished = 0
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while num_finished < len(ids):
                for delta in self.engine.step():
                    merged = results.setdefault(delta.request_id, delta)
                    if merged is not delta:
                        merged.merge(delta)
                    if delta.finished:
                        num_finished += 1
                        bar.update(1)
        return [results[i] for i in ids]


def _as_prompt_list(prompts: object) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError("prompts must be a string, a list of token ids, or a list of those")
