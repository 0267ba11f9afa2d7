"""kvheat.engine: paged-attention inference for Llama-style (GQA) and DeepSeek-style (MLA)
decoders on the kvheat block cache.

Where things are: engine.py (`LLMEngine`, the step loop), config.py (`EngineConfig`,
`SchedulerConfig`), model_config.py (`ModelConfig`), sampling.py (`SamplingParams`, the
sampler), outputs.py (what the engine returns), scheduler.py (the batch of each step),
sequence.py (a request as the scheduler sees it), load_classes.py (how a step's prefill
budget is shared), kv_pool.py (`DeviceKVPool`,
the paged KV buffer), attention.py / attention_metadata.py (paged attention), norm.py,
rotary.py, linear.py, llama.py, deepseek.py (the models), runner.py (one forward pass),
loader.py (weights and tokenizers).
"""

from .config import EngineConfig, SchedulerConfig
from .engine import LLMEngine
from .kv_pool import DeviceKVPool
from .loader import Tokenizer, load_model, save_model, tiny_config
from .model_config import ModelConfig
from .outputs import RequestOutput, TokenOutput
from .runner import ModelRunner, SeqBatchItem
from .sampling import GREEDY_BELOW, SamplingParams
from .scheduler import Scheduler

__all__ = [
    "DeviceKVPool", "GREEDY_BELOW", "ModelConfig", "ModelRunner", "SeqBatchItem", "Tokenizer",
    "load_model", "save_model", "tiny_config",
    "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "Scheduler",
    "SchedulerConfig", "TokenOutput",
]
