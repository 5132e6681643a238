"""The hand-off at every prompt length: a pulled request's KV is, bit for bit, the KV the decode
side computes itself, and its greedy tokens are a local run's, for every length from 1 to three
blocks + 1, for random lengths up to 2,048, for n in {1, 2, 3}, with the first token coming
before the pull (``Prefill``) or with its last part (``PrefillStream``), and on a second pass
that meets the decode side's prefix cache. The transports move these same bytes (their own
equality is tests/services/test_kv_equivalence.py); what is proven here is the engine's part:
how many tokens are reserved, pulled and marked computed. A request whose prompt length was one
more than a multiple of the block size decoded from a stale slot before that was one rule.

In process, float32, three engines with the same chunking (``CHUNK``): ``local`` computes
each prompt itself (the reference), ``prefill`` pins it, ``decode`` pulls it (blocks copied out
of the prefill engine's cache, as a transport would).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from common.settings import from_fields
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from tests.conftest import assert_no_leaks

BLOCK = 16  # the default block size, asserted below
CHUNK = 40  # prompt tokens a step: chunks end inside blocks, as any budget may
MAX_TOKENS = 3
MODES = ("first-token-first", "first-token-last")  # Prefill / PrefillStream


@dataclass
class Engines:
    local: LLMEngine
    prefill: LLMEngine
    decode: LLMEngine


def _engine(prefix_caching: bool) -> LLMEngine:
    config = from_fields(
        EngineConfig,
        num_threads=2,
        num_blocks=420,  # a 2,048-token prompt, three times over
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=CHUNK,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    trio = Engines(_engine(False), _engine(False), _engine(True))
    assert trio.decode.pool.block_size == BLOCK
    yield trio
    for engine in (trio.local, trio.prefill, trio.decode):
        assert_no_leaks(engine)


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(length: int, salt: int) -> list[int]:
    generator = torch.Generator().manual_seed(length * 7919 + salt)
    return torch.randint(100, 40_000, (length,), generator=generator).tolist()


def _slots(engine: LLMEngine, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The KV of the first ``num_tokens`` token slots of ``block_ids``, all layers:
    [num_tokens, layers, 2, kv_heads, head_dim]."""
    blocks = engine.kv_cache[torch.tensor(block_ids, dtype=torch.long)]
    tokens = blocks.permute(0, 4, 1, 2, 3, 5)  # [blocks, block_size, layers, 2, heads, dim]
    return tokens.reshape(-1, *tokens.shape[2:])[:num_tokens].clone()


def _step_until(  # type: ignore[no-untyped-def]
    engine: LLMEngine, request_id: str, done, merged: RequestOutput | None = None
) -> RequestOutput:
    """Step until ``done(merged output)``; the output merged so far (onto ``merged``)."""
    for _ in range(1000):
        for out in engine.step():
            if out.request_id == request_id:
                if merged is None:
                    merged = out
                else:
                    merged.merge(out)
        if merged is not None and done(merged):
            return merged
    raise AssertionError(f"{request_id} never got there")


def _local(engines: Engines, rid: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The reference: greedy tokens of the engine computing the prompt itself, and its KV as
    it stood right after the prompt was computed."""
    engine = engines.local
    engine.add_request(rid, prompt, _params())
    [seq] = engine.sequences(rid)
    out = _step_until(engine, rid, lambda out: out.outputs[0].token_ids)
    kv = _slots(engine, seq.block_table, len(prompt))
    out = _step_until(engine, rid, lambda out: out.finished, out)
    return out.outputs[0].token_ids, kv


def _pinned(engines: Engines, rid: str, prompt: list[int]) -> tuple[int, list[int]]:
    """The prefill engine's first token and the blocks it pinned for the prompt."""
    out = _step_until_pinned(engines.prefill, rid, prompt)
    assert out.kv_block_ids is not None
    return out.outputs[0].token_ids[0], out.kv_block_ids


def _step_until_pinned(engine: LLMEngine, rid: str, prompt: list[int]) -> RequestOutput:
    engine.add_request(rid, prompt, _params(), pin_blocks=True)
    return _step_until(engine, rid, lambda out: out.kv_block_ids is not None)


@dataclass
class Case:
    """One way of handing the prompt over: ``n`` and when the first token comes."""

    request_id: str
    n: int
    mode: str
    tokens: list[list[int]] | None = None  # each sequence's, the first token included
    kv: torch.Tensor | None = None  # the prompt's KV as it stood after the first step here


def _pull_all(
    engines: Engines, prompt: list[int], first: int, source: list[int], cases: list[Case]
) -> None:
    """The decode engine takes every case's request at once, with its KV pulled (blocks copied
    from the prefill engine's, as a transport would) and the first token given at the case's
    moment; all of them are admitted in one step, so none meets another's blocks."""
    decode = engines.decode
    for case in cases:
        early = first if case.mode == "first-token-first" else None
        assert decode.add_prefilled_request(case.request_id, prompt, early, _params(case.n)) is None
    decode.step()
    plans = {p.request_id: p for p in decode.take_pull_plans()}
    assert len(plans) == len(cases), "not all admitted at once: the pool is too small"
    for case in cases:
        plan = plans[case.request_id]
        ids = torch.tensor([source[i] for i in plan.block_indices], dtype=torch.long)
        blocks = engines.prefill.kv_cache[ids]
        late = first if case.mode == "first-token-last" else None
        assert decode.commit_pull(plan, blocks.clone(), late) is None
    outputs = {o.request_id: o for o in decode.step()}  # each case's first step here
    for case in cases:
        case.kv = _slots(decode, decode.sequences(case.request_id)[0].block_table, len(prompt))
    for _ in range(MAX_TOKENS + 2):
        for out in decode.step():
            if out.request_id in outputs:
                outputs[out.request_id].merge(out)
            else:
                outputs[out.request_id] = out
    assert not decode.has_unfinished_requests()
    for case in cases:
        tokens = {o.index: o.token_ids for o in outputs[case.request_id].outputs}
        tokens[0] = [first, *tokens[0]]  # the decode side streams what follows the first token
        case.tokens = [tokens[i] for i in range(case.n)]


def _check_length(engines: Engines, length: int, salt: int) -> None:
    prompt = _prompt(length, salt)
    rid = f"len{length}-{salt}"
    want_tokens, want_kv = _local(engines, f"{rid}-local", prompt)
    first, source = _pinned(engines, f"{rid}-prefill", prompt)
    assert first == want_tokens[0]
    ways = [(n, mode) for n in (1, 2, 3) for mode in MODES]
    # As many ways at once as half the decode pool holds (a 2,048-token prompt: two).
    at_once = max(1, engines.decode.pool.num_blocks // 2 // len(source))
    try:
        for start in range(0, len(ways), at_once):
            engines.decode.pool.reset_prefix_cache()  # pass 1 meets no cached block
            for pass_ in (1, 2):  # pass 2 meets pass 1's blocks in the decode side's prefix cache
                cases = [
                    Case(f"{rid}-n{n}-{mode}-pass{pass_}", n, mode)
                    for n, mode in ways[start : start + at_once]
                ]
                _pull_all(engines, prompt, first, source, cases)
                _check_cases(cases, length, want_tokens, want_kv)
    finally:
        assert engines.prefill.release_pinned(f"{rid}-prefill")
    for engine in (engines.local, engines.prefill, engines.decode):
        assert_no_leaks(engine)


def _check_cases(
    cases: list[Case], length: int, want_tokens: list[int], want_kv: torch.Tensor
) -> None:
    for case in cases:
        assert case.tokens == [want_tokens] * case.n, case.request_id
        assert case.kv is not None
        # With n > 1 the last prompt token is computed here, in a step of its own: the
        # same math in another batch shape, equal but for float32 rounding.
        exact = length if case.n == 1 else length - 1
        assert torch.equal(case.kv[:exact], want_kv[:exact]), f"{case.request_id}: KV"
        torch.testing.assert_close(case.kv, want_kv, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("length", range(1, 3 * BLOCK + 2))
def test_every_length_up_to_three_blocks_and_one(engines: Engines, length: int) -> None:
    _check_length(engines, length, salt=0)


@settings(
    max_examples=1,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(length=st.integers(min_value=3 * BLOCK + 2, max_value=2048), salt=st.integers(1, 10**6))
@example(length=2048, salt=1)
@example(length=16 * BLOCK + 1, salt=2)
def test_random_lengths_up_to_2048(engines: Engines, length: int, salt: int) -> None:
    _check_length(engines, length, salt)
