"""The GEMM path chooser (``services.engine.model.gemm_choice``): it keeps the fastest path per
shape and row bucket, reads its cache instead of timing again, and ``--cpu-matmul`` forces a
path. The timings here come from a fake clock that each fake GEMM advances by its path's cost,
so the expected choice is known; the paths' real arithmetic is checked in
tests/engine/test_packed_linear.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from services.engine.model import gemm_choice
from services.engine.model.gemm_choice import GemmTable, cached_measure, choose_paths, fastest
from services.engine.model.packed_linear import (
    NUM_BUCKETS,
    PackedLinear,
    bucket_label,
    bucket_of,
    candidate_paths,
    pack_linears,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (mkldnn)"
)

# Fake seconds per call, by path and rows: each bucket has another winner.
COSTS = {
    "native": {1: 9.0, 4: 9.0, 8: 9.0, 16: 1.0, 64: 5.0, 256: 2.0},
    "float32": {1: 8.0, 4: 8.0, 8: 8.0, 16: 3.0, 64: 4.0, 256: 1.0},
    "mkl": {1: 7.0, 4: 1.0, 8: 3.0, 16: 2.0, 64: 1.0, 256: 9.0},
    "small-batch": {1: 1.0, 4: 2.0},
    "small-batch-4": {1: 1.5, 4: 0.5},
    "small-batch-dot": {4: 3.0, 8: 0.5, 16: 4.0},
    "pairs-dot": {1: 5.0, 4: 5.0, 8: 5.0, 16: 5.0, 64: 0.5, 256: 5.0},
}


DECLINED: set[str] = set()  # paths whose fake kernel declines every input (as a build without them)


class FakeClock:
    """A clock that moves only when a fake GEMM runs; counts the readings."""

    def __init__(self) -> None:
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now


def fake_maker(clock: FakeClock):  # type: ignore[no-untyped-def]
    """A ``GemmMaker`` whose GEMMs cost ``COSTS`` on ``clock`` and compute nothing."""

    def make(path: str, weight: torch.Tensor, bias, small_batch):  # type: ignore[no-untyped-def]
        def gemm(x: torch.Tensor) -> torch.Tensor | None:
            clock.now += COSTS[path][len(x)]
            return None if path in DECLINED else x

        return gemm

    return make


def never_called(*args: object) -> None:
    raise AssertionError("a kernel the fake GEMMs stand in for ran")


def tiny_model(dtype: torch.dtype) -> nn.ModuleDict:
    model = nn.ModuleDict(
        {"up": nn.Linear(64, 128), "down": nn.Linear(128, 64), "up2": nn.Linear(64, 128)}
    )
    return model.to(dtype)


def expected(weight: torch.Tensor) -> tuple[str, ...]:
    """The fastest candidate of ``weight`` per bucket under ``COSTS``."""
    paths = candidate_paths(weight, has_small_batch=True)
    rows = (1, 4, 8, 16, 64, 256)
    return tuple(min((p for p in paths if r in COSTS[p]), key=lambda p: COSTS[p][r]) for r in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fastest_candidate_wins_each_bucket(dtype: torch.dtype) -> None:
    model = tiny_model(dtype)
    clock = FakeClock()
    table = gemm_choice.measure(model, never_called, clock, make=fake_maker(clock))
    assert set(table.paths) == {(128, 64), (64, 128)}  # one entry per distinct shape
    assert table.names[(128, 64)] == ["up", "up2"]
    for (out, inp), paths in table.paths.items():
        assert paths == expected(model["down" if out == 64 else "up"].weight)
        for bucket, path in enumerate(paths):  # the recorded seconds back the choice
            times = table.seconds[(out, inp)][bucket]
            assert times[path] == min(times.values())
    if dtype == torch.bfloat16 and "small-batch" in candidate_paths(model["up"].weight, True):
        assert table.paths[(128, 64)][:2] == ("small-batch", "small-batch-4")
    if dtype == torch.bfloat16 and "small-batch-dot" in candidate_paths(model["up"].weight, True):
        assert table.paths[(128, 64)][2] == "small-batch-dot"
    if dtype == torch.bfloat16 and "pairs-dot" in candidate_paths(model["up"].weight, True):
        assert table.paths[(128, 64)][4] == "pairs-dot"


def test_a_near_tie_goes_to_the_path_with_less_weight_memory() -> None:
    assert fastest({"mkl": 1.0, "native": 1.02}) == "native"  # within TIE_TOLERANCE
    assert fastest({"mkl": 1.0, "native": 1.10}) == "mkl"
    assert fastest({"small-batch": 1.01, "native": 1.0}) == "native"  # earlier in PATHS


def test_a_path_one_bucket_would_use_gives_way_to_a_near_one_the_others_use() -> None:
    """mkl wins 1 row by 5% over native, which every other bucket uses: native there (one copy
    of the weights, not two); by 20% it keeps its bucket."""
    others = [{"native": 1.0, "mkl": 2.0}] * 4
    near = [{"native": 1.05, "mkl": 1.0}, *others]
    assert gemm_choice.fewer_formats(["mkl"] + ["native"] * 4, near) == ("native",) * 5
    far = [{"native": 1.2, "mkl": 1.0}, *others]
    assert gemm_choice.fewer_formats(["mkl"] + ["native"] * 4, far)[0] == "mkl"
    # small-batch at one row beside the dot products elsewhere: small-batch-4, whose copy of the
    # weights the dot products read, within 10% of it, takes its place.
    dots = [{"small-batch-dot": 1.0, "native": 2.0}] * 2 + [{"native": 1.0}] * 3
    one = [{"small-batch": 1.0, "small-batch-4": 1.08, "native": 3.0}, *dots]
    chosen = ["small-batch", "small-batch-dot", "small-batch-dot"] + ["native"] * 3
    assert gemm_choice.fewer_formats(chosen, one)[0] == "small-batch-4"


def test_a_far_slower_path_stops_being_timed() -> None:
    """At 4 rows native costs 9x mkl (float32 weights' candidates): it stops after
    MIN_SAMPLES calls, mkl goes on to the full count."""
    clock = FakeClock()
    linear = tiny_model(torch.float32)["up"]
    calls = []

    def counting(path: str, weight: torch.Tensor, bias, small_batch):  # type: ignore[no-untyped-def]
        def gemm(x: torch.Tensor) -> None:
            calls.append((path, len(x)))
            clock.now += COSTS[path][len(x)]

        return gemm

    gemm_choice.measure_shape(linear, ("native", "mkl"), None, clock, 0, counting)
    at4 = [p for p, rows in calls if rows == 4]
    assert at4.count("native") == gemm_choice.MIN_SAMPLES + 1  # + its warm-up call
    assert at4.count("mkl") > at4.count("native")


def test_the_cache_is_read_on_the_second_start(tmp_path: Path) -> None:
    model = tiny_model(torch.float32)
    clock = FakeClock()
    first = cached_measure(model, tmp_path, "cpu A", None, clock, fake_maker(clock))
    assert first.source == "measured" and clock.readings > 0
    files = list(tmp_path.glob("gemm-*.json"))
    assert len(files) == 1

    idle = FakeClock()
    second = cached_measure(model, tmp_path, "cpu A", None, idle, fake_maker(idle))
    assert idle.readings == 0  # nothing timed
    assert second.source == "cache" and second.paths == first.paths
    assert second.seconds == first.seconds

    other_cpu = FakeClock()  # another CPU (or torch, threads, shapes): measured again
    cached_measure(model, tmp_path, "cpu B", None, other_cpu, fake_maker(other_cpu))
    assert other_cpu.readings > 0 and len(list(tmp_path.glob("gemm-*.json"))) == 2


def test_an_unreadable_cache_is_measured_again(tmp_path: Path) -> None:
    model = tiny_model(torch.float32)
    clock = FakeClock()
    cached_measure(model, tmp_path, "cpu", None, clock, fake_maker(clock))
    (path,) = tmp_path.glob("gemm-*.json")
    path.write_text("{not json")
    again = FakeClock()
    table = cached_measure(model, tmp_path, "cpu", None, again, fake_maker(again))
    assert again.readings > 0 and table.source == "measured"
    assert GemmTable.from_json(json.loads(path.read_text())).paths == table.paths


@pytest.mark.parametrize("mode", ["native", "float32", "mkl"])
def test_cpu_matmul_forces_its_path_without_timing(mode: str, tmp_path: Path) -> None:
    model = tiny_model(torch.float32)
    clock = FakeClock()
    table = choose_paths(model, mode, None, tmp_path, "cpu", clock, fake_maker(clock))
    assert table is not None and table.source == "forced"
    assert clock.readings == 0 and not list(tmp_path.iterdir())
    assert pack_linears(model, table.chooser()) == 3
    for layer in model.values():
        assert isinstance(layer, PackedLinear) and layer.paths == (mode,) * NUM_BUCKETS
    with pytest.raises(ValueError, match="matmul mode"):
        choose_paths(tiny_model(torch.float32), "fast")


def test_auto_packs_each_layer_with_its_shapes_table(tmp_path: Path) -> None:
    model = tiny_model(torch.float32)
    clock = FakeClock()
    table = choose_paths(model, "auto", None, tmp_path, "cpu", clock, fake_maker(clock))
    assert table is not None
    pack_linears(model, table.chooser())
    assert model["up"].paths == model["up2"].paths == table.paths[(128, 64)]
    assert model["down"].paths == table.paths[(64, 128)]
    assert len(table.lines()) == 2 and "up, up2" in table.lines()[0]
    assert ("128x64", "1", table.paths[(128, 64)][0]) in table.entries()


def test_row_buckets() -> None:
    rows = (1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 4096)
    assert [bucket_of(r) for r in rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    labels = ["1", "2-4", "5-8", "9-16", "17-64", "65+"]
    assert [bucket_label(i) for i in range(NUM_BUCKETS)] == labels


def test_a_workers_metrics_export_the_table(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from services.engine.stats import EngineStats
    from services.worker.metrics import WorkerMetrics

    clock = FakeClock()
    table = choose_paths(tiny_model(torch.float32), "auto", None, tmp_path, "cpu", clock,
                         fake_maker(clock))  # fmt: skip
    assert table is not None
    metrics = WorkerMetrics("decode", EngineStats, gemm_paths=table.entries())
    text = generate_latest(metrics.registry).decode()
    for shape, rows, path in table.entries():
        line = f'pdserve_gemm_path_info{{path="{path}",rows="{rows}",shape="{shape}"}} 1.0'
        assert line in text
    assert text.count("pdserve_gemm_path_info{") == 2 * NUM_BUCKETS


def test_a_cached_table_that_breaks_the_row_rules_is_refused() -> None:
    """A path on rows it does not serve (a table written by another version) is not read: the
    chooser then measures again, as for an unreadable file."""
    entry = {"out": 8, "in": 16, "names": ["up"], "seconds": []}
    data = {"dtype": "bfloat16", "shapes": [entry]}
    entry["paths"] = ["small-batch-4", "small-batch-dot"] + ["native"] * (NUM_BUCKETS - 2)
    assert GemmTable.from_json(data).paths[(8, 16)][1] == "small-batch-dot"
    for paths in (
        ["small-batch-dot"] * 2 + ["native"] * (NUM_BUCKETS - 2),  # dot products at one row
        ["small-batch"] * 3 + ["native"] * (NUM_BUCKETS - 3),  # the widening kernel at 5-8
    ):
        entry["paths"] = paths
        with pytest.raises(ValueError, match="does not serve rows"):
            GemmTable.from_json(data)


def test_a_bucket_goes_to_the_small_batch_paths_where_the_layers_can_run_as_one_call() -> None:
    """At a bucket where every decoder-layer shape has a small-batch path within 25% of its
    fastest, each takes it (the fused decode step then runs); one shape 30% behind keeps the
    bucket as timed; the head's shape is left to its own timing."""
    dot, native = "small-batch-dot", "native"

    def times(dot_at_16: float) -> list[dict[str, float]]:  # the dot products serve 2-16 rows
        alone = {native: 1.0}
        return [alone, *[{native: 1.0, dot: 1.1}] * 2, {native: 1.0, dot: dot_at_16}, alone, alone]

    def table(gate_up_dot: float) -> GemmTable:
        return GemmTable(
            dtype="bfloat16",
            paths={(8, 4): (native,) * 6, (16, 4): (native,) * 6, (64, 4): (native,) * 6},
            names={(8, 4): ["qkv_proj"], (16, 4): ["gate_up_proj"], (64, 4): ["lm_head"]},
            seconds={(8, 4): times(1.1), (16, 4): times(gate_up_dot), (64, 4): times(1.1)},
        )

    near = table(1.18)
    gemm_choice.prefer_fused(near)
    fused = (native, dot, dot, dot, native, native)
    assert near.paths[(8, 4)] == near.paths[(16, 4)] == fused
    assert near.paths[(64, 4)] == (native,) * 6  # the head is not in the fused call
    far = table(1.3)
    gemm_choice.prefer_fused(far)
    assert far.paths[(16, 4)][3] == native and far.paths[(8, 4)][3] == native
    assert far.paths[(16, 4)][2] == dot


def test_a_path_whose_kernel_declines_is_not_chosen() -> None:
    """A small-batch kernel that returns None (a library built without the CPU's dot products)
    is dropped at its warm-up call: the bucket goes to the fastest path that computes."""
    model = tiny_model(torch.bfloat16)
    clock = FakeClock()
    DECLINED.add("small-batch-dot")
    try:
        table = gemm_choice.measure(model, never_called, clock, make=fake_maker(clock))
    finally:
        DECLINED.clear()
    for paths in table.paths.values():
        assert "small-batch-dot" not in paths
