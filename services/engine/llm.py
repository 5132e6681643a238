"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm import tqdm

from services.engine.config import CacheConfig, EngineConfig, SchedulerConfig, default_num_threads
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams


class LLM:
    """Batch generation for scripts, tests, benchmarks and notebooks.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct). Keyword arguments set the engine:
    ``dtype``, ``block_size``, ``num_blocks``, ``kv_cache_memory_bytes``,
    ``enable_prefix_caching``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_chunked_prefill``, ``preemption_mode``, ``num_swap_blocks``, ``num_threads``,
    ``max_model_len``, ``seed``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        num_threads: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
    ):
        config = EngineConfig(
            model=model,
            dtype=dtype,
            num_threads=num_threads or default_num_threads(),
            max_model_len=max_model_len,
            seed=seed,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prefix_caching=enable_prefix_caching,
                num_swap_blocks=num_swap_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                preemption_mode=preemption_mode,
            ),
        )
        self._start(config, Path(cache_dir) if cache_dir else None)

    @classmethod
    def from_config(cls, config: EngineConfig, cache_dir: Path | None = None) -> LLM:
        """An LLM for an already built EngineConfig (what the CLI makes from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config, cache_dir)
        return llm

    def _start(self, config: EngineConfig, cache_dir: Path | None) -> None:
        self.engine = LLMEngine(config, cache_dir)
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
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: object) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError("prompts must be a string, a list of token ids, or a list of those")
