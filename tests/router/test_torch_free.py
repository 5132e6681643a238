"""The router process never loads torch: not when its modules are imported, not while its app
starts and serves. Checked in a fresh interpreter (``sys.modules``) and on a running `pdserve
router` process (its memory maps: a loaded torch maps ``libtorch_cpu``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.router.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]

START_APP = """
import asyncio, sys
from router.app import create_app
from router.config import RouterConfig
from router.gateway import Gateway, ModelInfo

async def main():
    config = RouterConfig(redis_url=sys.argv[1], insecure=True)
    app = create_app(Gateway(config, ModelInfo.load(config)))
    async with app.router.lifespan_context(app):
        await asyncio.sleep(0.5)  # the registry watcher and channel pruner run
    assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
    print("torch-free")

asyncio.run(main())
"""


def test_importing_and_starting_the_router_app_never_imports_torch(redis_server):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(START_APP), redis_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch-free"


def test_a_serving_router_process_has_no_torch_mapped(redis_server):
    cluster = Cluster(redis_server.url)
    try:
        router = cluster.add_router()
        status, _ = router.get("/v1/models")
        assert status == 200
        maps = Path(f"/proc/{router.process.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps
    finally:
        cluster.stop()
