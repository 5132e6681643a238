"""What a run leaves behind: the saved JSON (exactly the documented keys), the per-request CSV,
valid PNG plots, sweeps, the SLO search from the command line, and --compare."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.report import CONFIG_KEY, DETAIL_KEYS, SUMMARY_KEYS
from tests.loadtest.standin import MODEL, standin

PNG = b"\x89PNG\r\n\x1a\n"
STATS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std")]


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with standin(ttft=0.01, itl=0.002, capacity=1000) as url:
        yield url


def common(url: str, out: Path, name: str) -> list[str]:
    return ["--base-url", url, "--num-prompts", "12", "--request-rate", "100", "--seed", "1",
            "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.5",
            "--disable-tqdm", "--result-dir", str(out), "--result-filename", name]  # fmt: skip


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG, path
    assert len(data) > 5000, (path, len(data))  # a real figure, not an empty canvas


def test_saved_result_csv_and_plots(server, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    args = common(server, tmp_path, "run.json")
    argv = [*args, "--save-result", "--goodput", "ttft:500", "tpot:50",
            "--metric-percentiles", "50,90,99.9", "--num-warmups", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Request goodput" in printed
    assert "ttft<=500 tpot<=50" in printed  # the SLOs goodput used
    assert "Median TTFT" in printed and "P50 TTFT" not in printed  # no duplicate of the median
    doc = json.loads((tmp_path / "run.json").read_text())
    percentiles = [f"{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                   for p in ("p50", "p90", "p99.9")]  # fmt: skip
    assert set(doc) == {*SUMMARY_KEYS, *STATS, *percentiles, *DETAIL_KEYS, CONFIG_KEY}
    assert doc["model_id"] == MODEL  # found through /v1/models without --model
    assert (doc["completed"], doc["failed"], doc["num_prompts"]) == (12, 0, 12)
    assert doc["request_rate"] == 100 and doc["burstiness"] == 1.0
    assert doc["backend"] == "openai" and doc["max_concurrency"] is None
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    assert all(len(doc[k]) == 12 for k in DETAIL_KEYS)
    assert sum(doc["output_lens"]) == doc["total_output_tokens"]
    assert all(3 <= n <= 9 for n in doc["output_lens"])
    assert doc["errors"] == [""] * 12
    config = doc[CONFIG_KEY]
    assert config["endpoint"] == f"{server}/v1/completions" and config["seed"] == 1
    assert config["slos_ms"] == {"ttft": 500, "tpot": 50} and not config["interrupted"]
    assert config["dataset"]["name"] == "random" and config["dataset"]["input_len"] == 16

    with (tmp_path / "run_requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and all(r["ok"] == "1" and r["good"] == "1" for r in rows)
    assert [int(r["output_len"]) for r in rows] == doc["output_lens"]

    for kind in ("latency_cdf", "timeline", "workload"):
        assert_png(tmp_path / f"run_{kind}.png")

    # Same seed, same workload: two runs compare token for token.
    assert main([*common(server, tmp_path, "again.json"), "--save-result", "--no-plots"]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["input_lens"] == doc["input_lens"]
    assert not list(tmp_path.glob("again_*.png"))
    capsys.readouterr()
    assert main(["--compare", str(tmp_path / "run.json"), str(tmp_path / "again.json")]) == 0
    table = capsys.readouterr().out
    assert "median_ttft_ms" in table and "request_throughput" in table and "%" in table


def test_sweep_writes_a_run_per_rate_and_a_curve(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = [*common(server, tmp_path, "sw"), "--sweep-rates", "50,200,inf", "--save-result",
            "--goodput", "ttft:500"]  # fmt: skip
    assert main(argv) == 0
    for rate in ("50", "200", "inf"):
        assert json.loads((tmp_path / f"sw-rate{rate}.json").read_text())["completed"] == 12
    points = json.loads((tmp_path / "sw_sweep.json").read_text())["runs"]
    assert [p["request_rate"] for p in points] == [50, 200, "inf"]
    assert all(p["slo_attainment"] == 1.0 for p in points)
    assert_png(tmp_path / "sw_sweep.png")


def test_slo_search_from_the_command_line(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A limit the server always meets: the search keeps doubling until the probe budget ends.
    argv = [*common(server, tmp_path, "s"), "--slo-search", "--goodput", "ttft:1000",
            "--slo-search-start-rate", "50", "--slo-search-max-probes", "2",
            "--save-result"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "s_slo.json").read_text())
    assert [p["rate"] for p in doc["probes"]] == [50, 100]
    assert doc["max_rate"] == 100 and not doc["converged"]


def test_ramp_and_errors_are_reported(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    with standin(ttft=0.005, itl=0.001, fail_every=3) as url:
        argv = [*common(url, tmp_path, "r.json"), "--ramp-up-start-rate", "50",
                "--ramp-up-end-rate", "400", "--save-result", "--no-plots"]  # fmt: skip
        assert main(argv) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["request_rate"] == "ramp:50-400"
    assert doc["failed"] == 4 and sum("injected failure" in e for e in doc["errors"]) == 4
    assert "http_500:" in capsys.readouterr().out


def test_module_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "loadtest", "--help"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    for flag in ("--base-url", "--request-rate", "--burstiness", "--goodput", "--sweep-rates",
                 "--slo-search", "--compare", "--ramp-up-start-rate", "--no-stream"):  # fmt: skip
        assert flag in out


def test_bad_arguments_and_a_dead_server(capsys) -> None:  # type: ignore[no-untyped-def]
    dead = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--disable-tqdm"]
    # A run that would never end is refused.
    assert main([*dead, "--duration", "1"]) == 2
    assert "--max-concurrency" in capsys.readouterr().err
    # No server: one line naming the flag, before anything is sent.
    assert main([*dead, "--num-prompts", "3", "--random-input-len", "4"]) == 2
    err = capsys.readouterr().err
    assert "--base-url http://127.0.0.1:9" in err and len(err.strip().splitlines()) == 1


def test_a_presets_saved_config_records_the_ranges_it_ran(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--dataset-name chatbot draws from the preset's ranges and never reads --random-input-len
    or --random-output-len: the saved config records those ranges, not the random defaults."""
    argv = ["--base-url", server, "--dataset-name", "chatbot", "--num-prompts", "6",
            "--request-rate", "inf", "--disable-tqdm", "--save-result", "--no-plots",
            "--result-dir", str(tmp_path), "--result-filename", "chat.json"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "chat.json").read_text())
    dataset = doc[CONFIG_KEY]["dataset"]
    assert dataset["lengths"] == {
        "chatbot": {"input_tokens": [50, 200], "output_tokens": [100, 500]}
    }
    assert "input_len" not in dataset and "output_len" not in dataset
    assert dataset["num_prompts"] == 6 and "uniform" in dataset["distribution"]
    assert all(100 <= n <= 500 for n in doc["output_lens"])  # the stand-in sends max_tokens
    assert all(50 <= n <= 200 for n in doc["input_lens"])


def test_the_summary_says_why_the_scheduled_rate_is_not_the_configured_one(
    server, tmp_path, capsys
) -> None:  # type: ignore[no-untyped-def]
    """30 Poisson arrivals at 50 req/s with seed 0 draw gaps whose own rate is about 41 req/s:
    the summary says that this is chance, and how much of it to expect (1/sqrt(29): 19%), and
    the saved config keeps both; constant gaps (--burstiness inf) need no explanation."""
    argv = ["--base-url", server, "--num-prompts", "30", "--request-rate", "50", "--seed", "0",
            "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm",
            "--result-dir", str(tmp_path)]  # fmt: skip
    assert main([*argv, "--save-result", "--no-plots", "--result-filename", "p.json"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    scheduled = next(i for i, line in enumerate(lines) if "Scheduled arrival rate" in line)
    rate = float(lines[scheduled].split()[-1])
    assert 35 < rate < 47, printed
    assert lines[scheduled + 1] == (
        "  (30 Poisson arrivals: random gaps give a run this short a rate of its own, within "
        "±19% of 50 two times in three; more prompts narrow it)"
    )
    config = json.loads((tmp_path / "p.json").read_text())[CONFIG_KEY]
    assert config["scheduled_rate"] == pytest.approx(rate, abs=0.01)
    assert config["scheduled_rate_note"] == lines[scheduled + 1].strip()[1:-1]

    assert main([*argv, "--burstiness", "inf"]) == 0
    printed = capsys.readouterr().out
    assert "Scheduled arrival rate (RPS):" in printed and "Poisson arrivals" not in printed
