"""The model options a `vllm serve` user gives the router, over real HTTP.

``generation_config.json``: the model's sampling defaults for requests that leave them out, as
``vllm serve`` applies them, and ``--generation-config vllm`` turning them off. The module is
checked on its own (which file, which fields, what a request keeps), then live: one colocated
worker and routers given a generation config of greedy sampling and a 6-token cap, or
``--generation-config vllm``. A request without a temperature must then answer, token for token,
what an explicit ``temperature: 0`` answers on the first, and sample (a different text, same
seed) on the second. ``--chat-template`` (a template given as text), ``--tokenizer`` (a
directory with the model's tokenizer) and ``--served-model-name`` are served by three more
routers on the same worker.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from router.generation_defaults import GenerationDefaults, load_generation_defaults
from router.protocol import ChatCompletionRequest
from services.engine.config import EngineConfig
from services.engine.model.source import resolve_model_dir
from tests.router.cluster import MODEL, Cluster, Router

CHAT = [{"role": "user", "content": "Write a short story about a dragon."}]
CAP = 6  # the generation config's max_new_tokens


def write_config(folder: Path, config: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": CHAT, **fields})


def test_auto_reads_the_model_directory_and_vllm_reads_nothing(tmp_path: Path) -> None:
    model_dir = write_config(
        tmp_path / "model",
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_new_tokens": 99},
    )
    auto = load_generation_defaults("auto", model_dir)
    assert auto == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=99)
    assert load_generation_defaults("vllm", model_dir) == GenerationDefaults()
    # a model without the file (the default GGUF's conversion) has no defaults
    assert load_generation_defaults("auto", tmp_path) == GenerationDefaults()
    other = write_config(tmp_path / "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    assert load_generation_defaults(str(other), model_dir) == GenerationDefaults(
        min_p=0.05, repetition_penalty=1.1
    )


def test_a_named_directory_without_the_file_or_a_bad_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path), tmp_path)
    write_config(tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults("auto", tmp_path)


def test_defaults_fill_only_what_the_request_left_out() -> None:
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=10)
    filled = defaults.apply(chat(top_p=1.0, temperature=0))
    assert (filled.temperature, filled.top_p, filled.top_k) == (0, 1.0, 20)  # 0 is a value
    params = filled.sampling_params(max_tokens=5, logprobs=None)
    assert (params.temperature, params.top_p, params.top_k) == (0, 1.0, 20)
    assert defaults.apply(chat()).temperature == 0.6
    assert GenerationDefaults().apply(chat()).temperature is None  # OpenAI's 1.0 follows
    assert [defaults.cap_max_tokens(n) for n in (5, 10, 500)] == [5, 10, 10]


TEMPLATE = "{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}"


@dataclass
class Routers:
    model_defaults: Router  # --generation-config DIR: greedy, CAP tokens at most
    off: Router  # --generation-config vllm
    template: Router  # --chat-template TEMPLATE
    tokenizer: Router  # --tokenizer DIR (a copy of the model's tokenizer files)
    named: Router  # --served-model-name chat


@pytest.fixture(scope="module")
def routers(redis_server, tmp_path_factory) -> Iterator[Routers]:  # type: ignore[no-untyped-def]
    folder = write_config(
        tmp_path_factory.mktemp("genconfig"), {"temperature": 0.0, "max_new_tokens": CAP}
    )
    model_dir = resolve_model_dir(None, EngineConfig().cache_path)
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tokenizer / name)
    c = Cluster(redis_server.url)
    try:
        c.add_workers("colocated")
        found = Routers(
            model_defaults=c.add_router("--generation-config", str(folder)),
            off=c.add_router("--generation-config", "vllm"),
            template=c.add_router("--chat-template", TEMPLATE),
            tokenizer=c.add_router("--tokenizer", str(tokenizer)),
            named=c.add_router("--served-model-name", "chat"),
        )
        for router in (found.model_defaults, found.off, found.template, found.tokenizer):
            router.wait_ready(num_workers=1)
        found.named.wait_ready(num_workers=1)
        yield found
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def test_a_request_without_temperature_gets_the_models(routers: Routers) -> None:
    client = routers.model_defaults.client()
    left_out = client.chat.completions.create(model=MODEL, messages=CHAT, seed=3)
    greedy = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=CAP
    )
    assert left_out.usage.completion_tokens == CAP  # max_new_tokens caps it
    assert left_out.choices[0].finish_reason == "length"
    assert left_out.choices[0].message.content == greedy.choices[0].message.content
    # the cap holds for a request that asks for more, as in vLLM
    longer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
    assert longer.usage.completion_tokens == CAP

    sampled = routers.off.client().chat.completions.create(
        model=MODEL, messages=CHAT, seed=3, max_tokens=CAP
    )
    assert sampled.usage.completion_tokens == CAP
    assert sampled.choices[0].message.content != greedy.choices[0].message.content


def test_a_chat_template_given_as_text_renders_the_prompt(routers: Routers) -> None:
    client = routers.template.client()
    question = "What is the capital of France?"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8
    )
    plain = client.completions.create(
        model=MODEL, prompt=f"Q: {question}\nA:", temperature=0, max_tokens=8
    )
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    assert chat.choices[0].message.content == plain.choices[0].text


def test_a_tokenizer_directory_of_the_same_tokenizer_serves(routers: Routers) -> None:
    reply = routers.tokenizer.client().chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=4
    )
    assert reply.usage.completion_tokens == 4


def test_the_served_model_name_is_the_one_the_api_knows(routers: Routers) -> None:
    client = routers.named.client()
    assert [m.id for m in client.models.list().data] == ["chat"]
    reply = client.chat.completions.create(model="chat", messages=CHAT, max_tokens=2)
    assert reply.model == "chat" and reply.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
