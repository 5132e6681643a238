"""What a `vllm serve` user types that has no meaning in `pdserve up` / `pdserve serve`.

Each such flag is known to the parser only to be refused at once, with the command's own usage
and a line saying why and what to use instead. The flags vLLM and pdserve share
(``--host``, ``--port``, ``--served-model-name``, ``--dtype``, ...) are ordinary settings; the
whole map is in docs/vllm-serve.md.
"""

from __future__ import annotations

import argparse
from typing import Any

_PARALLEL = (
    "one worker runs the whole model on one device: scale out with more workers "
    "(--prefill N --decode M, or --colocated N)"
)
# vLLM's flag (and its short forms) -> why it is refused here, and what to use instead.
REFUSED: dict[tuple[str, ...], str] = {
    ("--tensor-parallel-size", "-tp"): _PARALLEL,
    ("--pipeline-parallel-size", "-pp"): _PARALLEL,
    ("--data-parallel-size", "-dp"): _PARALLEL,
    ("--gpu-memory-utilization",): (
        "the KV pool is sized in bytes or blocks: --kv-cache-memory SIZE or --num-blocks N"
    ),
    ("--kv-cache-dtype",): "the KV cache has the weights' --dtype",
    ("-q",): "here it is --quantization {none,int8} (int8: W8A8 on the CPU)",
    ("--trust-remote-code",): "no model code is loaded: the built-in llama and qwen2 models run",
    ("--download-dir", "--revision"): (
        "nothing is downloaded: give a local Hugging Face directory or .gguf file"
    ),
    ("--swap-space",): "swap space is counted in blocks: --num-swap-blocks N",
    ("--cpu-offload-gb",): "the weights stay on --device",
    ("--kv-transfer-config",): (
        "prefill/decode disaggregation is built in: --prefill N --decode M --transport "
        "{tcp,shm,torch,ucx}"
    ),
    ("--enforce-eager",): "the model always runs eagerly here: leave the flag out",
    ("--ssl-keyfile", "--ssl-certfile"): (
        "the router speaks plain HTTP: terminate TLS in front of it (a reverse proxy, an ingress)"
    ),
    ("--enable-prefix-caching",): ("here it is the --prefix-caching switch, on by default"),
    ("--enable-chunked-prefill",): ("here it is the --chunked-prefill switch, on by default"),
    ("--enable-auto-tool-choice",): (
        "tool_choice auto is always on: leave the flag out (--tool-call-parser picks the format)"
    ),
}


class _Refused(argparse.Action):
    """A flag that ends the parse with the command's usage and the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str, **kwargs: Any):
        kwargs.update(nargs="?", default=argparse.SUPPRESS, metavar="VALUE", help=reason)
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} (a vllm serve flag) has no meaning here: {self.reason}")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``REFUSED``, in a help section of its own."""
    group = parser.add_argument_group("vllm serve flags refused here (each says why)")
    for flags, reason in REFUSED.items():
        group.add_argument(*flags, action=_Refused, reason=reason)
