"""Measure a worker profile on this machine: the curves ``pdserve plan`` predicts from.

A profile holds three measurements of the real engine, offline (no server, no router):

- **prefill**: seconds to compute one prompt alone (and sample its first token) vs its length,
  e.g. 32..2048 tokens: the compute part of TTFT;
- **decode**: seconds of one decode step (every running sequence computes one token) vs the
  batch size (1..64) at a few context lengths. The contexts are not computed: the sequences
  enter the engine through the decode side's pull API (``add_prefilled_request`` /
  ``take_pull_plans`` / ``commit_pull``) with whatever the KV blocks hold, so a batch of long
  contexts costs no prefill to set up. A point that would not fit in the KV pool is skipped:
  a worker with that pool could not run it either;
- **transfer**: seconds to pull a prompt's KV blocks from a server in another process over
  loopback tcp (``kvtransfer``'s own test server and client), fitted as
  ``latency + bytes / bandwidth``.

Prefill and decode are measured at 1 torch thread and at each other thread count asked for (a
colocated worker on 2 cores needs the 2-thread curves), with prefix caching off. A point is the
median of ``repeats`` prefill runs or ``decode_steps`` decode steps, taken in each of
``passes`` passes over the grid; the lowest of those medians is kept (see
:func:`measure_curves`). One engine serves all thread counts (``torch.set_num_threads``
between them), so the model loads once. The process is not pinned; on a shared machine the
figures are as noisy as the machine is busy (the load average at the start is recorded).

Lookups, all piecewise-linear through the medians: prefill time in the prompt length; decode
step time in the batch size at each measured context, then in the context (attention costs per
context token); beyond the last point, the last segment's slope. So a fractional batch, and a
context between or beyond the measured ones, have a step time.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.settings import same_setting, setting
from services.engine.config import EngineConfig, default_num_threads

if TYPE_CHECKING:
    from services.engine.llm_engine import LLMEngine

# numpy (and asyncio) are imported where they are used: `pdserve` builds ProfileConfig's flags
# (`pdserve plan`) for every command, the numpy-free router included.


@dataclass(frozen=True)
class DecodePoint:
    """One measured decode step: ``batch_size`` sequences with ``context`` tokens each."""

    batch_size: int
    context: int
    seconds: float


@dataclass
class ThreadProfile:
    """The prefill and decode curves of a worker running ``num_threads`` torch threads."""

    num_threads: int
    prefill_tokens: list[int]
    prefill_seconds: list[float]
    decode: list[DecodePoint]

    def prefill_time(self, num_tokens: float) -> float:
        """Seconds to prefill a prompt of ``num_tokens`` (interpolated, see the module doc)."""
        return interpolate(
            num_tokens, [float(n) for n in self.prefill_tokens], self.prefill_seconds
        )

    def decode_step_time(self, batch_size: float, context: float) -> float:
        """Seconds of one decode step of ``batch_size`` sequences of ``context`` tokens.

        Piecewise-linear in the batch size at each measured context, then linear in the
        context between the two nearest measured ones (above them: the slope of the last two,
        as attention costs per context token; below the smallest: its time). See
        :meth:`batch_curves`.
        """
        import numpy as np

        curves = self.batch_curves
        contexts = sorted(curves)
        at = [interpolate(batch_size, *curves[c]) for c in contexts]
        if len(contexts) == 1:
            return at[0]
        k = int(np.clip(np.searchsorted(contexts, context) - 1, 0, len(contexts) - 2))
        c0, c1 = contexts[k], contexts[k + 1]
        slope = max((at[k + 1] - at[k]) / (c1 - c0), 0.0)
        return max(at[k] + slope * (context - c0), at[0])

    @cached_property
    def batch_curves(self) -> dict[int, tuple[list[float], list[float]]]:
        """Per measured context: batch sizes and step times made non-decreasing in the batch
        by isotonic regression (a bigger batch never computes less, so a dip is noise, and the
        decode fixed point needs a monotone curve)."""
        by_context: dict[int, list[DecodePoint]] = {}
        for point in sorted(self.decode, key=lambda p: (p.context, p.batch_size)):
            by_context.setdefault(point.context, []).append(point)
        return {
            context: ([float(p.batch_size) for p in points], isotonic([p.seconds for p in points]))
            for context, points in by_context.items()
        }


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent
    violators: a run that goes down is replaced by its mean)."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            prev_mean, prev_count = blocks.pop()
            mean = (prev_mean * prev_count + mean * count) / (prev_count + count)
            count += prev_count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear through the points; beyond the last one, the last segment's slope."""
    import numpy as np

    if len(xs) > 1 and x > xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    return float(np.interp(x, xs, ys))


@dataclass
class WorkerProfile:
    """What ``pdserve plan`` knows about one worker on this machine (saved as JSON)."""

    model: str
    block_size: int
    kv_bytes_per_token: float
    kv_pool_tokens: int  # what the default KV pool (1 GiB) holds: caps the decode batch
    max_num_seqs: int
    max_num_batched_tokens: int
    transfer_gbps: float
    transfer_latency_s: float
    threads: list[ThreadProfile]
    machine: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def for_threads(self, num_threads: int) -> ThreadProfile:
        for profile in self.threads:
            if profile.num_threads == num_threads:
                return profile
        measured = sorted(p.num_threads for p in self.threads)
        raise KeyError(f"no {num_threads}-thread profile (measured: {measured})")

    def has_threads(self, num_threads: int) -> bool:
        return any(p.num_threads == num_threads for p in self.threads)

    def transfer_time(self, num_tokens: float) -> float:
        """Seconds to pull the KV of a ``num_tokens`` prompt (whole blocks move)."""
        num_tokens = math.ceil(num_tokens / self.block_size) * self.block_size
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.transfer_latency_s + num_bytes / (self.transfer_gbps * 1e9)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> WorkerProfile:
        data = json.loads(text)
        data["threads"] = [
            ThreadProfile(
                num_threads=t["num_threads"],
                prefill_tokens=list(t["prefill_tokens"]),
                prefill_seconds=list(t["prefill_seconds"]),
                decode=[DecodePoint(**p) for p in t["decode"]],
            )
            for t in data["threads"]
        ]
        return cls(**data)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> WorkerProfile:
        return cls.from_json(path.read_text())


# -- measuring ----------------------------------------------------------------------------------


def default_profile_threads() -> tuple[int, ...]:
    """1 and the cores this process may use: a one-thread worker, and one on every core."""
    return tuple(sorted({1, default_num_threads()}))


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure; the defaults take about 1.5 min on 2 idle cores (SmolLM2-135M). Its
    settings are `pdserve plan --measure`'s flags."""

    threads: tuple[int, ...] = setting(
        help="torch thread counts to profile (1 and the cores this process may use, unless given)",
        flag="--profile-threads",
        default_factory=default_profile_threads,
    )
    prefill_tokens: tuple[int, ...] = setting(
        (32, 64, 128, 256, 512, 1024, 2048), "prompt lengths to time"
    )
    batch_sizes: tuple[int, ...] = setting(
        (1, 2, 4, 6, 8, 12, 16, 32, 64), "decode batch sizes to time"
    )
    # Attention is linear in the context between the measured ones.
    contexts: tuple[int, ...] = setting((32, 1024), "decode context lengths to time")
    transfer_tokens: tuple[int, ...] = setting((256, 1024, 2048), "KV pull sizes to time")
    repeats: int = setting(3, "prefill runs per point and pass (the median is kept)")
    decode_steps: int = 3  # timed decode steps per point and pass, after one untimed step
    passes: int = 2  # over the whole grid; the lowest per-pass median is kept
    model: str | None = same_setting(EngineConfig, "model")
    cache_dir: str | None = same_setting(EngineConfig, "cache_dir")
    device: str = same_setting(EngineConfig, "device")
    dtype: str = same_setting(EngineConfig, "dtype")
    kv_cache_memory_bytes: int = 1 << 30  # the workers' default pool

    def __post_init__(self) -> None:
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if min(self.repeats, self.decode_steps, self.passes) < 1:
            raise ValueError("repeats, decode_steps and passes must be >= 1")
        if len(self.prefill_tokens) < 2 or min(self.prefill_tokens) < 1:
            raise ValueError("give at least two prefill lengths >= 1")
        if not self.batch_sizes or not self.contexts:
            raise ValueError("give at least one batch size and one context")


LONG_RUN_S = 2.0


def median_time(fn: Callable[[int], object], repeats: int) -> float:
    """The median wall time of ``fn(i)`` over ``repeats`` calls; a first call longer than
    ``LONG_RUN_S`` is not repeated (see :func:`measure_pass`)."""
    times: list[float] = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
        if times[0] > LONG_RUN_S:
            break
    return statistics.median(times)


def token_ids(n: int, salt: int, vocab: int) -> list[int]:
    """``n`` arbitrary token ids (content does not change the compute; ``salt`` varies it)."""
    return [(7 * i + 131 * salt) % (vocab - 200) + 100 for i in range(n)]


def time_prefill(engine: LLMEngine, num_tokens: int, repeats: int) -> float:
    """Median seconds for one prompt of ``num_tokens`` alone, first token included."""
    from common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    vocab = engine.model.config.vocab_size

    def run(i: int) -> None:
        engine.add_request(f"prefill-{num_tokens}-{i}", token_ids(num_tokens, i, vocab), params)
        while engine.has_unfinished_requests():
            engine.step()

    return median_time(run, repeats)


def time_decode(engine: LLMEngine, batch_size: int, context: int, steps: int) -> float:
    """Median seconds of a decode step of ``batch_size`` sequences holding ``context`` tokens.

    The sequences come in as pulled requests whose KV is taken as it is (see the module doc).
    """
    from common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    ids = [f"decode-{batch_size}-{context}-{i}" for i in range(batch_size)]
    try:
        for i, request_id in enumerate(ids):
            engine.add_prefilled_request(request_id, token_ids(context, i, vocab), 100, params)
        engine.step()  # admits them all: the caller checks that the batch fits in the pool
        plans = engine.take_pull_plans()
        assert len(plans) == batch_size, "the caller checks that the batch fits in the pool"
        for plan in plans:
            engine.commit_pull(plan, engine.runner.kv_cache[plan.dest_block_ids])
        engine.step()  # untimed: the first step also computes the first token's KV
        return median_time(lambda _: engine.step(), steps)
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def fits(engine: LLMEngine, batch_size: int, context: int, steps: int) -> bool:
    """Whether ``batch_size`` sequences of ``context`` (+ the steps) fit the pool and limits."""
    block_size = engine.pool.block_size
    blocks = math.ceil((context + steps + 2) / block_size) * batch_size
    return (
        blocks <= engine.pool.num_blocks
        and batch_size <= engine.config.scheduler.max_num_seqs
        and context + steps + 2 < engine.max_model_len
    )


@dataclass
class Medians:
    """The lowest per-pass medians so far of one thread count's points (seconds)."""

    prefill: dict[int, float] = field(default_factory=dict)  # prompt length ->
    decode: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch, context) ->

    def keep(self, table: dict[Any, float], key: Any, seconds: float) -> None:
        table[key] = min(table.get(key, math.inf), seconds)

    def curve(self, num_threads: int) -> ThreadProfile:
        lengths = sorted(self.prefill)
        points = [DecodePoint(b, c, t) for (b, c), t in sorted(self.decode.items())]
        return ThreadProfile(num_threads, lengths, [self.prefill[n] for n in lengths], points)


def measure_pass(
    engine: LLMEngine,
    num_threads: int,
    config: ProfileConfig,
    medians: Medians,
    tick: Callable[[str], None],
) -> None:
    """One pass over the grid at ``num_threads`` torch threads, kept in ``medians``.

    A prefill whose first run took over ``LONG_RUN_S`` is not measured again in later passes
    (it dominates the profile's time, and a long run averages over short interruptions).
    """
    import torch

    torch.set_num_threads(num_threads)
    time_prefill(engine, 16, 1)  # warm-up (the first calls at a thread count allocate)
    for n in config.prefill_tokens:
        if medians.prefill.get(n, 0.0) <= LONG_RUN_S:
            medians.keep(medians.prefill, n, time_prefill(engine, n, config.repeats))
        tick(f"{num_threads} thread(s): prefill {n}")
    for context in config.contexts:
        for batch in config.batch_sizes:
            if fits(engine, batch, context, config.decode_steps):
                seconds = time_decode(engine, batch, context, config.decode_steps)
                medians.keep(medians.decode, (batch, context), seconds)
            tick(f"{num_threads} thread(s): decode {batch}x{context}")


def measure_curves(
    engine: LLMEngine, config: ProfileConfig, tick: Callable[[str], None]
) -> list[ThreadProfile]:
    """The prefill and decode curves at each thread count of ``config``.

    ``config.passes`` passes over the grid, each pass going through every thread count, so
    that a machine whose speed drifts (other tenants, a shared host) slows the thread counts
    alike and their comparison, which decides between one wide worker and several narrow
    ones, holds. Each point keeps the lowest of its per-pass medians: other processes only
    ever add time, and a burst of theirs then spoils one pass of a point, not the point.
    """
    threads = sorted(set(config.threads))
    medians = {n: Medians() for n in threads}
    for _ in range(config.passes):
        for n in threads:
            measure_pass(engine, n, config, medians[n], tick)
    return [medians[n].curve(n) for n in threads]


def measure_transfer(
    engine: LLMEngine, tokens: tuple[int, ...], repeats: int, tick: Callable[[str], None]
) -> tuple[float, float]:
    """``(GB/s, latency s)``: pulls over loopback tcp from a server in another process.

    The server is ``kvtransfer.server_process.ServerProcess`` (random blocks of this model's
    layout);
    the client is ``kvtransfer.make_client("tcp")``, what a decode worker uses. Each size is
    the median of ``repeats`` pulls (after one untimed), then ``seconds = latency + bytes / bw``
    is fitted over the sizes.
    """
    import asyncio

    import numpy as np

    from kvtransfer import KVLayout, make_client
    from kvtransfer.server_process import ServerProcess, ServerSpec

    mcfg, device = engine.model.config, engine.config.device
    layout = KVLayout(
        mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, engine.pool.block_size, "float32"
    )
    blocks = {n: list(range(math.ceil(n / layout.block_size))) for n in tokens}
    pins = {f"profile-{n}": ids for n, ids in blocks.items()}
    num_blocks = max(len(b) for b in blocks.values())
    spec = ServerSpec("tcp", layout, num_blocks, token="p", pins=pins, device=device)
    seconds: dict[int, float] = {}
    with ServerProcess(spec) as server:

        async def pull_all() -> None:
            client = make_client("tcp", token="p", device=device)
            for n, ids in blocks.items():
                times = []
                for i in range(repeats + 1):
                    start = time.perf_counter()
                    await client.pull(server.address, f"profile-{n}", ids, layout, 60.0)
                    if i:
                        times.append(time.perf_counter() - start)
                seconds[n] = statistics.median(times)
                tick(f"transfer {n} tokens")
            await client.close()

        asyncio.run(pull_all())
    sizes = np.array([len(blocks[n]) * layout.bytes_per_block for n in tokens], dtype=float)
    times = np.array([seconds[n] for n in tokens])
    if len(tokens) > 1:
        slope, intercept = np.polyfit(sizes, times, 1)
        if slope > 0:
            return float(1 / slope / 1e9), float(max(intercept, 0.0))
    return float(sizes[-1] / times[-1] / 1e9), 0.0  # one size, or noise: bandwidth alone


def gpu_of(device: str) -> dict[str, str]:
    """``{"gpu": its name}`` for a CUDA device, else nothing."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    return {"gpu": torch.cuda.get_device_name(torch.device(device))}


def measure_profile(config: ProfileConfig, show_progress: bool = True) -> WorkerProfile:
    """Measure every curve of ``config`` with the real engine (see the module doc)."""
    import torch
    from tqdm import tqdm

    from services.engine.config import CacheConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.model_runner import kv_bytes_per_block

    started = time.monotonic()
    load_avg = os.getloadavg()[0]
    previous_threads = torch.get_num_threads()
    engine_config = EngineConfig(
        model=config.model,
        cache_dir=config.cache_dir,
        device=config.device,
        dtype=config.dtype,
        num_threads=max(config.threads),
        cache=CacheConfig(
            enable_prefix_caching=False, kv_cache_memory_bytes=config.kv_cache_memory_bytes
        ),
    )
    engine = LLMEngine(engine_config)
    per_thread = len(config.prefill_tokens) + len(config.contexts) * len(config.batch_sizes)
    total = len(config.threads) * config.passes * per_thread + len(config.transfer_tokens)
    with tqdm(total=total, desc="profile", unit="pt", disable=not show_progress) as bar:

        def tick(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        try:
            curves = measure_curves(engine, config, tick)
        finally:
            torch.set_num_threads(previous_threads)
        gbps, latency = measure_transfer(engine, config.transfer_tokens, config.repeats, tick)
    block_size = engine.pool.block_size
    per_block = kv_bytes_per_block(engine.model, block_size, getattr(torch, engine_config.dtype))
    return WorkerProfile(
        model=engine.model_dir.name,
        block_size=block_size,
        kv_bytes_per_token=per_block / block_size,
        kv_pool_tokens=engine.pool.num_blocks * block_size,
        max_num_seqs=engine_config.scheduler.max_num_seqs,
        max_num_batched_tokens=engine_config.scheduler.max_num_batched_tokens,
        transfer_gbps=gbps,
        transfer_latency_s=latency,
        threads=curves,
        machine={
            **gpu_of(engine_config.device),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_1m_at_start": round(load_avg, 2),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        elapsed_s=time.monotonic() - started,
    )
