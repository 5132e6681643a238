"""The router's access log and request ids, and errors that name a body's cause, over real HTTP
against real router processes and real workers.

One cluster (1 prefill + 1 decode, every prompt through the prefill worker) and two routers:
one with the default text log, one with ``--log-format json`` and an API key. Each gets three
requests (one refused with 400, one streamed, one not) and must write exactly one access line
for each, with the request's id, client, model, route, tokens, times and status; the id a
client sends in ``X-Request-Id`` comes back, and the workers' line for the request carries it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    spawn_router,
    wait_until,
)

API_KEY = "sk-access-log-secret"
CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


@dataclass
class Stack:
    cluster: Cluster
    text: Router  # the default: --log-format text
    json: Router  # --log-format json --api-key


@pytest.fixture(scope="module")
def stack(pd_pair: Cluster) -> Iterator[Stack]:
    c = pd_pair.with_own_routers()  # the shared prefill and decode workers
    try:
        s = Stack(c, spawn_router(c), spawn_router(c, "--log-format", "json", "--api-key", API_KEY))
        for process in [*c.workers, *c.routers]:
            process.wait_ready()
        s.text.wait_ready(num_workers=2)
        s.json.wait_ready()  # its /v1/workers needs the key
        yield s
        assert wait_until(lambda: all(blocks_in_use(w) == 0 for w in c.workers))
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def post(router: Router, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(router.url + path, content=content, headers=headers, timeout=60)


def access_lines(router: Router, fmt: str) -> list[dict[str, Any]]:
    """The router's access lines so far, as fields ("-" in a text line is None)."""
    lines = router.process.output_tail(200).splitlines()
    if fmt == "json":
        return [json.loads(line) for line in lines if line.startswith("{")]
    found = []
    for line in lines:
        _, marker, rest = line.partition(" router INFO access ")
        if marker:
            pairs = (item.split("=", 1) for item in shlex.split(rest))
            found.append({k: None if v == "-" else v for k, v in pairs})
    return found


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_access_line_per_request(stack: Stack, fmt: str) -> None:
    router = getattr(stack, fmt)
    key = {"Authorization": f"Bearer {API_KEY}"} if fmt == "json" else {}
    json_type = {"Content-Type": "application/json", **key}
    sent_id = f"stream-{fmt}.1:a"

    refused = post(router, CHAT_PATH, {"model": MODEL}, {**json_type, "X-Request-Id": "bad id"})
    assert refused.status_code == 400, refused.text
    refused_id = refused.headers["x-request-id"]
    assert GENERATED_ID.fullmatch(refused_id)  # a header that is no usable id is ignored

    with httpx.stream(
        "POST",
        router.url + CHAT_PATH,
        json={**CHAT, "stream": True},
        headers={**key, "X-Request-Id": sent_id},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-request-id"] == sent_id
        assert "[DONE]" in streamed.read().decode()

    answered = post(router, "/v1/completions", COMPLETION, json_type)
    assert answered.status_code == 200, answered.text
    answered_id = answered.headers["x-request-id"]
    assert GENERATED_ID.fullmatch(answered_id)
    assert answered.json()["id"] == f"cmpl-{answered_id}"  # the response's id carries it
    usage = answered.json()["usage"]

    ids = [refused_id, sent_id, answered_id]

    def mine() -> list[dict[str, Any]]:
        return [line for line in access_lines(router, fmt) if line["request_id"] in ids]

    assert wait_until(lambda: len(mine()) >= 3)
    lines = mine()
    assert [line["request_id"] for line in lines] == ids  # one line each
    client = "key:default" if fmt == "json" else "addr:127.0.0.1"
    assert all(line["client"] == client for line in lines)
    assert API_KEY not in router.process.output_tail(200)  # the client's name, not its key
    first, second, third = lines
    assert (first["status"], first["path"], first["model"], first["route"]) == (
        400 if fmt == "json" else "400",
        CHAT_PATH,
        None,
        None,
    )
    assert first["ttft_ms"] is None and float(first["total_ms"]) >= 0
    for line, path in ((second, CHAT_PATH), (third, "/v1/completions")):
        assert str(line["status"]) == "200" and line["path"] == path and line["method"] == "POST"
        assert line["model"] == MODEL and line["route"] == "pulled"
        assert int(line["prompt_tokens"]) > 0 and 1 <= int(line["output_tokens"]) <= 3
        assert 0 < float(line["ttft_ms"]) <= float(line["total_ms"])
    assert int(third["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(third["output_tokens"]) == usage["completion_tokens"]
    if fmt == "json":
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+\+00:00", first["time"])

    # The workers' line of the streamed request carries the id the client chose.
    prefill, decode = stack.cluster.workers
    for worker in (prefill, decode):
        assert wait_until(lambda w=worker: f"request chatcmpl-{sent_id}-" in w.output_tail(200))
    line = next(x for x in decode.output_tail(200).splitlines() if f"chatcmpl-{sent_id}-" in x)
    assert re.search(r" done: pulled KV, \d+ prompt \+ \d+ output tokens, \d+ ms$", line), line


def test_a_client_that_leaves_a_stream_is_a_499(stack: Stack) -> None:
    """Its answer started with 200; the line says the client left."""
    body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.text.url + "/v1/completions", json=body, timeout=60) as left:
        # Two tokens, so the second came from the decode worker: leaving after the prefill
        # worker's first one could cancel the decode call before that worker ever logged it.
        events = (line for line in left.iter_lines() if line.startswith("data: "))
        next(events), next(events)  # then the connection closes
        request_id = left.headers["x-request-id"]

    def line() -> dict[str, Any] | None:
        found = [x for x in access_lines(stack.text, "text") if x["request_id"] == request_id]
        return found[0] if found else None

    assert wait_until(lambda: line() is not None)
    entry = line()
    assert entry is not None and entry["status"] == "499" and int(entry["output_tokens"]) < 200
    decode = stack.cluster.workers[1]
    mark = f"request cmpl-{request_id}-0"
    assert wait_until(lambda: mark in decode.output_tail(200))
    ended = next(x for x in decode.output_tail(200).splitlines() if mark in x)
    assert " cancelled: " in ended, ended


# -- errors that name the body's cause --------------------------------------------------------

NOT_JSON = "the request body must be JSON sent with 'Content-Type: application/json'"


@pytest.mark.parametrize(
    "headers, body, message",
    [
        ({}, json.dumps(CHAT).encode(), f"{NOT_JSON} (this request has no Content-Type)"),
        (
            {"Content-Type": "application/x-www-form-urlencoded"},  # what curl -d sends
            json.dumps(CHAT).encode(),
            f"{NOT_JSON} (this request has Content-Type 'application/x-www-form-urlencoded')",
        ),
        (
            {"Content-Type": "application/json"},
            b'{"model": "x",\n  "messages": [}',
            "request body is not valid JSON: Expecting value at line 2, column 16",
        ),
        (
            {"Content-Type": "application/json; charset=utf-8"},
            b'{"model": "x", prompt',
            "request body is not valid JSON: Expecting property name enclosed in double quotes "
            "at line 1, column 16",
        ),
        ({"Content-Type": "application/json"}, b"[1, 2]", "the request body must be a JSON object"),
    ],
)
def test_errors_name_the_bodys_cause(stack: Stack, headers, body, message) -> None:  # type: ignore[no-untyped-def]
    answer = post(stack.text, CHAT_PATH, body, headers)
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_the_bodys_request_id_names_a_request_when_no_header_does(stack: Stack) -> None:
    """vLLM's body field ``request_id``: it names the request (response header, response id,
    access line) unless ``X-Request-Id`` does; one that is no usable id is refused."""
    router, json_type = stack.text, {"Content-Type": "application/json"}
    named = post(router, "/v1/completions", {**COMPLETION, "request_id": "body-1.a"}, json_type)
    assert named.status_code == 200, named.text
    assert named.headers["x-request-id"] == "body-1.a"
    assert named.json()["id"] == "cmpl-body-1.a"  # as vLLM's; the workers' ids add a suffix
    both = post(
        router, CHAT_PATH, {**CHAT, "request_id": "body-2"}, {**json_type, "X-Request-Id": "hdr-2"}
    )
    assert both.status_code == 200 and both.headers["x-request-id"] == "hdr-2"  # as vLLM's
    assert both.json()["id"] == "chatcmpl-hdr-2"
    bad = post(router, CHAT_PATH, {**CHAT, "request_id": "two words"}, json_type)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "request_id"
    assert "request_id must be 1 to 128 letters" in bad.json()["error"]["message"]
    assert GENERATED_ID.fullmatch(bad.headers["x-request-id"])

    def named_lines() -> list[dict[str, Any]]:
        wanted = ("body-1.a", "hdr-2")
        return [line for line in access_lines(router, "text") if line["request_id"] in wanted]

    assert wait_until(lambda: len(named_lines()) == 2)
    assert all(line["status"] == "200" for line in named_lines())
