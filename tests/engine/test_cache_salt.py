"""Prefix-cache tenants: a request's ``cache_salt`` goes into its first block's hash, so blocks
computed under one salt are hits only for the same salt, never for another one or for none; in
the block pool, in one engine, and across a prefill -> decode hand-off (the decode worker finds
its own cached prefix under the same salt as the prefill worker)."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.hashing import MAX_CACHE_SALT_CHARS, check_cache_salt, hash_full_blocks
from tests.conftest import assert_no_leaks
from tests.engine.test_block_pool import admit_and_compute, make_seq
from tests.engine.test_handoff import admit, pair, run_until_done  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=4)
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never guess. " * 4


def test_a_salt_changes_every_block_hash_and_only_its_own():
    tokens = list(range(40))
    plain = hash_full_blocks(tokens, 4)
    a = hash_full_blocks(tokens, 4, salt="tenant-a")
    b = hash_full_blocks(tokens, 4, salt="tenant-b")
    assert len(plain) == len(a) == len(b) == 10
    for i in range(10):  # the first block's salt reaches every later block through the chain
        assert len({plain[i], a[i], b[i]}) == 3, i
    assert hash_full_blocks(tokens, 4, salt="tenant-a") == a  # stable across calls
    assert hash_full_blocks(tokens, 4, known=a[:3], salt="tenant-a") == a  # extending is the same
    assert hash_full_blocks(tokens, 4, salt="") != plain  # the engine refuses "", but not equal


def test_the_salt_is_bounded():
    check_cache_salt(None)
    check_cache_salt("x" * MAX_CACHE_SALT_CHARS)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        check_cache_salt("")
    with pytest.raises(ValueError, match=f"at most {MAX_CACHE_SALT_CHARS}"):
        check_cache_salt("x" * (MAX_CACHE_SALT_CHARS + 1))


def salted(tokens: list[int], salt: str | None):  # type: ignore[no-untyped-def]
    seq = make_seq(tokens)
    seq.cache_salt = salt
    return seq


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        ("a", "a", True),
        ("a", "b", False),
        ("a", None, False),
        (None, "a", False),
        (None, None, True),
    ],
)
def test_block_pool_hits_only_under_the_same_salt(first, second, hit):
    pool = BlockPool(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    owner = salted(tokens, first)
    admit_and_compute(pool, owner)
    pool.free(owner)
    other = salted(tokens, second)
    prefix = admit_and_compute(pool, other)
    assert len(prefix) == (3 if hit else 0)
    assert other.num_cached_tokens == (12 if hit else 0)
    pool.free(other)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_a_fork_keeps_its_parents_salt():
    parent = salted([1, 2], "a")
    assert parent.fork(99, 1).cache_salt == "a"


def generate(engine, request_id: str, prompt: str, salt: str | None):  # type: ignore[no-untyped-def]
    engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
    return run_until_done(engine, request_id)


def test_engine_counts_only_the_tenants_own_hits(engine_llm):
    engine = engine_llm.engine
    engine.pool.reset_prefix_cache()
    prompt = SYSTEM + "What is a cat?"
    cold = generate(engine, "s1", prompt, "tenant-a")
    assert cold.num_cached_tokens == 0
    assert generate(engine, "s2", prompt, "tenant-b").num_cached_tokens == 0
    assert generate(engine, "s3", prompt, None).num_cached_tokens == 0
    warm = generate(engine, "s4", prompt, "tenant-a")
    assert warm.num_cached_tokens >= 3 * engine.pool.block_size
    again = generate(engine, "s5", prompt, "tenant-b")  # B's own blocks, from its first request
    assert again.num_cached_tokens == warm.num_cached_tokens
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids  # same text, only isolated
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("s6", prompt, GREEDY, cache_salt="")
    assert_no_leaks(engine)


def salted_handoff(p_engine, d_engine, request_id: str, ids: list[int], salt: str | None):  # type: ignore[no-untyped-def]
    """Prefill under ``salt`` on one engine, pull into the other under the same salt."""
    p_engine.add_request(request_id, ids, GREEDY, pin_blocks=True, cache_salt=salt)
    p_out = run_until_done(p_engine, request_id)
    first = p_out.outputs[0].token_ids[0]
    assert d_engine.add_prefilled_request(request_id, ids, first, GREEDY, None, salt) is None
    plan = admit(d_engine, request_id)
    source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
    d_engine.commit_pull(plan, p_engine.runner.kv_cache[source].clone())
    assert p_engine.release_pinned(request_id)
    out = run_until_done(d_engine, request_id)
    return p_out, plan, [first, *out.outputs[0].token_ids]


def test_decode_side_reuses_only_blocks_pulled_under_the_same_salt(pair):  # noqa: F811
    p_engine, d_engine = pair
    ids = p_engine.tokenizer.encode(SYSTEM + "Here is a list of fruits:")
    p1, cold, tokens = salted_handoff(p_engine, d_engine, "ha", ids, "tenant-a")
    assert p1.num_cached_tokens == 0 and cold.num_cached_tokens == 0
    p2, other, other_tokens = salted_handoff(p_engine, d_engine, "hb", ids, "tenant-b")
    assert p2.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert other.block_indices == cold.block_indices  # B pulled every block again
    p3, warm, warm_tokens = salted_handoff(p_engine, d_engine, "hc", ids, "tenant-a")
    assert p3.num_cached_tokens > 0 and warm.num_cached_tokens > 0
    assert len(warm.block_indices) < len(cold.block_indices)
    assert tokens == other_tokens == warm_tokens  # the pulled KV is right under every salt
