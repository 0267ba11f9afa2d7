"""The engine's greedy outputs stay exactly those recorded before its speed work
(tests/golden_greedy.py wrote tests/data/greedy_golden.json from the engine as it was)."""

from __future__ import annotations

import json

import pytest
from golden_greedy import FAMILIES, GOLDEN, golden_prompts, run_family


def test_golden_prompts_are_the_recorded_ones() -> None:
    assert json.loads(GOLDEN.read_text())["prompts"] == golden_prompts()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_unchanged(family: str, one_torch_thread: None) -> None:
    want = json.loads(GOLDEN.read_text())["outputs"][family]
    got = run_family(family)
    diff = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not diff, f"{family}: outputs {diff} differ from the recorded greedy tokens"
