"""The router's side of "ABORTED: ask again with the first token", for real: a prefill worker
whose every served pull is dropped (``--kv-faults drop=1``), a lease shorter than its prefill
(``--lease-seconds 1``), the default streamed hand-off. The decode worker's streamed pull fails
before the first token, it answers ABORTED and leaves the handle pinned; the router, holding
the handle while it waits for the first token, renews its lease, so the prefill is not aborted;
then it asks the same decode worker again with the first token, which computes the prompt. The
client gets the offline engine's text and no block is left behind."""

from __future__ import annotations

from pdserve import SamplingParams
from tests.router.cluster import MODEL, Cluster, blocks_in_use, wait_until

PROMPT = [(11 * i) % 30_000 + 100 for i in range(961)]  # 16k+1 tokens, 61 chunks of 16: seconds


def test_aborted_decode_is_asked_again_while_the_router_keeps_the_lease(redis_server, llm):  # type: ignore[no-untyped-def]
    c = Cluster(redis_server.url)
    try:
        short_lease = ("--lease-seconds", "1", "--max-num-batched-tokens", "16")
        [prefill] = c.add_workers("prefill", extra=(*short_lease, "--kv-faults", "drop=1"))
        [decode] = c.add_workers("decode")
        router = c.add_router()
        router.wait_ready(num_workers=2)
        response = router.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        [want] = llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        )
        assert response.choices[0].text == want.outputs[0].text
        assert router.metric("pdserve_router_retries_total", 'pool="decode",reason="aborted"') >= 1
        for worker in (prefill, decode):
            assert wait_until(lambda w=worker: blocks_in_use(w) == 0), f"{worker.role} leaked"
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()
