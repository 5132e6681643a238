"""A GGUF file's recommended sampling values (llama.cpp's ``general.sampling.*``) become the
converted directory's ``generation_config.json``, the file the router reads its defaults from."""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from router.generation_defaults import GenerationDefaults, load_generation_defaults
from services.engine.model.gguf_convert import generation_config


def write_gguf(path: Path, sampling: dict[str, float | int]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        add = writer.add_int32 if isinstance(value, int) else writer.add_float32
        add(f"general.sampling.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_the_files_sampling_values_become_generation_config(tmp_path: Path) -> None:
    reader = write_gguf(
        tmp_path / "m.gguf", {"temp": 0.6, "top_k": 20, "top_p": 0.95, "penalty_repeat": 1.1}
    )
    config = generation_config(reader)
    assert config == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert load_generation_defaults("auto", tmp_path) == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1
    )


def test_a_file_without_them_has_none(tmp_path: Path) -> None:
    assert generation_config(write_gguf(tmp_path / "m.gguf", {})) == {}
