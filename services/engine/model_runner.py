"""Owns the KV cache tensors and runs the model on a scheduled batch.

KV layout: one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, so all
of a block's layers are one contiguous piece (what KV transfer moves), and within a layer each
head's keys are contiguous (what CPU attention multiplies without a transposed copy). Each layer
sees strided ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of its keys and values.

The runner never touches queues: it turns a ``ScheduledBatch`` into flat input tensors, performs
the block copies the scheduler asked for, runs the model and returns the logits of the sequences
that complete this step (in the order of the returned list).

Which attention kernels run is decided here, from the config (``attention_backend``): on CPU the
compiled decode attention of ``kernels.cpu_ops``, built once under ``<cache_dir>/kernels``, unless
``cpu_kernels`` is off or it cannot be built (then the PyTorch reference); on a GPU, Triton.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import Backend, cpu_ops
from kernels.prefill_attention import MEASURE_TOKENS
from services.engine.config import EngineConfig
from services.engine.model.fused_decode import FusedDecode
from services.engine.model.llama import AttentionMetadata, LlamaModel
from services.engine.model.simulated import SimulatedModel
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def kv_bytes_per_block(
    model: LlamaModel | SimulatedModel, block_size: int, dtype: torch.dtype
) -> int:
    cfg = model.config
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def attention_backend(config: EngineConfig) -> str | Backend | None:
    """The attention kernels for ``config`` (``kernels``' ``backend``): on CPU the compiled
    decode attention, loaded (compiled at first start) from ``<cache_dir>/kernels`` with
    ``cpu_kernels_cc``, or ``"reference"`` where ``cpu_kernels`` is off or the build fails (a
    warning says why); other devices: None, dispatch by device (CUDA: Triton)."""
    if torch.device(config.device).type != "cpu":
        return None
    if not config.cpu_kernels:
        return "reference"
    return cpu_ops.load(config.cache_path / "kernels", config.cpu_kernels_cc) or "reference"


def sampling_kernels(config: EngineConfig) -> cpu_ops.CpuKernels | None:
    """The compiled sampling kernels (argmax, the race, the filters' floors), which run on the
    host whatever the device or model (a GPU's or the simulated model's logits are sampled
    there too): the CPU build of ``attention_backend`` (loaded once per process), or None for
    the PyTorch reference where ``cpu_kernels`` is off or the build fails."""
    if not config.cpu_kernels:
        return None
    return cpu_ops.load(config.cache_path / "kernels", config.cpu_kernels_cc)


@dataclass
class PromptHidden:
    """The model's last hidden states at a run of a prompt's positions, for its prompt
    logprobs: row i is position ``start + i``'s, whose logits predict prompt token
    ``start + i + 1``. Hidden states, not logits: a chunk's logits (tokens x vocabulary) are
    computed a slice at a time by whoever records them."""

    seq: Sequence
    start: int
    hidden: torch.Tensor


def prompt_positions(seq: Sequence, start: int, num: int) -> range:
    """The positions of a chunk ``[start, start + num)`` of ``seq`` whose logits its prompt
    logprobs still lack: they are recorded in order, so only from the first one missing (a
    recompute after preemption records nothing twice; KV pulled from elsewhere, none)."""
    if seq.params.prompt_logprobs is None or start > len(seq.prompt_logprobs):
        return range(0)
    return range(len(seq.prompt_logprobs), min(start + num, seq.num_prompt_tokens - 1))


class ModelRunner:
    """Runs ``model`` over the paged KV cache it owns, with the attention kernels ``attention``
    (see ``attention_backend``; None: by device, which on CPU is the PyTorch reference).
    ``model`` may be a ``SimulatedModel`` (a simulated worker): the same calls, a tiny cache."""

    def __init__(
        self,
        model: LlamaModel | SimulatedModel,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        num_swap_blocks: int = 0,
        shared_memory_path: str | None = None,
        attention: str | Backend | None = None,
    ):
        cfg = model.config
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
        if shared_memory_path is not None:  # a file other processes on this host can map
            numel = num_blocks * int(torch.Size(shape).numel())
            flat = torch.from_file(shared_memory_path, shared=True, size=numel, dtype=dtype)
            self.kv_cache = flat.view(num_blocks, *shape)
        else:
            self.kv_cache = torch.zeros(num_blocks, *shape, dtype=dtype, device=self.device)
        self.host_cache = torch.zeros(num_swap_blocks, *shape, dtype=dtype)
        # Kernels take [num_blocks, block_size, kv_heads, head_dim] views (any strides).
        self.layer_caches = [
            (self.kv_cache[:, layer, 0].transpose(1, 2), self.kv_cache[:, layer, 1].transpose(1, 2))
            for layer in range(cfg.num_layers)
        ]
        self.prompt_hidden: list[PromptHidden] = []  # the last execute()'s, for prompt logprobs
        if isinstance(model, LlamaModel):  # decode steps of 1-4 sequences in one call, if it can
            model.fused_decode = FusedDecode.build(model, attention, self.layer_caches)
        if isinstance(attention, cpu_ops.CpuKernels) and dtype == torch.bfloat16:
            seconds = attention.prefill.measure(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if seconds:
                logger.info(
                    "prefill attention at %d tokens: %s: using %s",
                    MEASURE_TOKENS,
                    ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in seconds.items()),
                    min(seconds, key=seconds.__getitem__),
                )

    def copy_blocks(self, batch: ScheduledBatch) -> None:
        """Swap out, swap in, then copy-on-write: all before this step writes any KV."""
        if batch.blocks_to_swap_out:
            dev, host = zip(*batch.blocks_to_swap_out)
            self.host_cache[list(host)] = self.kv_cache[list(dev)].cpu()
        if batch.blocks_to_swap_in:
            host, dev = zip(*batch.blocks_to_swap_in)
            self.kv_cache[list(dev)] = self.host_cache[list(host)].to(self.device)
        if batch.blocks_to_copy:
            src, dst = zip(*batch.blocks_to_copy)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Store whole blocks computed elsewhere (pulled KV) at ``block_ids``."""
        if block_ids:
            dest = torch.tensor(block_ids, device=self.kv_cache.device)
            self.kv_cache[dest] = blocks.to(self.kv_cache)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits ``[num_completed, vocab]`` and the sequences they belong to."""
        self.copy_blocks(batch)
        pairs = list(zip(batch.seqs, batch.num_tokens))
        decodes = [(s, n) for s, n in pairs if n == 1]
        prefills = [(s, n) for s, n in pairs if n != 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, range, int]] = []  # seq, positions, first row
        bs = self.block_size
        for seq, num in ordered:
            start = seq.num_computed_tokens
            wanted = prompt_positions(seq, start, num)
            if wanted:
                prompt_rows.append((seq, wanted, len(input_ids) + wanted.start - start))
            input_ids += seq.token_ids[start : start + num]
            span = range(start, start + num)
            positions += span
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in span]
            if start + num == seq.num_tokens:  # this step completes the sequence: sample
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        meta = self._metadata(decodes, prefills, slots)
        dev = self.device
        hidden = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            self.layer_caches,
            meta,
        )
        self.prompt_hidden = [
            PromptHidden(seq, wanted.start, hidden[row : row + len(wanted)])
            for seq, wanted, row in prompt_rows
        ]
        if not sample_rows:
            return hidden.new_empty(0, self.model.config.vocab_size), []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits, sample_seqs

    def _metadata(
        self,
        decodes: list[tuple[Sequence, int]],
        prefills: list[tuple[Sequence, int]],
        slots: list[int],
    ) -> AttentionMetadata:
        dev = self.device
        decode_lens = [s.num_computed_tokens + 1 for s, _ in decodes]
        prefill_lens = [s.num_computed_tokens + n for s, n in prefills]
        starts = [0]
        for _, n in prefills:
            starts.append(starts[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._block_tables([s for s, _ in decodes], decode_lens),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            decode_max_context_len=max(decode_lens, default=0),
            prefill_block_tables=self._block_tables([s for s, _ in prefills], prefill_lens),
            prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=dev),
            backend=self.attention,
        )

    def _block_tables(self, seqs: list[Sequence], lens: list[int]) -> torch.Tensor:
        width = max((-(-n // self.block_size) for n in lens), default=0)
        rows = [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).view(len(seqs), width)
