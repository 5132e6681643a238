"""Convert a GGUF file (llama / qwen2 architectures) into a Hugging Face model directory, once.

Quantized tensors are dequantized with the ``gguf`` package; llama.cpp's interleaved q/k rows
are put back into Hugging Face's rotate-half order. The result (safetensors + config.json +
tokenizer files) is cached under ``<cache_dir>/models/<stem>-<sha256[:16]>`` and written
atomically, so concurrent workers converting the same file do not collide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from services.engine.model.source import (
    SOURCE_FILE,
    ModelLoadError,
    conversion_dir,
    file_sha256,
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# The sampling values a GGUF file may recommend (llama.cpp's general.sampling.*), by the names
# generation_config.json gives them: the router applies them to requests that leave them out.
_SAMPLING_NAMES = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """Where ``gguf_path`` is (or will be) converted; converts it if not cached yet."""
    sha = file_sha256(gguf_path, cache_dir)
    target = conversion_dir(gguf_path, cache_dir, sha)
    if (target / SOURCE_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        (tmp / SOURCE_FILE).write_text(
            json.dumps({"source": str(gguf_path), "sha256": sha}, indent=2)
        )
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / SOURCE_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _reverse_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves of q/k rows."""
    half = weight.shape[0] // num_heads // 2
    shape = weight.shape
    return weight.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _field(reader, key: str, default=None):  # type: ignore[no-untyped-def]
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises a variety of errors on bad files
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{gguf_path}: architecture {arch!r} is not supported (llama, qwen2)")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor"):
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        name = tensor.name
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = num_heads if "attn_q" in name else num_kv_heads
            array = _reverse_permute(array, heads)
        weights[_hf_name(name)] = torch.from_numpy(np.ascontiguousarray(array))
    config = _hf_config(reader, arch, num_heads, num_kv_heads, "lm_head.weight" not in weights)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    sampling = generation_config(reader)
    if sampling:  # none in the default model's file
        (out / "generation_config.json").write_text(json.dumps(sampling, indent=2))
    _convert_tokenizer(gguf_path, out)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"unexpected tensor {name!r} in the GGUF file")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _hf_config(reader, arch: str, num_heads: int, num_kv_heads: int, tied: bool) -> dict:  # type: ignore[no-untyped-def]
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": tied,
        "attention_bias": arch == "qwen2",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def generation_config(reader) -> dict:  # type: ignore[no-untyped-def]
    """The file's recommended sampling values as generation_config.json holds them (float32
    values rounded back to what was written: 0.6, not 0.6000000238)."""
    found = {}
    for key, name in _SAMPLING_NAMES.items():
        value = _field(reader, f"general.sampling.{key}")
        if value is not None:
            found[name] = round(value, 6) if isinstance(value, float) else int(value)
    return found


def _convert_tokenizer(gguf_path: Path, out: Path) -> None:
    # transformers knows how to rebuild a fast tokenizer (and chat template) from GGUF metadata.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":  # `python -m ... GGUF CACHE_DIR`: what a torch-free process runs
    import sys

    converted_dir(Path(sys.argv[1]), Path(sys.argv[2]))
