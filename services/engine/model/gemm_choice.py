"""The fastest GEMM path for each of a model's linear shapes and row buckets, measured once per
machine and kept in the kernel cache.

Which path is fastest depends on the CPU more than its flags say: on an Emerald Rapids Xeon
oneDNN's native bfloat16 GEMM (VDPBF16PS at half the rate of an fp32 FMA) was the slowest of
the three, and MKL's float32 beat oneDNN's at 64 rows (issue #33); on the same Xeon model with
AMX visible to the guest, the same native GEMM (on AMX tiles) is the fastest from 9 rows on,
3x float32 at 64 rows, and our dot-product kernels serve only 1-8 rows. So at engine start each
distinct ``(out, in)`` shape of the model (q/k/v, o, gate/up, down, the LM head) runs every
candidate path (``packed_linear.candidate_paths``) at each row bucket's upper bound (65+: 256
rows), and the fastest serves the bucket. Details that keep this cheap and honest:

- weights are read from memory, as in a decode step where 30 layers' weights evict each other:
  each path cycles through copies of the weight, so that 1.5 times the L3 cache is read
  between two reads of one copy;
- each call is timed, the paths take turns call by call, and a path's time is its fastest call:
  a shared machine's noise slows calls, it never speeds them up (every call reads a cold
  weight, so no call is faster than the path). Even the lower quartile was noise on the busy
  2-core VM: a parallel region waits for both threads, and with the cores taken each wake-up
  waited a time slice (16 ms calls of a 60 us GEMM); a path ``DROP_BEHIND`` times slower than
  the best after ``MIN_SAMPLES`` calls stops there;
- a weight larger than ``MAX_TIMED_PARAMS`` (the LM head) is timed on its first output rows;
- a path within ``TIE_TOLERANCE`` of the fastest, listed earlier in ``PATHS`` (less weight
  memory), wins the tie, so that noise does not flip between equals; and a path only one bucket
  would use gives way to one the other buckets use where that is within ``FORMAT_TOLERANCE``
  (``fewer_formats``): every path holds its own copy of the weights.

The result is cached per CPU (model and flags), torch version, thread count, weights' dtype,
shapes and candidates: ``<cache-dir>/kernels/gemm-<hash>.json``; a second start reads it and
times nothing. Processes starting together take a file lock, so one measures and the others
read (and no two measure on the same cores at once).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from services.engine.model.packed_linear import (
    FORCEABLE_PATHS,
    FUSABLE_PATHS,
    NUM_BUCKETS,
    PATHS,
    ROW_BUCKETS,
    SMALL_BATCH_PATHS,
    Gemm,
    PathChooser,
    SmallBatchLinear,
    bucket_bounds,
    bucket_label,
    can_run,
    candidate_paths,
    make_gemm,
    serves,
    weight_format,
)

logger = logging.getLogger(__name__)

FORMAT = 5  # of the cache file and how it is measured: part of its key
TIE_TOLERANCE = 0.03
FORMAT_TOLERANCE = 0.10  # a bucket's own weight format must save more than this (see below)
# A bucket whose every layer shape has a small-batch path within this of its fastest takes them
# all (``prefer_fused``). Zen 4, 9-16 rows: gate_up 18% slower on the dot products, the step
# 10-15% faster as one call.
FUSE_TOLERANCE = 0.25
UNFUSED_NAMES = ("lm_head",)  # linears outside the fused decode layers (LlamaModel's head)
MIN_SAMPLES, MAX_SAMPLES = 3, 16  # timed calls of each path per row bucket
SAMPLE_FLOPS = 1e9  # fewer calls where they are long: about this many flops per path
DROP_BEHIND = 2.0  # after MIN_SAMPLES calls, a path this many times slower than the best stops
MAX_TIMED_PARAMS = 1 << 20  # a larger weight is timed on its first output rows
LARGEST_ROWS = 256  # measures the last, open-ended bucket
Shape = tuple[int, int]  # (out_features, in_features)
Clock = Callable[[], float]
# (path, weight, bias, small-batch kernel) -> that path's GEMM: ``make_gemm``, or a test's fake.
GemmMaker = Callable[[str, torch.Tensor, torch.Tensor | None, SmallBatchLinear | None], Gemm]


@dataclass
class GemmTable:
    """The path per row bucket for each shape, and how it was found: ``measured`` (then
    ``seconds`` holds each timed call), ``cache`` or ``forced``."""

    dtype: str
    paths: dict[Shape, tuple[str, ...]]
    names: dict[Shape, list[str]] = field(default_factory=dict)
    seconds: dict[Shape, list[dict[str, float]]] = field(default_factory=dict)
    source: str = "measured"
    measure_seconds: float = 0.0
    load_avg: float = 0.0  # the machine's 1-minute load when measured

    def lines(self) -> list[str]:
        """One line per shape, for the start-up log."""
        return [
            f"{out}x{inp} ({', '.join(self.names.get((out, inp), []))}): "
            + ", ".join(f"{bucket_label(i)} {path}" for i, path in enumerate(paths))
            for (out, inp), paths in self.paths.items()
        ]

    def chooser(self) -> PathChooser:
        """For ``pack_linears``: each layer's paths by its shape (None: keep ``nn.Linear``)."""

        def choose(name: str, linear: nn.Linear) -> tuple[str, ...] | None:
            return self.paths.get((linear.out_features, linear.in_features))

        return choose

    def entries(self) -> list[tuple[str, str, str]]:
        """(shape ``outxin``, row bucket, path) per cell: what ``/metrics`` exports."""
        return [
            (f"{out}x{inp}", bucket_label(i), path)
            for (out, inp), paths in self.paths.items()
            for i, path in enumerate(paths)
        ]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "dtype": self.dtype,
            "buckets": [bucket_label(i) for i in range(NUM_BUCKETS)],
            "shapes": [
                {
                    "out": out,
                    "in": inp,
                    "names": self.names.get((out, inp), []),
                    "paths": list(paths),
                    "seconds": self.seconds.get((out, inp), []),
                }
                for (out, inp), paths in self.paths.items()
            ],
            "measure_seconds": self.measure_seconds,
            "load_avg": self.load_avg,
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "cache") -> GemmTable:
        shapes = data["shapes"]
        for entry in shapes:
            paths = entry["paths"]
            if len(paths) != NUM_BUCKETS or not set(paths) <= set(PATHS):
                raise ValueError(f"not a path per row bucket: {paths}")
            for bucket, path in enumerate(paths):  # a table written under other rules
                if not all(serves(path, rows) for rows in bucket_bounds(bucket) if rows):
                    raise ValueError(f"{path} does not serve rows {bucket_label(bucket)}")
        return cls(
            dtype=data["dtype"],
            paths={(s["out"], s["in"]): tuple(s["paths"]) for s in shapes},
            names={(s["out"], s["in"]): list(s["names"]) for s in shapes},
            seconds={(s["out"], s["in"]): s["seconds"] for s in shapes},
            source=source,
            measure_seconds=data.get("measure_seconds", 0.0),
            load_avg=data.get("load_avg", 0.0),
        )


def model_linears(model: nn.Module) -> dict[Shape, tuple[nn.Linear, list[str]]]:
    """Each distinct ``(out, in)`` shape of ``model``'s CPU linear layers: its first layer and
    the short names of the layers that have it (``qkv_proj``, ``lm_head`` ...)."""
    found: dict[Shape, tuple[nn.Linear, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.device.type == "cpu":
            shape = (module.out_features, module.in_features)
            short = name.rsplit(".", 1)[-1]
            names = found.setdefault(shape, (module, []))[1]
            if short not in names:
                names.append(short)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_rows(index: int) -> int:
    """The row count a bucket is timed at: its upper bound."""
    return ROW_BUCKETS[index] if index < len(ROW_BUCKETS) else LARGEST_ROWS


def fastest(seconds: dict[str, float]) -> str:
    """The fastest path, ties (within ``TIE_TOLERANCE``) to the one earlier in ``PATHS``."""
    best = min(seconds.values())
    return next(p for p in PATHS if p in seconds and seconds[p] <= best * (1 + TIE_TOLERANCE))


def timed_weight(linear: nn.Linear) -> torch.Tensor:
    """The part of ``linear``'s weight that is timed: all of it, or the first output rows up to
    ``MAX_TIMED_PARAMS`` (a multiple of 64): a GEMM's rate is the same over more output columns
    of the same input size, and the LM head's 49,152 would cost a second at 256 rows."""
    weight = linear.weight.detach()
    out, inp = weight.shape
    keep = max(64, MAX_TIMED_PARAMS // inp // 64 * 64)
    return weight if out <= keep else weight[:keep]


def fewer_formats(chosen: list[str], seconds: list[dict[str, float]]) -> tuple[str, ...]:
    """``chosen`` with a path whose copy of the weights only one bucket reads replaced by one
    that reads a copy the others read, where that one is within ``FORMAT_TOLERANCE`` of it
    there: each copy is held in memory, and a few percent on one bucket (noise, often) is not
    worth a second copy of a large model's weights."""
    paths = list(chosen)
    for bucket, path in enumerate(paths):
        others = {weight_format(p) for p in paths[:bucket] + paths[bucket + 1 :]}
        if weight_format(path) in others:
            continue
        times = seconds[bucket]
        limit = times[path] * (1 + FORMAT_TOLERANCE)
        near = [q for q in times if weight_format(q) in others and times[q] <= limit]
        if near:
            paths[bucket] = min(near, key=lambda q: times[q])
    return tuple(paths)


def format_bytes(path: str, weight: torch.Tensor) -> int:
    """Bytes of the weight format ``path`` reads (the widening paths: float32)."""
    same = path == "native" or path in FUSABLE_PATHS
    itemsize = weight.element_size() if same else 4
    return weight.numel() * itemsize


def num_samples(weight: torch.Tensor, rows: int) -> int:
    """Timed calls of each path at ``rows``: ``MAX_SAMPLES``, fewer where calls are long (about
    ``SAMPLE_FLOPS`` in all), at least ``MIN_SAMPLES``."""
    by_flops = int(SAMPLE_FLOPS // (2 * rows * weight.numel()))
    return max(MIN_SAMPLES, min(MAX_SAMPLES, by_flops))


def measure_shape(
    linear: nn.Linear,
    paths: tuple[str, ...],
    small_batch: SmallBatchLinear | None,
    clock: Clock,
    cache_bytes: int,
    make: GemmMaker = make_gemm,
) -> tuple[tuple[str, ...], list[dict[str, float]]]:
    """The fastest of ``paths`` per row bucket for ``linear``'s shape, and each path's seconds
    per call per bucket (paths dropped after the first round are not listed)."""
    weight = timed_weight(linear).contiguous()
    bias = None if linear.bias is None else linear.bias.detach()[: weight.shape[0]]
    # Copies to cycle through, so that each call reads its weight from memory (see above): the
    # paths take turns, so all their formats' bytes pass between two reads of one copy.
    formats = sum(format_bytes(p, weight) for p in paths)
    num_copies = max(1, math.ceil(cache_bytes / formats))
    copies = [weight] + [weight.clone() for _ in range(num_copies - 1)]
    chosen: list[str] = []
    seconds: list[dict[str, float]] = []
    with torch.inference_mode():
        gemms = {p: [make(p, w, bias, small_batch) for w in copies] for p in paths}
        cursor = dict.fromkeys(paths, 0)
        for bucket in range(NUM_BUCKETS):
            rows = bucket_rows(bucket)
            x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
            # The warm-up call (oneDNN builds its kernel for this row count once) also drops a
            # small-batch kernel that declines these inputs (returns None): the dot products'
            # where the library was built without them, by a compiler older than the CPU.
            alive = []
            for p in (q for q in paths if serves(q, rows)):
                if gemms[p][0](x) is not None or p not in SMALL_BATCH_PATHS:
                    alive.append(p)
            samples: dict[str, list[float]] = {p: [] for p in alive}
            total = num_samples(weight, rows)
            for i in range(total):
                for p in alive:  # one call each in turn: a burst of load hits every path alike
                    gemm = gemms[p][cursor[p] % num_copies]
                    cursor[p] += 1
                    start = clock()
                    gemm(x)
                    samples[p].append(clock() - start)
                if i == MIN_SAMPLES - 1:  # a path far behind even at its best is timed no more
                    best = min(min(samples[p]) for p in alive)
                    alive = [p for p in alive if min(samples[p]) <= DROP_BEHIND * best]
            times = {p: min(samples[p]) for p in samples}
            chosen.append(fastest({p: times[p] for p in alive}))
            seconds.append(times)
    return fewer_formats(chosen, seconds), seconds


def measure(
    model: nn.Module,
    small_batch: SmallBatchLinear | None = None,
    clock: Clock = time.perf_counter,
    cache_bytes: int | None = None,
    make: GemmMaker = make_gemm,
) -> GemmTable:
    """Time the candidate paths on every linear shape of ``model`` (see the module docstring)."""
    start = time.perf_counter()
    cache_bytes = cache_bytes if cache_bytes is not None else 3 * l3_bytes() // 2
    table = GemmTable(dtype="", paths={}, load_avg=os.getloadavg()[0])
    for shape, (linear, names) in model_linears(model).items():
        table.dtype = dtype_name(linear.weight.dtype)
        paths = candidate_paths(linear.weight, small_batch is not None)
        table.names[shape] = names
        if not paths:  # nothing runs it here: it keeps nn.Linear
            continue
        if len(paths) == 1:
            table.paths[shape], table.seconds[shape] = (paths[0],) * NUM_BUCKETS, []
            continue
        table.paths[shape], table.seconds[shape] = measure_shape(
            linear, paths, small_batch, clock, cache_bytes, make
        )
    prefer_fused(table)
    table.measure_seconds = time.perf_counter() - start
    return table


def prefer_fused(table: GemmTable) -> None:
    """Where, at some row bucket, every shape of the decoder layers either runs a path the fused
    layers read (``FUSABLE_PATHS``) or has one within ``FUSE_TOLERANCE`` of its fastest, give
    those shapes that path: the
    layers then run as one compiled call per step (``FusedDecode``), which saves more than a
    GEMM or two that are a little slower cost. Shapes only the head has are left alone."""
    layer_shapes = [
        shape for shape, names in table.names.items() if set(names) - set(UNFUSED_NAMES)
    ]
    if not layer_shapes or not all(table.seconds.get(shape) for shape in layer_shapes):
        return
    for bucket in range(NUM_BUCKETS):
        swaps: dict[Shape, str] = {}
        for shape in layer_shapes:
            if table.paths[shape][bucket] in FUSABLE_PATHS:
                continue
            times = table.seconds[shape][bucket]
            small = {p: t for p, t in times.items() if p in FUSABLE_PATHS}
            best = min(small, key=lambda p: small[p], default=None)
            if best is None or small[best] > min(times.values()) * (1 + FUSE_TOLERANCE):
                break
            swaps[shape] = best
        else:
            for shape, path in swaps.items():
                paths = list(table.paths[shape])
                paths[bucket] = path
                table.paths[shape] = tuple(paths)


def l3_bytes() -> int:
    """The CPU's last-level cache (sysfs), or 32 MiB where it does not say."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (OSError, ValueError, IndexError):
        return 32 << 20


def cache_key(model: nn.Module, small_batch: SmallBatchLinear | None, cpu: str) -> str:
    """What a measured table depends on: CPU, torch, threads, shapes, dtypes, candidates, and
    the small-batch kernel's build (its library's file name hashes the C sources)."""
    shapes = [
        [
            *shape,
            str(linear.weight.dtype),
            list(candidate_paths(linear.weight, small_batch is not None)),
        ]
        for shape, (linear, _) in model_linears(model).items()
    ]
    library = getattr(getattr(small_batch, "__self__", None), "path", None)
    build = library.name if isinstance(library, Path) else None
    material = json.dumps(
        [FORMAT, cpu, torch.__version__, torch.get_num_threads(), ROW_BUCKETS, LARGEST_ROWS]
        + [shapes, build]
    )
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def cached_measure(
    model: nn.Module,
    cache_dir: Path,
    cpu: str,
    small_batch: SmallBatchLinear | None = None,
    clock: Clock = time.perf_counter,
    make: GemmMaker = make_gemm,
) -> GemmTable:
    """The table from ``cache_dir`` if this machine measured it before, else measured and saved.
    ``cpu``: the CPU's model and flags (``kernels.cpu_ops.cpu_signature``)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"gemm-{cache_key(model, small_batch, cpu)}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others wait, then read
        if path.exists():
            try:
                return GemmTable.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("GEMM path cache %s unreadable (%s): measuring again", path, exc)
        table = measure(model, small_batch, clock, make=make)
        with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False, suffix=".tmp") as f:
            json.dump(table.to_json(), f, indent=1)
        os.chmod(f.name, 0o644)  # as readable as the kernel library beside it
        os.replace(f.name, path)
    if table.load_avg >= (os.cpu_count() or 1):  # others' work on our cores: noise, not speed
        logger.warning(
            "GEMM paths measured on a busy machine (load %.1f on %d cores): delete %s to "
            "measure again when it is quiet",
            table.load_avg,
            os.cpu_count() or 1,
            path,
        )
    return table


def choose_paths(
    model: nn.Module,
    mode: str = "auto",
    small_batch: SmallBatchLinear | None = None,
    cache_dir: Path | None = None,
    cpu: str = "",
    clock: Clock = time.perf_counter,
    make: GemmMaker = make_gemm,
) -> GemmTable | None:
    """The path table for ``model``'s CPU linear layers (None: it has none): ``mode`` for every
    row count where a layer can run it (``--cpu-matmul``), or ``auto``: measured, through the
    cache in ``cache_dir`` (None: measured, not kept)."""
    linears = model_linears(model)
    if not linears:
        return None
    if mode != "auto":
        if mode not in FORCEABLE_PATHS:
            raise ValueError(f"matmul mode must be auto or one of {FORCEABLE_PATHS}, got {mode!r}")
        first = next(iter(linears.values()))[0]
        return GemmTable(
            dtype=dtype_name(first.weight.dtype),
            paths={
                shape: (mode,) * NUM_BUCKETS
                for shape, (linear, _) in linears.items()
                if can_run(mode, linear.weight, small_batch is not None)
            },
            names={shape: names for shape, (_, names) in linears.items()},
            source="forced",
        )
    if cache_dir is None:
        return measure(model, small_batch, clock, make=make)
    return cached_measure(model, cache_dir, cpu, small_batch, clock, make)
