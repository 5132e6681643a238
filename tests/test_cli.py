"""The `pdserve` command as a user runs it: a real subprocess on the real default model."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve import SamplingParams

CLI = [sys.executable, "-m", "pdserve.cli"]
SMALL = ["--num-blocks", "64", "--threads", "1"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False
    )


def test_generate_json_prints_the_engines_tokens(llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    proc = run("generate", "--json", "--max-tokens", "8", *SMALL, stdin="\n".join(prompts) + "\n")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [line["prompt"] for line in lines] == prompts
    assert [line["outputs"][0]["token_ids"] for line in lines] == [
        e.outputs[0].token_ids for e in expected
    ]


def test_demo_runs():
    proc = run("demo", *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "tokens/s" in proc.stdout


def test_bad_input_is_a_message_not_a_traceback():
    proc = run("generate", "--model", "/nonexistent/model", "hello")
    assert proc.returncode == 2
    assert "error: model path '/nonexistent/model' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run("generate", "--max-tokens", "0", *SMALL, "hello")
    assert proc.returncode == 2 and "max_tokens must be an integer >= 1" in proc.stderr


def test_environment_variables_set_flag_defaults(monkeypatch):
    import argparse

    from pdserve.cli import add_engine_args, engine_config_from_args

    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PDSERVE_NO_PREFIX_CACHING", "1")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args([]))
    assert config.scheduler.max_num_seqs == 7 and not config.cache.enable_prefix_caching
    config = engine_config_from_args(parser.parse_args(["--max-num-seqs", "9"]))
    assert config.scheduler.max_num_seqs == 9
