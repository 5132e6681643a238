"""A seeded request gives the same tokens on every route its prompt can take: computed by the
engine that decodes (local), pulled after the prefill with the first token, pulled whole with the
first token coming with the blocks (streamed style), or recomputed after a failed pull.

In-process engines, as in test_handoff: a "prefill" engine computes the prompt and samples the
first token (``pin_blocks``); a "decode" engine is given that token and the pinned blocks, copied
from the prefill engine's KV cache. The decode engine also serves the local route. No prefix
cache, so every pull carries the whole prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.sampling_params import SamplingParams
from common.settings import from_fields
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.conftest import PROMPTS, assert_no_leaks
from tests.engine.test_handoff import admit, run_until_done

ROUTES = ["pulled", "streamed", "recomputed"]
CASES = {  # name -> (prompt, params): temperature 1.0, so every token is a draw
    "n1": (PROMPTS[2], SamplingParams(seed=1234, max_tokens=10, ignore_eos=True)),
    "n1-top_p": (" ".join(PROMPTS), SamplingParams(seed=7, top_p=0.8, max_tokens=10)),
    "n3": (PROMPTS[6], SamplingParams(n=3, seed=-5, max_tokens=8, ignore_eos=True)),
    "n3-top_p": (PROMPTS[7], SamplingParams(n=3, seed=99, top_p=0.9, max_tokens=8)),
}


def new_engine() -> LLMEngine:
    return LLMEngine(
        from_fields(EngineConfig, num_threads=1, num_blocks=64, enable_prefix_caching=False)
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    prefill, decode = new_engine(), new_engine()
    yield prefill, decode
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def local(engine: LLMEngine, request_id: str, ids: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    engine.add_request(request_id, ids, params)
    return [o.token_ids for o in run_until_done(engine, request_id).outputs]


def disaggregated(  # type: ignore[no-untyped-def]
    engines, request_id: str, ids: list[int], params: SamplingParams, route: str
):
    """The tokens of each sequence when the prefill engine samples the first token of sequence
    0 and the decode engine does the rest, its prompt's KV coming by ``route``."""
    p_engine, d_engine = engines
    p_engine.add_request(request_id, ids, SamplingParams(**{**vars(params), "n": 1}), True)
    p_out = run_until_done(p_engine, request_id)
    assert p_out.kv_block_ids is not None
    first = p_out.outputs[0].token_ids[0]
    given = None if route == "streamed" else first
    assert d_engine.add_prefilled_request(request_id, ids, given, params) is None
    plan = admit(d_engine, request_id)
    if route == "recomputed":
        d_engine.recompute_pull(request_id)
    else:
        source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices])
        blocks = p_engine.kv_cache[source].clone()
        assert d_engine.commit_pull(plan, blocks, first if route == "streamed" else None) is None
    assert p_engine.release_pinned(request_id)
    out = run_until_done(d_engine, request_id)
    # Sequence 0's first token was streamed by the prefill worker; the others draw their own.
    return [[first, *out.outputs[0].token_ids]] + [o.token_ids for o in out.outputs[1:]]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(CASES))
def test_seeded_tokens_do_not_depend_on_the_route(engines, case, route):  # type: ignore[no-untyped-def]
    prompt, params = CASES[case]
    p_engine, d_engine = engines
    ids = d_engine.tokenizer.encode(prompt)
    # Lengths 16k+1 hit a separate reservation bug on the streamed path (not this test's).
    assert len(ids) % d_engine.pool.block_size != 1
    want = local(d_engine, f"local-{case}-{route}", ids, params)
    assert len(want) == params.n
    if params.n > 1:
        assert len({tuple(t) for t in want}) > 1, "seeded sequences differ from one another"
    got = disaggregated(engines, f"{route}-{case}", ids, params, route)
    assert got == want
    assert_no_leaks(p_engine)
    assert_no_leaks(d_engine)
