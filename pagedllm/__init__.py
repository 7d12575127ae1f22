"""pagedllm: an LLM serving engine built on PagedAttention.

    from pagedllm import LLM, SamplingParams

`LLM` and the engine load torch lazily, so `import pagedllm.core` stays light.
"""

from pagedllm.config import EngineArgs
from pagedllm.outputs import CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "PoolerConfig",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
