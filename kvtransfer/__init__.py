"""KV cache transfer between prefill and decode workers: one interface, three transports.

``make_server(transport, source, layout, token=...)`` on the prefill side,
``make_client(transport, token=...)`` on the decode side; ``transport`` is one of

- ``"ucx"``: UCX through ``ucxx`` (extra ``pdserve[ucx]``); cuda_ipc / RDMA for GPU memory,
  tcp for host memory. The default for GPU KV caches when installed.
- ``"torch"``: ``torch.distributed`` point-to-point in 2-rank groups (gloo on CPU, NCCL on CUDA).
- ``"tcp"``: asyncio sockets, zero-copy send; no extra dependency, always available. The
  default for host-memory KV caches (the fastest of the three there).
- ``"shm"``: same-host peers only: the decode side copies pinned rows straight out of the
  prefill worker's KV cache, kept in a shared-memory file; the control exchange is tcp's.

See :mod:`kvtransfer.base` for the contract (states, errors, checksums, layout adapter).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

from kvtransfer.base import (
    FAILURE_REASONS,
    BlockRowSource,
    BlockSource,
    ChecksumError,
    KVLayout,
    KVTransferClient,
    KVTransferServer,
    TransferError,
    TransferState,
    TransferStats,
    adapt_layout,
    block_checksums,
    verify_checksums,
)
from kvtransfer.faults import KVFaults
from kvtransfer.metrics import TransferMetrics
from kvtransfer.source import TensorBlockSource

TRANSPORTS = ("ucx", "torch", "tcp", "shm")

__all__ = [
    "FAILURE_REASONS",
    "TRANSPORTS",
    "BlockRowSource",
    "BlockSource",
    "ChecksumError",
    "KVLayout",
    "KVTransferClient",
    "KVFaults",
    "KVTransferServer",
    "TensorBlockSource",
    "TransferError",
    "TransferMetrics",
    "TransferState",
    "TransferStats",
    "adapt_layout",
    "available_transports",
    "block_checksums",
    "default_transport",
    "make_client",
    "make_server",
    "verify_checksums",
]


@functools.cache
def available_transports() -> tuple[str, ...]:
    """The transports that can run in this process, best first."""
    found = []
    if importlib.util.find_spec("ucxx") is not None:
        from kvtransfer import ucx

        if ucx.ucx_import_error() is None:
            found.append("ucx")
    import torch.distributed as dist

    if dist.is_available() and (dist.is_gloo_available() or dist.is_nccl_available()):
        found.append("torch")
    found.append("tcp")
    if os.path.isdir("/dev/shm"):
        found.append("shm")  # same-host peers only
    return tuple(found)


def default_transport(device: str = "cpu") -> str:
    """The best transport here for KV caches on ``device``.

    Host memory: ``tcp`` (zero-copy send; measured fastest on CPU hosts, see
    ``benchmarks/kv_transfer.py``: ucx only has tcp/lo there, gloo gathers first). GPU
    memory: ``ucx`` when installed (cuda_ipc / RDMA), else ``torch`` (NCCL).
    """
    if not device.startswith("cuda"):
        return "tcp"
    return "ucx" if "ucx" in available_transports() else "torch"


def _classes(transport: str) -> tuple[type[KVTransferServer], type[KVTransferClient]]:
    if transport == "tcp":
        from kvtransfer.tcp import TcpKVClient, TcpKVServer

        return TcpKVServer, TcpKVClient
    if transport == "torch":
        from kvtransfer.torch_dist import TorchKVClient, TorchKVServer

        return TorchKVServer, TorchKVClient
    if transport == "shm":
        from kvtransfer.shm import ShmKVClient, ShmKVServer

        return ShmKVServer, ShmKVClient
    if transport == "ucx":
        from kvtransfer.ucx import UcxKVClient, UcxKVServer

        return UcxKVServer, UcxKVClient
    raise ValueError(f"unknown KV transport {transport!r}; choose one of {TRANSPORTS}")


def make_server(
    transport: str,
    source: BlockSource,
    layout: KVLayout,
    token: str | None = None,
    **options: Any,
) -> KVTransferServer:
    """The prefill-side server of ``transport``; ``options`` go to its constructor."""
    server_cls, _ = _classes(transport)
    return server_cls(source, layout, token, **options)  # type: ignore[call-arg]


def make_client(transport: str, token: str | None = None, **options: Any) -> KVTransferClient:
    """The decode-side client of ``transport``; ``options`` go to its constructor."""
    _, client_cls = _classes(transport)
    return client_cls(token, **options)  # type: ignore[call-arg]
