"""A router's listening socket, bound once and handed to each router child started on it.

Shared by `pdserve up` and `pdserve router-keeper`: both bind the router's port themselves and
hand the same socket to every router they start (an inherited descriptor, ``PDSERVE_LISTEN_FD``,
read by `router.server.listening_socket`). Connections wait in that one accept queue while
routers come and go, so a replacement takes over without a refused connection (see
`router.server` on why not SO_REUSEPORT). Imports nothing heavy: the router's modules load torch.
"""

from __future__ import annotations

import socket

from services.worker.launcher import WorkerProcess

LISTEN_FD_ENV = "PDSERVE_LISTEN_FD"  # router.server.LISTEN_FD_ENV (not imported: it loads torch)
ROUTER_STOP_SECONDS = 30.0  # a router's drain (at most 15 s, then uvicorn's 5 s) and its exit


def listen(host: str, port: int) -> socket.socket:
    """The router's listening socket (as `router.server.bind` makes it); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def hand_over(router: WorkerProcess, sock: socket.socket) -> None:
    """Make ``router`` (not started yet) serve on ``sock`` instead of binding its own."""
    router.env[LISTEN_FD_ENV] = str(sock.fileno())
    router.pass_fds = (sock.fileno(),)
