"""services.engine.model.source.file_sha256: a model file's digest, remembered per file identity
in the cache so that a start of a worker or the router does not read a multi-GiB GGUF again."""

from __future__ import annotations

import hashlib
from pathlib import Path

from services.engine.model.source import file_sha256


def test_the_digest_is_remembered_per_file_identity(tmp_path: Path) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"weights" * 1000)
    first = file_sha256(model, cache)
    assert first == hashlib.sha256(model.read_bytes()).hexdigest() == file_sha256(model)
    [memo] = (cache / "models" / "digests").iterdir()
    memo.write_text("f" * 64)  # what is remembered is what is returned: the file is not read
    assert file_sha256(model, cache) == "f" * 64

    model.write_bytes(b"other weights")  # another file at the same path: hashed afresh
    assert file_sha256(model, cache) == hashlib.sha256(b"other weights").hexdigest()


def test_a_damaged_memo_or_a_read_only_cache_only_costs_a_read(tmp_path: Path) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"weights")
    truth = hashlib.sha256(b"weights").hexdigest()
    assert file_sha256(model, cache) == truth
    [memo] = (cache / "models" / "digests").iterdir()
    memo.write_text("not a digest")
    assert file_sha256(model, cache) == truth
    assert memo.read_text() == truth  # written again

    unwritable = tmp_path / "a-file"  # no directory can be made under it (as root too)
    unwritable.write_text("")
    assert file_sha256(model, unwritable) == truth
