"""Greedy outputs of the engine on a fixed set of prompts, recorded before the engine's
speed work (issue 11) and checked by tests/test_engine_golden.py, so that no later
optimisation (fused projections, packed GEMMs, another attention kernel, a new batch
layout) changes what the engine generates.

    .venv/bin/python tests/golden_greedy.py      # rewrites tests/data/greedy_golden.json

The workload mixes what the engine's paths do differently: cold prefills of several
lengths, prompts on a shared cached prefix (partial-hit prefill), a prompt whose every
block is cached, chunked prefill under a small token budget, and decode batches of
varying sizes; each family of built-in tiny model (Llama GQA, Qwen3 with q/k norm,
DeepSeek MLA with MoE) runs it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

GOLDEN = Path(__file__).parent / "data" / "greedy_golden.json"
FAMILIES = ("llama", "qwen3", "deepseek")
MAX_TOKENS = 24


def golden_prompts(vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(20261203)

    def rand(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    shared = rand(160)
    prompts = [rand(n) for n in (5, 17, 64, 200, 333)]
    prompts += [shared + rand(n) for n in (1, 16, 40, 90)]
    prompts.append(list(shared))  # every full block cached once the others ran
    return prompts


def run_family(family: str) -> list[list[int]]:
    """Each prompt's greedy tokens: first all at once (batched, chunked under a 128-token
    budget), then again one at a time on the warm cache."""
    torch.manual_seed(0)
    sched = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=6)
    engine = LLMEngine.from_pretrained(None, family, config=EngineConfig(
        num_blocks=256, block_size=16, scheduler=sched))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = golden_prompts(engine.model_config.vocab_size)
    batched = [o.output_token_ids for o in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].output_token_ids for p in prompts]
    return batched + alone


def main() -> None:
    torch.set_num_threads(1)
    data = {"max_tokens": MAX_TOKENS, "prompts": golden_prompts(),
            "outputs": {f: run_family(f) for f in FAMILIES}}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(data) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
