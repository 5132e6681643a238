"""A load-test tool for OpenAI-compatible servers (``pdserve-loadtest``).

It stands alone: it imports only httpx, numpy and tqdm (matplotlib when plotting, ``tokenizers``
when ``--tokenizer`` is given), never pdserve itself, so it can be installed next to any server.
"""

__version__ = "0.1.0"  # loadtest/pyproject.toml reads it from here

from loadtest.arrivals import Schedule
from loadtest.client import ClientConfig, RequestResult, RunOutput, run
from loadtest.datasets import DatasetConfig, Sample, load
from loadtest.metrics import Metrics, compute

__all__ = [
    "ClientConfig",
    "DatasetConfig",
    "Metrics",
    "RequestResult",
    "RunOutput",
    "Sample",
    "__version__",
    "Schedule",
    "compute",
    "load",
    "run",
]
