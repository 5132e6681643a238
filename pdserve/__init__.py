"""pdserve: LLM serving with disaggregated prefill and decode.

The offline API: ``from pdserve import LLM, SamplingParams``. The engine is imported when one of
these names is first used, not with the package: the router and the command line load only
what they need (the router never loads torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.sampling_params import SamplingParams
    from services.engine.llm import LLM
    from services.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_WHERE = {
    "LLM": "services.engine.llm",
    "SamplingParams": "common.sampling_params",
    "RequestOutput": "services.engine.outputs",
    "CompletionOutput": "services.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
