"""`pdserve router`: the gateway process (uvicorn serving the FastAPI app).

It binds its socket itself (port 0 picks a free one), or serves on a listening socket it is
handed (``PDSERVE_LISTEN_FD``, below), then prints ``PDSERVE_READY {json}`` with the URL once
uvicorn serves, like the workers do, so launchers and tests know where it is.

SIGTERM drains (the first SIGINT too)::

    stop accepting -> every answer from now on says ``Connection: close`` -> wait until no
    connection is left, or none has carried a request for IDLE_SECONDS (at most DRAIN_SECONDS)
    -> uvicorn's own shutdown (closes the idle ones; what is still open 5 s later is cancelled)

Idle keep-alive connections are not closed at once: a client may be writing its next request on
one at that very moment, and a request lost that way is a failed request. Under traffic the
client reuses them within milliseconds, gets ``Connection: close`` with the answer and opens its
next connection to the new router; once they have been idle a second the client has stopped
using them. A second signal stops at once. (uvicorn's own shutdown closes idle connections at
once: a client hammering /v1/models over 16 keep-alive connections through rolling restarts saw
3 requests fail over 3 router replacements that way, none over 6 with this drain.)

Rolling restarts (`pdserve up`'s SIGUSR1): ``pdserve up`` binds the port itself and hands the
same listening socket to each router it starts (``PDSERVE_LISTEN_FD``, an inherited file
descriptor). Two routers on one socket share its accept queue: the replacement accepts as soon
as it is ready, the old one stops accepting (it closes only its own descriptor, the socket stays
open) and drains, and no connection waiting in the queue is dropped, unlike two sockets bound
with SO_REUSEPORT, where closing one listener resets the connections queued on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from types import FrameType

import uvicorn
from prometheus_client import disable_created_metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.heap import freeze_startup_heap
from common.ready import announce_ready
from common.tracing import setup_tracing
from common.wire import check_cluster_token
from router.app import create_app
from router.config import RouterConfig
from router.gateway import Gateway, ModelInfo

log = logging.getLogger(__name__)

LISTEN_FD_ENV = "PDSERVE_LISTEN_FD"  # an inherited listening socket to serve on instead
DRAIN_SECONDS = 15.0  # on SIGTERM: how long open connections may take (`pdserve up` waits 30 s)
IDLE_SECONDS = 1.0  # while draining: no request for this long, the idle connections may close
DRAIN_POLL_SECONDS = 0.1


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


class Drain:
    """What the drain waits for: the requests in flight, and how long since the last one."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.in_flight = 0
        self.last_activity = time.monotonic()

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """Count requests; once draining, answers say ``Connection: close``: the client's next
        request goes to a new connection, so to the router that replaces this one."""

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return

            async def send_closing(message: Message) -> None:
                if message["type"] == "http.response.start" and self.started.is_set():
                    headers = [*message.get("headers", []), (b"connection", b"close")]
                    message = {**message, "headers": headers}
                await send(message)

            self.in_flight += 1
            try:
                await app(scope, receive, send_closing)
            finally:
                self.in_flight -= 1
                self.last_activity = time.monotonic()

        return wrapped

    def done(self, open_connections: int) -> bool:
        """No connection left, or none in use for IDLE_SECONDS (the client has stopped using
        them: under steady traffic an idle connection is reused within milliseconds)."""
        quiet = time.monotonic() - self.last_activity >= IDLE_SECONDS
        return open_connections == 0 or (self.in_flight == 0 and quiet)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop = asyncio.get_running_loop()
        self._drain_asked = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler: the first signal once serving starts the drain."""
        if self._drain_asked or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        self._drain_asked = True
        self._loop.call_soon_threadsafe(self._start_drain)  # a signal handler: just schedule

    def _start_drain(self) -> None:
        for server in self.servers:
            server.close()  # stop accepting; a shared socket stays open for the other router
        self.drain.last_activity = time.monotonic()
        self.drain.started.set()

    async def drain_then_exit(self) -> None:
        """After SIGTERM: wait until the open connections are done with, then shut down."""
        await self.drain.started.wait()
        log.info("draining: no new connections; waiting for the open ones")
        deadline = time.monotonic() + DRAIN_SECONDS
        while not self.drain.done(len(self.server_state.connections)):
            if time.monotonic() > deadline:
                log.warning(
                    "drain: %d request(s) still open after %g s",
                    self.drain.in_flight,
                    DRAIN_SECONDS,
                )
                break
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        self.should_exit = True


async def serve(config: RouterConfig) -> None:
    sock = listening_socket(config)  # first: a taken port fails before the model loads
    port = sock.getsockname()[1]
    model = ModelInfo.load(config)
    drain = Drain()
    app = drain.wrap(create_app(Gateway(config, model)))
    server = DrainingServer(
        uvicorn.Config(
            app,
            loop="asyncio",  # grpc.aio runs on the standard loop
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=5,  # after the drain: what is still open is cancelled
        ),
        drain,
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    draining = asyncio.create_task(server.drain_then_exit())
    task.add_done_callback(lambda _: draining.cancel())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        url = f"http://{config.host}:{port}"
        info = {"role": "router", "url": url, "port": port, "pid": os.getpid(), "model": model.name}
        freeze_startup_heap()
        announce_ready(info)
        log.info("serving %s at %s", model.name, url)
        if model.generation.as_dict():
            log.info("the model's sampling defaults: %s", model.generation.as_dict())
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
