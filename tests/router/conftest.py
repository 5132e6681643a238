"""The gateway tests' shared prefill + decode pair: starting one costs ~20 s on 2 cores, and
most modules here need nothing else of their workers. Each module puts its own routers in front
of it (``pd_pair.with_own_routers()``) and checks at its end that every KV block is back: the
next module starts from the same baseline. The pair stops once the last gateway test is done
(not at the end of the session: other directories start workers of their own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.cluster import Cluster

SHARED = pytest.StashKey[Cluster]()
LAST = pytest.StashKey[pytest.Item]()
HERE = __file__.rpartition("/")[0] + "/"


@pytest.fixture(scope="session")
def pd_pair(redis_server, request: pytest.FixtureRequest) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """One prefill and one decode worker (``SMALL``) under a prefix of their own."""
    pair = Cluster(redis_server.url)
    request.config.stash[SHARED] = pair
    try:
        pair.add_workers("prefill", "decode")
        yield pair
    except BaseException:
        pair.dump()
        raise
    finally:
        pair.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Stop the pair after the session's last gateway test (and its module's own checks). This
    assumes one process runs the session's items in order: under pytest-xdist a process may run
    the last one before its other router modules, which then find no workers (tried: -n 2 took
    the suite from 29 to 23 min on 2 cores, with four such errors; with the pair kept to the end
    under xdist, a worker process went down twice and the run hung at 98%). Tried again on
    2026-11-28 (22-23 min one at a time): ``-n 2 --dist loadfile`` with the timing tests after
    it alone took 13.5 + 6 min, but memory peaked at 22.9 of 24 GiB (two test processes of ~5
    GiB beside up to eight 1.3 GiB workers: the OOM killer took one in the first try), and one
    run hit the errors above; this folder as one xdist group made the first part 19 min. Once
    more on 2026-11-29 (Zen 4): ``-n 2 --dist loadfile`` 18:57 against 23:43 one at a time, with
    29 errors, all of them router modules that found the pair stopped."""
    yield
    pair = item.config.stash.get(SHARED, None)
    if pair is None:
        return
    if LAST not in item.config.stash:
        mine = [i for i in item.session.items if str(i.path).startswith(HERE)]
        item.config.stash[LAST] = mine[-1]
    if item is item.config.stash[LAST]:
        pair.stop()
