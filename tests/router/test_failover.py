"""Workers dying under the router, on real processes: before a request has output from a
worker, the router moves it to another worker of the pool; after the client got tokens from a
decode worker that dies, the stream ends with an error event, and nothing stays pinned."""

from __future__ import annotations

import re
import threading
import urllib.request

import openai
import pytest

from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, cluster, wait_until


def retries(router: Router, pool: str) -> float:
    text = urllib.request.urlopen(router.url + "/metrics", timeout=5).read().decode()
    pattern = rf'^pdserve_router_retries_total\{{pool="{pool}",reason="\w+"\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_dead_workers_are_routed_around_and_a_mid_stream_death_is_an_error_event(redis_server):  # type: ignore[no-untyped-def]
    roles = ("prefill", "prefill", "decode", "decode")
    policies = ("--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    with cluster(redis_server.url, roles, *policies) as (c, router):
        prefills, decodes = c.workers[:2], c.workers[2:]
        client = router.client(timeout=60)

        stream = client.completions.create(
            model=MODEL,
            prompt="Tell me a story.",
            max_tokens=500,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        (serving,) = [d for d in decodes if blocks_in_use(d) > 0]
        serving.kill()
        with pytest.raises(openai.APIError, match="decode worker failed mid-stream"):
            for _ in chunks:
                pass

        # The dead decode worker and a freshly killed prefill worker stay in the registry for
        # up to a TTL (2 s here): requests routed to them move on to the live ones.
        prefills[0].kill()
        for i in range(6):
            response = client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=3)
            assert response.choices[0].finish_reason == "length"
        assert retries(router, "prefill") >= 1
        assert retries(router, "decode") >= 1

        survivors = [w for w in c.workers if w.is_alive()]
        assert len(survivors) == 2
        assert wait_until(lambda: all(blocks_in_use(w) == 0 for w in survivors), timeout=15)
        assert wait_until(lambda: router.num_healthy() == 2, timeout=10)


def test_a_prefill_worker_killed_while_streaming_kv_is_replaced(redis_server):  # type: ignore[no-untyped-def]
    """Both prefill workers compute 16 tokens a step, so a long prompt streams for seconds. The
    one serving it is killed mid-stream: the router cancels the decode call (its reservation is
    freed) and runs the request again on the other prefill worker; the client gets a whole
    answer and no block stays held."""
    c = Cluster(redis_server.url)
    try:
        prefills = c.add_workers("prefill", "prefill", extra=("--max-num-batched-tokens", "16"))
        (decode,) = c.add_workers("decode")
        router = c.add_router("--disaggregation", "always", "--prefill-policy", "round_robin")
        router.wait_ready(num_workers=3)
        client = router.client(timeout=120)
        prompt = "Each prefill step computes sixteen tokens of this prompt. " * 60  # ~700 tokens
        result: dict[str, object] = {}

        def send() -> None:
            try:
                result["response"] = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=4, temperature=0
                )
            except Exception as exc:  # reported by the assertion below
                result["error"] = exc

        thread = threading.Thread(target=send)
        thread.start()
        assert wait_until(lambda: any(blocks_in_use(p) > 0 for p in prefills), timeout=30)
        (serving,) = [p for p in prefills if blocks_in_use(p) > 0]
        serving.kill()
        thread.join(timeout=120)
        assert "error" not in result, result.get("error")
        response = result["response"]
        assert response.usage.completion_tokens == 4  # type: ignore[attr-defined]
        assert retries(router, "prefill") >= 1
        survivors = [w for w in c.workers if w.is_alive()]
        assert wait_until(lambda: all(blocks_in_use(w) == 0 for w in survivors), timeout=15)
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()
