"""`pdserve router`: the gateway process (uvicorn serving the FastAPI app).

It binds its socket itself (port 0 picks a free one), or serves on a listening socket it is
handed (``PDSERVE_LISTEN_FD``, below), then prints ``PDSERVE_READY {json}`` with the URL once
uvicorn serves, like the workers do, so launchers and tests know where it is.

SIGINT/SIGTERM drain it (uvicorn's graceful shutdown): it stops accepting, closes its idle
keep-alive connections, answers what is in flight with ``Connection: close`` and exits once those
answers are sent, or after 20 s (what is still open is then cancelled: an LLM stream can take
that long). A second signal stops it at once.

Rolling restarts (`pdserve up`'s SIGUSR1): ``pdserve up`` binds the port itself and hands the
same listening socket to each router it starts (``PDSERVE_LISTEN_FD``, an inherited descriptor).
Two routers on one socket share its accept queue: the replacement accepts as soon as it is ready,
the old one stops accepting (it closes only its own descriptor, the socket stays open) and
drains, and no connection waiting in the queue is dropped, unlike two sockets bound with
SO_REUSEPORT, where closing one listener resets the connections queued on it. What remains is
HTTP/1.1's own race: an idle keep-alive connection closed just as the client writes its next
request on it, which the client sees as a closed connection and may retry (the openai client
does); the test and the measurements in docs/reliability.md never saw it happen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import uvicorn
from prometheus_client import disable_created_metrics

from common.ready import announce_ready
from common.tracing import setup_tracing
from common.wire import check_cluster_token
from router.app import create_app
from router.config import RouterConfig
from router.gateway import Gateway, ModelInfo

log = logging.getLogger(__name__)

LISTEN_FD_ENV = "PDSERVE_LISTEN_FD"  # an inherited listening socket to serve on instead


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ValueError (a one-line message from the CLI) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it Nagle + delayed ACK hold each response body back ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def listening_socket(config: RouterConfig) -> socket.socket:
    """The socket handed over in ``PDSERVE_LISTEN_FD`` (``--host``/``--port`` then only name
    it), else a new one bound to ``--host``/``--port``."""
    fd = os.environ.pop(LISTEN_FD_ENV, "")
    if not fd:
        return bind(config.host, config.port)
    try:
        sock = socket.socket(fileno=int(fd))  # family, type and protocol read from it
    except (OSError, ValueError) as exc:
        raise ValueError(f"{LISTEN_FD_ENV}={fd}: no socket was handed over ({exc})") from exc
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise ValueError(f"{LISTEN_FD_ENV}={fd}: that socket is not listening")
    sock.setblocking(False)
    return sock


async def serve(config: RouterConfig) -> None:
    sock = listening_socket(config)  # first: a taken port fails before the model loads
    port = sock.getsockname()[1]
    model = ModelInfo.load(config)
    app = create_app(Gateway(config, model))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="asyncio",  # grpc.aio runs on the standard loop
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=20,  # `pdserve up` waits 30 s, compose 25 s
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        url = f"http://{config.host}:{port}"
        info = {"role": "router", "url": url, "port": port, "pid": os.getpid(), "model": model.name}
        announce_ready(info)
        log.info("serving %s at %s", model.name, url)
    await task


def run_router(config: RouterConfig) -> None:
    """Entry point of ``pdserve router``."""
    check_cluster_token(config.cluster_token, config.insecure)
    disable_created_metrics()  # counters' *_created series only double what scrapes show
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    if config.insecure:
        log.warning("--insecure: the workers are called without a cluster token")
    tracer_provider = setup_tracing("pdserve-router", config.trace_file, config.otlp_endpoint)
    try:
        asyncio.run(serve(config))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still queued
