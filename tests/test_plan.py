"""`pdserve plan`: the queueing model on a synthetic profile, the profiler, the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from pdserve.cli import main, make_parser, parse, up_config_from_args
from pdserve.plan import (
    SLO,
    Deployment,
    DisaggregationThresholds,
    Plan,
    decode_context,
    disaggregation_thresholds,
    evaluate,
    fixed_workload,
    make_plan,
    predict,
    predict_colocated_worker,
    preset_workload,
    size_pools,
)
from pdserve.plan_report import format_plan, plan_commands
from pdserve.profile import DecodePoint, ThreadProfile, WorkerProfile, isotonic
from pdserve.queueing import MG1, compound_poisson_cdf
from router.config import RouterConfig
from tests.test_compose import environment as compose_environment
from tests.test_compose import load_compose

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 512, 1024)


def curve(threads: int, speedup: float = 1.0) -> ThreadProfile:
    """Prefill 20 ms + 2 ms/token; decode step 50 ms + 4 ms/seq + 20 us/context token."""
    lengths = [32, 128, 512, 2048]
    prefill = [(0.02 + 0.002 * n) / speedup for n in lengths]
    decode = [
        DecodePoint(b, c, (0.05 + 0.004 * b + 2e-5 * b * c) / speedup)
        for c in CONTEXTS
        for b in BATCHES
    ]
    return ThreadProfile(threads, lengths, prefill, decode)


def synthetic_profile() -> WorkerProfile:
    return WorkerProfile(
        model="synthetic",
        block_size=16,
        kv_bytes_per_token=46080.0,
        kv_pool_tokens=23296,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        transfer_gbps=1.0,
        transfer_latency_s=0.001,
        threads=[curve(1), curve(2, speedup=1.5)],
    )


PROFILE = synthetic_profile()
DECODE_HEAVY = fixed_workload(32, 300)
PREFILL_HEAVY = fixed_workload(2000, 4)
LOOSE = SLO(ttft_s=5.0, tpot_s=0.2)


# -- the profile --------------------------------------------------------------------------------


def test_profile_lookups_follow_the_measured_curves():
    one = PROFILE.for_threads(1)
    for batch, context in [(3, 300), (1, 128), (64, 128), (100, 2000), (20, 700)]:
        expected = 0.05 + 0.004 * batch + 2e-5 * batch * context
        assert one.decode_step_time(batch, context) == pytest.approx(expected), (batch, context)
    assert one.decode_step_time(2, 10) == one.decode_step_time(2, 128)  # below: the smallest
    assert one.prefill_time(128) == pytest.approx(0.276)
    assert one.prefill_time(80) == pytest.approx(0.02 + 0.002 * 80)  # interpolated
    assert one.prefill_time(4096) == pytest.approx(0.02 + 0.002 * 4096)  # last slope
    # 2 blocks of 16 tokens (whole blocks move), 46080 B each token, 1 GB/s, 1 ms latency
    assert PROFILE.transfer_time(17) == pytest.approx(0.001 + 32 * 46080 / 1e9)
    with pytest.raises(KeyError, match="no 4-thread profile"):
        PROFILE.for_threads(4)


def test_a_dip_in_the_measured_step_times_is_taken_as_noise():
    points = [DecodePoint(1, 128, 0.10), DecodePoint(2, 128, 0.08), DecodePoint(4, 128, 0.20)]
    noisy = ThreadProfile(1, [32, 64], [0.1, 0.2], points)
    assert noisy.decode_step_time(1, 128) == pytest.approx(0.09)  # the dip is pooled
    assert noisy.decode_step_time(2, 128) == pytest.approx(0.09)
    assert noisy.decode_step_time(3, 128) == pytest.approx(0.145)
    assert noisy.decode_step_time(8, 128) == pytest.approx(0.20 + 4 * 0.055)  # last slope
    assert isotonic([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2, 2, 2, 4.5, 4.5])


def test_profile_survives_json():
    again = WorkerProfile.from_json(PROFILE.to_json())
    assert again == PROFILE
    assert again.for_threads(2).decode_step_time(3, 100) == PROFILE.for_threads(2).decode_step_time(
        3, 100
    )


# -- the queueing pieces ------------------------------------------------------------------------


def test_mg1_wait_is_pollaczek_khinchine():
    # M/D/1: E[W] = rho S / 2(1 - rho)
    queue = MG1(rate=5.0, service=np.array([0.1]), weights=np.array([1.0]))
    assert queue.utilization == pytest.approx(0.5)
    assert queue.mean_wait == pytest.approx(0.5 * 0.1 / (2 * 0.5))
    assert queue.wait_cdf(np.array([-1.0, 0.0]))[0] == 0.0
    assert queue.wait_cdf(np.array([0.0]))[0] == pytest.approx(0.5)  # no wait w.p. 1 - rho
    assert math.isinf(MG1(10.0, np.array([0.1]), np.array([1.0])).mean_wait)


def test_compound_poisson_with_one_size_is_a_poisson_count():
    # X = N * 0.1 with N ~ Poisson(2): P(X <= 0.25) = P(N <= 2)
    cdf = compound_poisson_cdf(np.array([0.25]), np.array([2.0]), np.array([0.1]), np.array([1.0]))
    expected = sum(math.exp(-2) * 2**k / math.factorial(k) for k in range(3))
    assert cdf[0] == pytest.approx(expected)
    zero = compound_poisson_cdf(np.array([0.0]), np.array([0.0]), np.array([0.1]), np.array([1.0]))
    assert zero[0] == 1.0


def test_colocated_mean_tpot_is_the_decode_step_stretched_by_prefill():
    slo = SLO(5.0, 0.2, "mean")
    one = PROFILE.for_threads(1)
    w = fixed_workload(256, 50)
    p = predict_colocated_worker(PROFILE, one, w, 0.5, slo)
    assert not p.problem
    # a prompt adds its prefill less a one-token step's fixed cost to a step that runs anyway
    rho = 0.5 * (one.prefill_time(256) - one.decode_step_time(1, 0))
    step = one.decode_step_time(p.decode_batch, decode_context(w))
    assert p.prefill_utilization == pytest.approx(rho)
    assert p.tpot_s == pytest.approx(step / (1 - rho), rel=1e-3)
    # Little's law: the batch is the arrival rate times the time in the batch
    assert p.decode_batch == pytest.approx(0.5 * 49 * step / (1 - rho), rel=1e-3)


def test_latencies_grow_with_the_rate():
    for d in (Deployment(1, 1), Deployment(num_colocated=2)):
        prev = predict(PROFILE, d, preset_workload("mixed", 0.25, 0.1), 0.01, LOOSE)
        for rate in (0.1, 0.3, 0.6, 0.9):
            p = predict(PROFILE, d, preset_workload("mixed", 0.25, 0.1), rate, LOOSE)
            assert p.ttft_s >= prev.ttft_s * 0.999 and p.tpot_s >= prev.tpot_s * 0.999, (d, rate)
            prev = p


# -- what the plan decides ----------------------------------------------------------------------


def test_more_decode_workers_never_lower_a_decode_bound_max_rate():
    rates = [evaluate(PROFILE, Deployment(1, y), DECODE_HEAVY, LOOSE).max_rate for y in range(1, 8)]
    assert all(b >= a for a, b in zip(rates, rates[1:])), rates
    assert rates[1] > 1.5 * rates[0]  # decode-bound: a second decode worker nearly doubles it


def test_prefill_heavy_workloads_get_more_prefill_workers():
    def best_split(workload):
        plan = make_plan(PROFILE, workload, SLO(8.0, 0.2), cores=4)
        disagg = [c for c in plan.candidates if c.deployment.is_disaggregated]
        return max(disagg, key=lambda c: c.max_rate).deployment

    assert best_split(PREFILL_HEAVY) == Deployment(3, 1)
    assert best_split(DECODE_HEAVY) == Deployment(1, 3)
    pools = size_pools(PROFILE, PREFILL_HEAVY, SLO(8.0, 0.2), rate=2.0)
    disagg = next(s.deployment for s in pools if s.deployment.is_disaggregated)
    assert disagg.num_prefill > disagg.num_decode


def test_pool_sizes_are_the_fewest_workers_that_meet_the_rate():
    workload = preset_workload("chatbot", 0.25, 0.1)
    for sizing in size_pools(PROFILE, workload, LOOSE, rate=12.0):
        d = sizing.deployment
        assert evaluate(PROFILE, d, workload, LOOSE).max_rate >= 12.0 * 0.999, d.name
        if d.is_disaggregated:
            fewer = [
                Deployment(d.num_prefill - 1, d.num_decode),
                Deployment(d.num_prefill, d.num_decode - 1),
            ]
            fewer = [f for f in fewer if f.num_prefill and f.num_decode]
        else:
            fewer = [Deployment(num_colocated=d.num_colocated - 1, threads=d.threads)]
            fewer = [f for f in fewer if f.num_colocated]
        for f in fewer:
            assert evaluate(PROFILE, f, workload, LOOSE).max_rate < 12.0, f.name


def test_an_slo_tighter_than_one_request_alone_gives_rate_zero_and_says_why():
    # a 2000-token prompt alone takes 4 s to prefill on one thread
    tight = SLO(ttft_s=1.0, tpot_s=0.2)
    c = evaluate(PROFILE, Deployment(1, 1), PREFILL_HEAVY, tight)
    assert c.max_rate == 0.0
    assert "unloaded" in c.limit and "TTFT p90 4020 ms > 1000" in c.limit
    plan = make_plan(PROFILE, PREFILL_HEAVY, tight, cores=2)
    assert all(c.max_rate == 0 for c in plan.candidates)


def test_one_token_answers_have_no_tpot():
    plan = make_plan(PROFILE, fixed_workload(500, 1), SLO(2.0, 0.05), cores=2)
    assert all(c.unloaded.tpot_s == 0 and c.max_rate > 0 for c in plan.candidates)


def test_the_budget_lists_every_split_and_both_colocated_shapes():
    plan = make_plan(PROFILE, DECODE_HEAVY, LOOSE, cores=2)
    names = [c.deployment.name for c in plan.candidates]
    assert names == ["1P:1D", "2x colocated", "1x colocated, 2 threads"]
    names = [c.deployment.name for c in make_plan(PROFILE, DECODE_HEAVY, LOOSE, 4).candidates]
    assert names == ["1P:3D", "2P:2D", "3P:1D", "4x colocated"]  # no 4-thread profile


def test_shared_cores_recommend_only_one_thread_workers():
    # two threads 2.5x faster than one: on cores of its own, the wide worker wins
    profile = dataclasses.replace(PROFILE, threads=[curve(1), curve(2, speedup=2.5)])
    chat = preset_workload("chatbot", 0.25, 0.1)
    plan = make_plan(profile, chat, LOOSE, cores=2, rate=3.0)
    assert plan.best.deployment == Deployment(num_colocated=1, threads=2)
    shared = make_plan(profile, chat, LOOSE, cores=2, rate=3.0, shared_cores=True)
    assert shared.best.deployment.threads == 1
    assert shared.best.max_rate < plan.best.max_rate
    assert all(s.deployment.threads == 1 for s in shared.sizing) and shared.sizing


def test_presets_are_scaled_like_the_goodput_sweep():
    chat = preset_workload("chatbot", 0.25, 0.1)  # in 12-50, out 10-50
    assert min(c.input_tokens for c in chat.classes) >= 12
    assert max(c.input_tokens for c in chat.classes) <= 50
    assert chat.mean_input == pytest.approx(31, abs=1) and chat.mean_output == pytest.approx(
        30, abs=1
    )
    mixed = preset_workload("mixed")
    assert sum(c.weight for c in mixed.classes) == pytest.approx(1.0)
    assert max(c.input_tokens for c in mixed.classes) > 3000  # summarization is in the mix
    with pytest.raises(ValueError, match="unknown preset"):
        preset_workload("poetry")


# -- the command line ---------------------------------------------------------------------------


def plan_args(profile_path: str, *extra: str) -> list[str]:
    return [
        "plan",
        "--profile",
        profile_path,
        "--preset",
        "chatbot",
        "--input-scale",
        "0.25",
        "--output-scale",
        "0.1",
        "--ttft-slo",
        "554",
        "--tpot-slo",
        "168.7",
        "--cores",
        "2",
        *extra,
    ]


def test_cli_prints_the_candidates_and_a_recommendation(tmp_path, capsys):
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    assert main(plan_args(str(path), "--rate", "2")) == 0
    out = capsys.readouterr().out
    assert "SLOs (p90 per request): TTFT <= 554 ms, TPOT <= 168.7 ms; 2 core(s)" in out
    for name in ("1P:1D", "2x colocated", "1x colocated, 2 threads"):
        assert name in out
    assert "at 2 req/s TTFT" in out
    assert "On 2 core(s), run " in out and "Cheapest for 2 req/s" in out
    assert "not recommended" not in out

    assert main(plan_args(str(path), "--shared-cores")) == 0
    out = capsys.readouterr().out
    assert "1x colocated, 2 threads" in out and "(not recommended: shared cores)" in out
    assert "On 2 core(s), run 1x colocated" not in out and "On 2 core(s), run " in out

    assert main(plan_args(str(path), "--json", "--slo-stat", "mean")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slo"]["statistic"] == "mean"
    assert data["best"] in [c["deployment"]["name"] for c in data["candidates"]]
    best = max(data["candidates"], key=lambda c: c["max_rate"])
    assert best["deployment"]["name"] == data["best"]


def test_cli_refuses_a_workload_that_is_not_one(tmp_path, capsys):
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    args = plan_args(str(path))
    args[args.index("--preset") : args.index("--preset") + 2] = ["--isl", "100"]
    assert main(args) == 2
    assert "give either --preset or --isl and --osl" in capsys.readouterr().err


def test_measure_on_a_tiny_range_gives_a_valid_profile_quickly(tmp_path, capsys):
    path = tmp_path / "measured.json"
    started = time.monotonic()
    code = main(
        [
            *plan_args("", "--save-profile", str(path))[:1],
            "--measure",
            "--save-profile",
            str(path),
            "--profile-threads",
            "1",
            "--prefill-tokens",
            "16",
            "256",
            "--batch-sizes",
            "1",
            "4",
            "--contexts",
            "64",
            "--transfer-tokens",
            "64",
            "512",
            "--repeats",
            "1",
            "--isl",
            "100",
            "--osl",
            "20",
            "--ttft-slo",
            "5000",
            "--tpot-slo",
            "500",
            "--cores",
            "1",
        ]
    )
    elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed < 30, f"tiny profile took {elapsed:.1f} s"
    profile = WorkerProfile.load(path)
    one = profile.for_threads(1)
    assert one.prefill_tokens == [16, 256] and len(one.decode) == 2
    assert one.prefill_seconds[1] > one.prefill_seconds[0] > 0
    assert all(p.seconds > 0 for p in one.decode)
    assert profile.transfer_gbps > 0 and profile.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4
    assert "1x colocated" in capsys.readouterr().out


def sweep_with(goodputs: dict[str, float]) -> dict[str, object]:
    """A goodput.json with one preset and one rate, each configuration's goodput given."""
    rows = {name: {"1": {"goodput": g}} for name, g in goodputs.items()}
    result = {"slos_ms": {"ttft": 800.0, "tpot": 200.0}, "rows": rows}
    return {"config": {"input_scale": 0.25, "output_scale": 0.1}, "presets": {"chatbot": result}}


@pytest.mark.parametrize(
    ("goodputs", "exit_code"),
    [
        ({"disagg": 1.0, "2xcoloc": 2.0, "1xcoloc": 2.0}, 0),
        ({"disagg": 2.0, "2xcoloc": 1.0, "1xcoloc": 1.0}, 1),
    ],
)
def test_plan_check_scores_the_recommendation_against_the_sweep(
    tmp_path, capsys, goodputs, exit_code
):  # type: ignore[no-untyped-def]
    """benchmarks/plan_check.py: the synthetic profile recommends a colocated deployment for a
    decode-heavy chatbot; it passes when that one has the best goodput, fails when disagg does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import plan_check

    sweep, profile = tmp_path / "goodput.json", tmp_path / "profile.json"
    sweep.write_text(json.dumps(sweep_with(goodputs)))
    PROFILE.save(profile)
    code = plan_check.main(["--sweep", str(sweep), "--profile", str(profile), "--shared-cores"])
    out = capsys.readouterr().out
    assert "chatbot" in out and "2xcoloc" in out
    assert code == exit_code, out


def test_a_plan_beyond_the_profile_warns_and_lists_only_layouts_that_fit():
    """8 cores and a rate no layout of them meets: it says so, with a warning that the profile
    has 1- and 2-thread workers only, and recommends nothing beyond the 8 cores."""
    workload = fixed_workload(4000, 200)  # longer than the profile's prefills
    plan = make_plan(PROFILE, workload, LOOSE, cores=8, rate=500.0)
    assert any("thread(s) only" in w for w in plan.warnings)
    assert any("prompts of up to 4000 tokens" in w for w in plan.warnings)
    assert all(s.deployment.cores <= 8 for s in plan.sizing)
    text = format_plan(plan)
    assert text.startswith("warning: ")
    assert "No deployment of 8 core(s) meets 500 req/s" in text
    assert "Cheapest" not in text
    within = make_plan(PROFILE, preset_workload("chatbot"), LOOSE, cores=8, rate=0.5)
    assert within.sizing and all(s.deployment.cores <= 8 for s in within.sizing)


def test_a_missing_profile_file_is_one_line(capsys):  # type: ignore[no-untyped-def]
    args = ["plan", "--profile", "nope.json", "--isl", "10", "--osl", "10"]
    assert main([*args, "--ttft-slo", "100", "--tpot-slo", "100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile nope.json: no such file" in err


def test_the_plan_recommends_the_routers_disaggregation_thresholds() -> None:
    """Prefill here is 20 ms + 2 ms/token: a local prefill within one TPOT SLO (100 ms) is at
    most 40 tokens (32 on the 16-token grid); the prefill queue that waits half the TTFT SLO
    (0.5 s) is 240 tokens. Only layouts with a prefill pool need them."""
    workload = preset_workload("chatbot", 0.25, 0.1)
    plan = make_plan(PROFILE, workload, SLO(1.0, 0.1), cores=2)
    assert plan.thresholds == DisaggregationThresholds(32, 240)
    text = format_plan(plan)
    assert "--local-prefill-tokens 32 --prefill-busy-tokens 240" in text
    looser = make_plan(PROFILE, workload, SLO(2.0, 0.2), cores=2).thresholds
    assert looser == DisaggregationThresholds(80, 480)
    assert make_plan(PROFILE, workload, SLO(1.0, 0.1), cores=1).thresholds is None


# -- the commands it ends with ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_PROFILE = ROOT / "benchmarks" / "profiles" / "epyc-2core.json"


def command_lines(text: str) -> list[str]:
    """The indented lines after the first "To run": the commands, which end the report."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("To run"))
    commands = [line.strip() for line in lines[start:] if line.startswith("  ")]
    assert lines[-1].startswith("  "), "the report does not end with a command"
    return commands


def k8s_objects() -> dict[tuple[str, str], dict]:
    """k8s/base's objects by (kind, name)."""
    objects = {}
    for path in sorted((ROOT / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "metadata" in doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def router_reads(env: dict[str, str]) -> argparse.Namespace:
    """`pdserve router`'s settings with ``env`` as its whole environment."""
    return make_parser(env).parse_args(["router"])


def check_commands(plan: Plan, text: str) -> None:
    """Each printed command runs the layout it names, with the names its target knows."""
    run = plan_commands(plan)
    commands = command_lines(text)
    up = shlex.split(next(c for c in commands if c.startswith("pdserve up")))
    config = up_config_from_args(parse(up[1:], {}))  # the real parser and checks of `up`
    d = run.layout.deployment
    assert (config.num_prefill, config.num_decode, config.colocated) == (
        d.num_prefill,
        d.num_decode,
        d.num_colocated,
    )
    assert config.threads_per_worker == d.threads
    assert config.router.ttft_slo_seconds == pytest.approx(plan.slo.ttft_s)
    assert config.router.itl_slo_seconds == pytest.approx(plan.slo.tpot_s)
    t = plan.thresholds
    if d.is_disaggregated:
        assert t is not None
        assert config.router.local_prefill_tokens == t.local_prefill_tokens
        assert config.router.prefill_busy_tokens == t.prefill_busy_tokens
    else:
        assert "--local-prefill-tokens" not in up  # nothing to disaggregate

    compose = [c for c in commands if "docker compose" in c]
    if run.pools is None:
        assert not compose and not any(c.startswith("kubectl") for c in commands)
        return
    pools = run.pools.deployment
    words = shlex.split(compose[0])
    assignments = dict(w.split("=", 1) for w in words[: words.index("docker")])
    assert words[words.index("docker") :][:4] == ["docker", "compose", "up", "-d"]
    scales = dict(w.split("=") for w in words[words.index("docker") + 4 :][1::2])
    services = load_compose(assignments)["services"]
    assert scales == {"prefill": str(pools.num_prefill), "decode": str(pools.num_decode)}
    for name in scales:  # the services exist and get the threads
        assert services[name]["command"] == [name]
        assert compose_environment(services[name])["PDSERVE_THREADS"] == str(pools.threads)
    router = router_reads(compose_environment(services["router"]))
    if t is not None:
        assert (router.local_prefill_tokens, router.prefill_busy_tokens) == (
            t.local_prefill_tokens,
            t.prefill_busy_tokens,
        )
    assert router.ttft_slo_seconds == pytest.approx(plan.slo.ttft_s)
    # a plain `docker compose up` leaves the router's own defaults
    plain = router_reads(compose_environment(load_compose({})["services"]["router"]))
    for name in ("local_prefill_tokens", "prefill_busy_tokens", "ttft_slo_seconds"):
        assert getattr(plain, name) == getattr(RouterConfig(), name), name

    objects, config_data = k8s_objects(), {}
    kubectl = [shlex.split(c) for c in commands if c.startswith("kubectl")]
    for words in kubectl:
        assert words[1:3] == ["-n", "pdserve"]
        verb = words[3:5]
        if verb == ["patch", "hpa"]:
            hpa = objects[("HorizontalPodAutoscaler", words[5])]
            assert hpa["spec"]["scaleTargetRef"]["name"] == words[5]
            size = json.loads(words[words.index("-p") + 1])["spec"]
            expected = pools.num_prefill if words[5] == "prefill" else pools.num_decode
            assert size == {"minReplicas": expected, "maxReplicas": expected}
        elif verb == ["set", "resources"]:
            for target in words[5:-1]:
                assert ("Deployment", target.split("/")[1]) in objects
            assert words[-1] == f"--requests=cpu={pools.threads}"
        elif verb == ["patch", "configmap"]:
            assert ("ConfigMap", words[5]) in objects
            config_data = json.loads(words[words.index("-p") + 1])["data"]
        else:
            assert words[3:] == ["rollout", "restart", "deployment/router"]
            assert ("Deployment", "router") in objects
    assert len(kubectl) == 5
    router = router_reads({**objects[("ConfigMap", "pdserve-config")]["data"], **config_data})
    assert router.itl_slo_seconds == pytest.approx(plan.slo.tpot_s)
    if t is not None:
        assert router.local_prefill_tokens == t.local_prefill_tokens


def test_the_report_ends_with_the_commands_that_run_its_recommendation() -> None:
    """A disaggregated best (4 cores, a tight TPOT), a colocated best with a disaggregated
    layout for Compose and k8s, and a colocated best with none: every command parses with the
    real `pdserve up` parser and names the services, autoscalers and ConfigMap that exist."""
    disaggregated = make_plan(PROFILE, fixed_workload(512, 50), SLO(5.0, 0.1), cores=4)
    assert disaggregated.best.deployment == Deployment(2, 2)
    colocated = make_plan(PROFILE, preset_workload("chatbot", 0.25, 0.1), LOOSE, cores=2)
    assert not colocated.best.deployment.is_disaggregated
    assert plan_commands(colocated).pools is not None
    alone = make_plan(PROFILE, fixed_workload(500, 1), SLO(2.0, 0.05), cores=1)
    assert plan_commands(alone).pools is None
    for plan in (disaggregated, colocated, alone):
        check_commands(plan, format_plan(plan))
    text = format_plan(disaggregated)
    assert "  pdserve up --prefill 2 --decode 2 --threads 1 --local-prefill-tokens 32" in text
    assert "--scale prefill=2 --scale decode=2" in text


def test_chatbot_with_a_500_ms_ttft_recommends_nothing_the_model_rejects() -> None:
    """The committed profile, the chatbot preset, TTFT 500 ms / TPOT 150 ms: one request alone
    misses the TTFT SLO on a one-thread worker (its p90 prompt prefills in 588 ms), so 1P:1D
    never meets it and its router thresholds (once --local-prefill-tokens 0) are no advice."""
    profile = WorkerProfile.load(COMMITTED_PROFILE)
    plan = make_plan(profile, preset_workload("chatbot"), SLO(0.5, 0.15), cores=2)
    one_p_one_d = next(c for c in plan.candidates if c.deployment == Deployment(1, 1))
    assert one_p_one_d.max_rate == 0 and "TTFT p90 588 ms > 500" in one_p_one_d.limit
    assert plan.thresholds is None
    text = format_plan(plan)
    assert "--local-prefill-tokens" not in text and "--prefill-busy-tokens" not in text
    assert "No layout with a prefill pool meets the SLOs" in text
    check_commands(plan, text)
    assert plan.best.max_rate > 0  # 1x colocated, 2 threads: under 0.29 req/s
    best = evaluate(profile, plan.best.deployment, preset_workload("chatbot"), plan.slo)
    assert not predict(profile, best.deployment, plan.workload, best.max_rate, plan.slo).miss(
        plan.slo
    )

    # on one core nothing meets it: said plainly, and the closest layout runs with its miss named
    one = make_plan(profile, preset_workload("chatbot"), SLO(0.5, 0.15), cores=1)
    text = format_plan(one)
    assert "No deployment of 1 core(s) meets the p90 SLOs. The closest is 1x colocated" in text
    assert "To run the closest, 1x colocated (it misses the SLOs: unloaded: TTFT p90" in text
    check_commands(one, text)


@pytest.mark.parametrize("slo", [SLO(1.0, 0.1), SLO(2.0, 0.2), SLO(0.3, 0.5), SLO(5.0, 0.03)])
def test_every_recommended_threshold_passes_the_checks_it_was_read_from(slo: SLO) -> None:
    """A prompt of --local-prefill-tokens prefills within one TPOT SLO and the TTFT SLO; a
    prefill queue of --prefill-busy-tokens clears within half the TTFT SLO; each the longest on
    the 16-token grid that does (0: not even 16 tokens do)."""
    one = PROFILE.for_threads(1)
    t = disaggregation_thresholds(PROFILE, slo)
    for value, limit in (
        (t.local_prefill_tokens, min(slo.tpot_s, slo.ttft_s)),
        (t.prefill_busy_tokens, slo.ttft_s / 2),
    ):
        assert value == 0 or one.prefill_time(value) <= limit
        assert one.prefill_time(value + 16) > limit


def test_the_legend_names_exactly_the_printed_columns(tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    for extra in ((), ("--rate", "2")):
        assert main(plan_args(str(path), *extra)) == 0
        lines = capsys.readouterr().out.splitlines()
        header = next(line for line in lines if line.startswith("deployment"))
        legend = lines[lines.index(header) + len(PROFILE.threads) + 2]
        assert legend.startswith("(") and legend.endswith(")")
        named = [
            title
            for part in legend[1:-1].split("; ")
            for title in part.split(": ", 1)[0].split(", ")
        ]
        assert named == re.split(r"\s{2,}", header.strip()), (header, legend)
        assert ("batch" in named) == bool(extra)
