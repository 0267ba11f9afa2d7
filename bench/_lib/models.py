"""Test models for the benches, built from a config with seeded random weights (nothing is
downloaded) and saved as Hugging Face directories that `kvheat serve`, transformers and
vLLM's CPU build all load (the built-in tiny one: `kvheat.engine.loader.save_tiny_model`)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvheat.engine import ModelConfig
from kvheat.engine.loader import Tokenizer, build_model, init_random_weights, save_model


def wide_llama(layers: int, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """A Llama of representative width (TinyLlama-1.1B's layer shape: hidden 2048, 16 heads
    of 128, 4 KV heads, intermediate 5632) with few layers and seeded random weights, so
    the split of compute between linear layers and attention is that of a real 1-8B model
    at CPU cost."""
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048,
                      intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0,
                      eos_token_id=1)
    model = build_model(cfg)
    init_random_weights(model, seed)
    model.tie_weights()
    return model.eval(), cfg


def save_wide_model(path: Path, layers: int) -> Path:
    model, cfg = wide_llama(layers)
    save_model(model, Tokenizer.tiny(cfg.vocab_size), path)
    return path


def save_llama(path: Path, hidden: int, layers: int) -> None:
    """A Llama wider than the built-in tiny one (so a prefill costs what a cache saves),
    seeded random weights, the tiny tokenizer (the cluster and cold-start benches')."""
    cfg = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=hidden,
                      intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      head_dim=64, max_position_embeddings=4096, rope_theta=10000.0,
                      bos_token_id=0, eos_token_id=1)
    model = build_model(cfg)
    init_random_weights(model, 0)
    save_model(model, Tokenizer.tiny(1024), path)
