"""The `pdserve` command as a user runs it: a real subprocess on the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_environment_variables_set_flag_defaults():
    from pdserve.cli import engine_config_from_args, parse

    env = {"PDSERVE_MAX_NUM_SEQS": "7", "PDSERVE_NO_PREFIX_CACHING": "1"}
    config = engine_config_from_args(parse(["generate"], env))
    assert config.scheduler.max_num_seqs == 7 and not config.cache.enable_prefix_caching
    config = engine_config_from_args(parse(["generate", "--max-num-seqs", "9"], env))
    assert config.scheduler.max_num_seqs == 9


def test_a_decode_worker_caps_the_prompt_part_of_its_steps_unless_told():
    from pdserve.cli import parse, worker_config_from_args
    from services.worker.config import DECODE_PROMPT_TOKENS

    def cap(role: str, *flags: str) -> int | None:
        config = worker_config_from_args(role, parse([role, *flags], {}))
        return config.role_engine.scheduler.max_prompt_tokens_beside_decodes

    assert cap("decode") == DECODE_PROMPT_TOKENS == 256
    assert cap("decode", "--max-prompt-tokens-beside-decodes", "64") == 64
    assert cap("prefill") is None and cap("colocated") is None
    assert cap("colocated", "--max-prompt-tokens-beside-decodes", "512") == 512


def test_sizes_take_units_and_help_shows_defaults():
    from pdserve.cli import engine_config_from_args, parse

    config = engine_config_from_args(parse(["generate", "--kv-cache-memory", "512M"], {}))
    assert config.cache.kv_cache_memory_bytes == 512 << 20
    config = engine_config_from_args(parse(["generate"], {"PDSERVE_KV_CACHE_MEMORY": "2G"}))
    assert config.cache.kv_cache_memory_bytes == 2 << 30
    proc = run("up", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    port = "--port PORT the router's HTTP port (0: any free port) (default: 8000; env PDSERVE_PORT)"
    assert port in text
    assert "(default: 1G; env PDSERVE_KV_CACHE_MEMORY)" in text  # every engine flag, with units
    assert "--max-num-seqs" in text and "--prefill-policy" in text
    proc = run("decode", "--kv-cache-memory", "lots")
    assert proc.returncode == 2
    assert "'lots' is not a size: give bytes or a number with K, M, G or T" in proc.stderr


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("pdserve ")


def test_the_installed_commands_run_outside_the_checkout(tmp_path):
    """The console scripts as `make up` runs them: from another directory, only the installed
    packages importable (a package missing from pyproject's list fails here, not in CI's cwd)."""
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in (
        ["pdserve", "--version"],
        ["pdserve", "up", "--help"],
        ["pdserve-loadtest", "-h"],
        ["pdserve-loadtest", "--version"],
    ):
        proc = subprocess.run(
            [os.path.join(bin_dir, command[0]), *command[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr[-2000:]}"


def test_a_worker_refuses_to_start_without_a_cluster_token():
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    proc = subprocess.run(
        [*CLI, "decode", *SMALL], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2
    assert "error: no cluster token: set PDSERVE_CLUSTER_TOKEN or --cluster-token-file" in (
        proc.stderr
    )
    assert "--insecure" in proc.stderr and "Traceback" not in proc.stderr


def test_secrets_come_from_the_environment_or_a_file(tmp_path):
    from pdserve.cli import parse, router_config_from_args

    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    config = router_config_from_args(parse(["router", "--cluster-token-file", str(token_file)], {}))
    assert config.cluster_token == "from-a-file"
    env = {"PDSERVE_CLUSTER_TOKEN": "from-env", "PDSERVE_REDIS_PASSWORD_FILE": str(token_file)}
    config = router_config_from_args(parse(["router"], env))
    assert config.cluster_token == "from-env" and config.redis_password == "from-a-file"
    assert "from-env" not in repr(config)  # secrets stay out of logs
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValueError, match="the secret file .* is empty"):
        router_config_from_args(parse(["router", "--cluster-token-file", str(empty)], {}))


def test_shared_settings_are_declared_once_with_the_same_flags_and_variables():
    import dataclasses

    from common.settings import flag_of, same_setting, settings_of
    from common.shared_settings import ClusterSettings, RegistrySettings, TracingSettings
    from pdserve.cli import parse, router_config_from_args, worker_config_from_args
    from pdserve.profile import ProfileConfig
    from pdserve.up_config import UpConfig
    from router.config import RouterConfig
    from services.engine.config import EngineConfig
    from services.worker.config import WorkerConfig

    origins = (RegistrySettings, ClusterSettings, TracingSettings, EngineConfig)
    shared = 0
    for config in (RouterConfig, WorkerConfig, UpConfig, ProfileConfig):
        for path, f, spec, _ in settings_of(config, nested=False):
            if "same_as" not in f.metadata:
                continue
            origin, name = f.metadata["same_as"]
            assert origin in origins and name == path
            [mine] = [o for o in settings_of(origin) if o[0] == name]
            assert flag_of(name, spec) == flag_of(name, mine[2])  # so the same PDSERVE_* name
            assert spec.help.startswith(mine[2].help)  # a component may add a note
            shared += 1
    assert shared >= 20
    with pytest.raises(TypeError, match="no setting"):
        same_setting(RegistrySettings, "redis_host")

    @dataclasses.dataclass
    class Misnamed:
        url: str = same_setting(RegistrySettings, "redis_url")

    with pytest.raises(TypeError, match="is RegistrySettings.redis_url"):
        list(settings_of(Misnamed))

    env = {
        "PDSERVE_REDIS_URL": "redis://r:1/0",
        "PDSERVE_REDIS_PREFIX": "p:",
        "PDSERVE_TTL_SECONDS": "3",
        "PDSERVE_TRACE_FILE": "t.jsonl",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317",
        "PDSERVE_INSECURE": "1",
        "PDSERVE_MODEL": "m",
        "PDSERVE_CLUSTER_TOKEN": "tok",
    }
    router = router_config_from_args(parse(["router"], env))
    worker = worker_config_from_args("decode", parse(["decode"], env))
    for name in ("redis_url", "redis_prefix", "ttl_seconds", "trace_file", "otlp_endpoint"):
        assert getattr(router, name) == getattr(worker, name), name
    assert (router.otlp_endpoint, router.ttl_seconds, router.model) == ("http://otel:4317", 3, "m")
    assert router.insecure and worker.insecure and worker.cluster_token == "tok"
    assert worker.engine.model == "m"
    assert WorkerConfig("decode").redis_url is None  # the worker's own default: not registered
    assert RouterConfig().redis_url == "redis://127.0.0.1:6379/0"


def test_up_hands_the_engines_model_settings_to_the_router():
    from pdserve.cli import parse, up_config_from_args

    argv = "up --model m --cache-dir /c --max-model-len 99 --max-prompts 3".split()
    args = up_config_from_args(parse(argv, {})).router_args("redis://x")
    for flag in (["--model", "m"], ["--cache-dir", "/c"], ["--max-model-len", "99"]):
        assert any(args[i : i + 2] == flag for i in range(len(args))), args
    assert args.count("--model") == 1 and "--max-prompts" in args
    assert "--model" not in up_config_from_args(parse(["up"], {})).router_args("redis://x")


def test_plan_and_generate_flags_come_from_their_configs():
    import argparse

    from common.settings import build, flag_of, settings_of, to_flags
    from pdserve.cli import GenerateConfig, PlanConfig, make_parser, parse
    from pdserve.profile import ProfileConfig

    commands = next(
        a for a in make_parser({})._actions if isinstance(a, argparse._SubParsersAction)
    )
    options = {o for a in commands.choices["plan"]._actions for o in a.option_strings}
    assert {flag_of(f.name, spec) for _, f, spec, _ in settings_of(PlanConfig)} <= options

    env = {"PDSERVE_TTFT_SLO": "500", "PDSERVE_BATCH_SIZES": "1, 4", "PDSERVE_MODEL": "m"}
    argv = ["plan", "--measure", "--tpot-slo", "150", "--preset", "chatbot"]
    argv += ["--prefill-tokens", "16", "256", "--prefill-tokens", "512", "--cache-dir", "/c"]
    config = build(PlanConfig, parse(argv, env))
    assert (config.ttft_slo, config.tpot_slo, config.slo.statistic) == (500, 150, "p90")
    assert config.measuring == ProfileConfig(
        prefill_tokens=(16, 256, 512), batch_sizes=(1, 4), model="m", cache_dir="/c"
    )
    assert config.workload.name == "chatbot"
    again = build(PlanConfig, parse(["plan", *to_flags(config)], {}))
    assert again == config
    with pytest.raises(ValueError, match=r"give either --profile FILE \(.*\) or --measure"):
        build(PlanConfig, parse(["plan", "--tpot-slo", "1", "--preset", "mixed"], env))
    with pytest.raises(SystemExit):  # the SLOs are required
        parse(["plan", "--measure", "--preset", "mixed"], {})

    args = parse(["generate", "--stop", "a", "--stop", "b,c", "--json", "one", "two"], {})
    config = build(GenerateConfig, args)
    assert args.prompt == ["one", "two"] and config.stop == ("a", "b,c") and config.json
    assert config.sampling_params().stop == ["a", "b,c"]
    env = {"PDSERVE_MAX_TOKENS": "5", "PDSERVE_STOP": "x"}
    assert build(GenerateConfig, parse(["generate"], env)) == GenerateConfig(
        max_tokens=5, stop=("x",)
    )


VLLM_SERVE = [
    "/models/m",  # vllm serve's positional model
    "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "chat",
    "--api-key", "sk-1", "--dtype", "bfloat16", "--max-model-len", "512",
    "--chat-template", "t.jinja", "--tokenizer", "/tok", "--generation-config", "vllm",
    "--quantization", "int8",
]  # fmt: skip


@pytest.mark.parametrize("command", ["serve", "up"])
def test_serve_and_up_take_what_a_vllm_serve_user_types(command):
    from pdserve.cli import parse, up_config_from_args

    config = up_config_from_args(parse([command, *VLLM_SERVE], {}))
    assert (config.host, config.port, config.router.api_key) == ("0.0.0.0", 9000, "sk-1")
    assert (config.engine.model, config.engine.dtype) == ("/models/m", "bfloat16")
    assert str(config.engine.tokenizer_dir(Path("/models/m"))) == "/tok"  # the workers'
    router = config.router_args("redis://x", 9000)
    workers = config.worker_args("redis://x")
    pairs = lambda args: {(a, b) for a, b in zip(args, args[1:])}  # noqa: E731
    assert {
        ("--host", "0.0.0.0"),
        ("--model", "/models/m"),
        ("--served-model-name", "chat"),
        ("--max-model-len", "512"),
        ("--chat-template", "t.jinja"),
        ("--tokenizer", "/tok"),
        ("--generation-config", "vllm"),
    } <= pairs(router)
    assert "sk-1" not in router  # the key goes by environment
    assert {
        ("--host", "127.0.0.1"),
        ("--model", "/models/m"),
        ("--dtype", "bfloat16"),
        ("--quantization", "int8"),  # every worker runs the same weights
    } <= pairs(workers)
    assert {("--tokenizer", "/tok"), ("--max-model-len", "512")} <= pairs(workers)
    assert up_config_from_args(parse([command, "--model", "m", "m"], {})).engine.model == "m"
    with pytest.raises(ValueError, match="two models: a and --model b"):
        up_config_from_args(parse([command, "a", "--model", "b"], {}))


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["serve", "m", "--tensor-parallel-size", "2"], "--tensor-parallel-size (a vllm serve"),
        (["up", "--gpu-memory-utilization", "0.9"], "--kv-cache-memory SIZE or --num-blocks N"),
        (["serve", "--trust-remote-code", "m"], "no model code is loaded"),
        (["serve", "--enable-prefix-caching"], "here it is the --prefix-caching switch"),
        (["serve", "--enable-auto-tool-choice"], "tool_choice auto is always on"),
        (["up", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_flags_without_a_meaning_here_are_refused_with_the_commands_usage(argv, why, capsys):
    from pdserve.cli import parse

    with pytest.raises(SystemExit) as exit_:
        parse(argv, {})
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: pdserve {argv[0]} "), err  # not the top-level usage
    assert f"pdserve {argv[0]}: error: " in err and why in err, err
