"""pdserve: LLM serving with disaggregated prefill and decode.

The offline API: ``from pdserve import LLM, SamplingParams``.
"""

from services.engine.llm import LLM
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
