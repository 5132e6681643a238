"""The pins' one owner (``TensorBlockSource``): pins keyed by handle, the engine's blocks freed
exactly once per pin, and abort-all through the readers' counts."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.source import TensorBlockSource, pin_key


def _owner(freed: list[str]) -> TensorBlockSource:
    return TensorBlockSource(torch.zeros(8, 2, 4), lease_seconds=30, on_unpin=freed.append)


def test_each_pin_has_a_handle_of_its_own_and_frees_its_request_once() -> None:
    freed: list[str] = []
    owner = _owner(freed)
    first, second = pin_key("r"), pin_key("r")
    assert first != second and first.startswith("r@")
    owner.pin(first, [0, 1], with_checksums=False, request_id="r")
    with pytest.raises(ValueError):
        owner.pin(first, [2], with_checksums=False, request_id="r")
    assert owner.release(first) and freed == ["r"]
    owner.pin(second, [2, 3], with_checksums=False, request_id="r")
    assert not owner.release(first) and not owner.renew_lease(first)  # a late one: no effect
    assert owner.is_pinned(second) and freed == ["r"]
    assert owner.release(second) and not owner.release(second) and freed == ["r", "r"]


def test_abort_all_waits_for_the_readers() -> None:
    freed: list[str] = []
    owner = _owner(freed)
    owner.pin("a@1", [0, 1], with_checksums=False, request_id="a")
    owner.pin("b@1", [2, 3], with_checksums=False, request_id="b")
    with owner.reading("b@1", [2]):
        assert owner.num_readers == 1
        assert sorted(owner.release_all()) == ["a@1", "b@1"]
        assert freed == ["a"]  # "b" is read: going, not freed
        assert owner.holds("b@1") and not owner.is_pinned("b@1")
        with pytest.raises(KeyError):  # no new read starts on a pin that is going
            owner.read_blocks("b@1", [2])
        assert owner.release_all() == [] and not owner.release("b@1")
    assert freed == ["a", "b"] and owner.num_readers == 0 and not owner.holds("b@1")
