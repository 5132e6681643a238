"""Build the model from a Hugging Face directory (``services.engine.model.source`` finds it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from kernels import reference
from kernels.cpu_ops import cpu_signature
from services.engine.config import ModelConfig
from services.engine.model.gemm_choice import choose_paths
from services.engine.model.int8_linear import Int8Ops, quantize_linears
from services.engine.model.llama import LlamaModel
from services.engine.model.packed_linear import SmallBatchLinear, pack_linears
from services.engine.model.source import ModelLoadError

logger = logging.getLogger(__name__)


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


def materialize(model: nn.Module) -> None:
    """``model.to_empty(device="cpu")``, uninitialized CPU tensors in place of the meta ones,
    without ``empty_like`` on a meta tensor: that goes through torch's Python references, which
    import sympy (~0.7 s of every worker's start). Tied weights come apart (the loader ties
    them again), as with ``to_empty``."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=param.dtype)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype))


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: str,
    cpu_matmul: str = "auto",
    small_batch: SmallBatchLinear | None = None,
    kernel_cache: Path | None = None,
    quantization: str = "none",
    int8_ops: Int8Ops | None = None,
) -> LlamaModel:
    """Build the model from ``model_dir`` and load its weights. On CPU each linear layer runs
    its GEMMs on the path ``cpu_matmul`` forces, or (``auto``) on the fastest measured for its
    shape and row count, cached in ``kernel_cache`` (``gemm_choice``); ``small_batch``: the
    compiled kernel for 1-4 rows of bfloat16 weights. The table is ``model.gemm_table``.
    ``quantization`` ``int8``: the decoder layers' linears in int8 (``int8_linear``, their
    quantize/dequantize passes from ``int8_ops``, or PyTorch's); the LM head keeps its paths."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaModel(config)
    materialize(model)
    model.rope.build()  # buffers are not weights: rebuild them after materialize()
    model.load_hf_state_dict(load_weights(model_dir))
    model = model.to(device=device, dtype=dtype).eval()
    if quantization == "int8":
        count = quantize_linears(model.layers, int8_ops or reference)
        logger.info("int8 weights and activations in %d linear layers", count)
    elif quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r}")
    table = choose_paths(model, cpu_matmul, small_batch, kernel_cache, cpu_signature())
    if table is not None:  # CPU: nothing to choose elsewhere
        pack_linears(model, table.chooser(), small_batch)
        took = f" in {table.measure_seconds:.1f} s" if table.source == "measured" else ""
        logger.info("GEMM path per row count (%s weights, %s%s):", table.dtype, table.source, took)
        for line in table.lines():
            logger.info("  %s", line)
    model.gemm_table = table
    return model
