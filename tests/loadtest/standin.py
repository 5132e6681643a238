"""A stand-in OpenAI server whose timings are known, for testing the load-test tool.

Each request waits for one of ``capacity`` slots (the server's concurrency), then streams
``max_tokens`` tokens: the first ``ttft`` seconds after it got its slot, the others ``itl``
seconds apart (to absolute deadlines, so sleep overshoot does not accumulate). Service time is
therefore ``ttft + (max_tokens - 1) * itl`` and the throughput limit ``capacity / service``.

Run as a real HTTP server (uvicorn) in a child process, so its event loop and the client's do
not share a core and a GIL: ``with standin(ttft=0.02, itl=0.005, capacity=4) as url: ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MODEL = "standin-model"


@dataclass
class StandinConfig:
    ttft: float = 0.02
    itl: float = 0.005
    capacity: int = 1000
    fail_every: int = 0  # every n-th request answers 500 (0: never)
    token: str = " tok"
    check_model: bool = False  # answer 404 (OpenAI's message) for any model but MODEL


def make_app(cfg: StandinConfig):  # type: ignore[no-untyped-def]
    """The ASGI app (Starlette): /v1/completions, /v1/chat/completions, /v1/models."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    slots = asyncio.Semaphore(cfg.capacity)
    counter = {"n": 0}

    def envelope(chat: bool, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if chat else "text_completion"
        return {"id": "cmpl-standin", "object": kind, "created": int(time.time()),
                "model": MODEL, "choices": choices}  # fmt: skip

    def choice(chat: bool, text: str, finish: str | None) -> dict:
        body = {"delta": {"content": text}} if chat else {"text": text}
        return {"index": 0, **body, "finish_reason": finish}

    async def until(deadline: float) -> None:
        delay = deadline - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def generate(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        counter["n"] += 1
        if cfg.check_model and body.get("model") != MODEL:
            message = f"The model `{body.get('model')}` does not exist."
            error = {"message": message, "type": "NotFoundError", "code": 404}
            return JSONResponse({"error": error}, status_code=404)
        if cfg.fail_every and counter["n"] % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n = int(body.get("max_tokens") or 16)
        if chat:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            text = str(body["prompt"])
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": n,
                 "total_tokens": len(text.split()) + n}  # fmt: skip

        if not body.get("stream"):
            async with slots:
                start = time.perf_counter()
                await until(start + cfg.ttft + (n - 1) * cfg.itl)
            answer = cfg.token * n
            message = (
                {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
            )
            payload = envelope(chat, [{"index": 0, **message, "finish_reason": "length"}])
            return JSONResponse({**payload, "usage": usage})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            async with slots:
                start = time.perf_counter()
                if chat:  # OpenAI opens a chat stream with an empty role-only delta
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield sse(envelope(chat, [{**role, "finish_reason": None}]))
                for i in range(n):
                    await until(start + cfg.ttft + i * cfg.itl)
                    finish = "length" if i == n - 1 else None
                    yield sse(envelope(chat, [choice(chat, cfg.token, finish)]))
            if include_usage:
                yield sse({**envelope(chat, []), "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@contextmanager
def standin(
    ttft: float = 0.02,
    itl: float = 0.005,
    capacity: int = 1000,
    fail_every: int = 0,
    check_model: bool = False,
) -> Iterator[str]:
    """The server in a child process; yields its base URL and stops it afterwards."""
    args = [sys.executable, str(Path(__file__).resolve()), "--ttft", str(ttft), "--itl", str(itl),
            "--capacity", str(capacity), "--fail-every", str(fail_every)]  # fmt: skip
    if check_model:
        args.append("--check-model")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"stand-in server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timing_sensitive(test: Callable) -> Callable:
    """Run a timing test a second time before failing it: the test machine's two cores are
    shared, and a stall of the whole machine can add tens of ms to every latency in one run.
    A real measurement bug fails both runs."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return test(*args, **kwargs)
        except AssertionError as first:
            print(f"timing assertion failed once, running again: {first}")
            return test(*args, **kwargs)

    return wrapper


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--itl", type=float, default=0.005)
    p.add_argument("--capacity", type=int, default=1000)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--check-model", action="store_true")
    a = p.parse_args()
    cfg = StandinConfig(a.ttft, a.itl, a.capacity, a.fail_every, check_model=a.check_model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(cfg), log_level="warning", access_log=False, backlog=4096)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # announce the port only once requests are served
            await asyncio.sleep(0.01)
        print(f"PORT {sock.getsockname()[1]}", flush=True)
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
