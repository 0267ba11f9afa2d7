"""kvheat.engine: paged-attention inference for Llama-style (GQA) and DeepSeek-style (MLA)
decoders on the kvheat block cache."""

from .config import ModelConfig
from .engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams, TokenOutput
from .loader import Tokenizer, load_model, save_model, save_tiny_model, tiny_config
from .runner import ModelRunner, SeqBatchItem
from .scheduler import Scheduler, SchedulerConfig

__all__ = [
    "ModelConfig", "ModelRunner", "SeqBatchItem", "Tokenizer", "load_model", "save_model",
    "save_tiny_model", "tiny_config",
    "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "Scheduler",
    "SchedulerConfig", "TokenOutput",
]
