"""leapdecode: a readable Python LLM inference engine for fast, lossless decoding."""
from leapdecode.config import EngineConfig, SparseAttentionConfig, SpeculativeConfig
from leapdecode.llm import LLM
from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "SparseAttentionConfig", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
