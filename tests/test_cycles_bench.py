"""bench/heat/cycles.py: the cycle of conversations it replays is built as it says, and its
table shows every policy at every capacity."""

from __future__ import annotations

import argparse

from bench.heat.cycles import BLOCK, cyclic, run, table


def test_the_cycle_is_round_robin_with_growing_prefixes_and_new_sets() -> None:
    sets = cyclic(conversations=3, turns=2, system_blocks=2, turn_blocks=1, sets=2)
    assert [len(s) for s in sets] == [6, 6]
    first = sets[0]
    # turn 1 of every conversation before turn 2 of any; each turn extends its own prompt
    assert [len(r.hash_ids) for r in first] == [3, 3, 3, 4, 4, 4]
    for c in range(3):
        assert first[c + 3].hash_ids[:3] == first[c].hash_ids
    assert len({tuple(r.hash_ids[:2]) for r in first}) == 3  # a system prompt each
    seen = {i for r in first for i in r.hash_ids}
    assert not seen & {i for r in sets[1] for i in r.hash_ids}  # new conversations
    assert all(r.input_length == len(r.hash_ids) * BLOCK for s in sets for r in s)
    times = [r.timestamp_ms for s in sets for r in s]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_lru_keeps_nothing_below_the_cycle_and_everything_above() -> None:
    a = argparse.Namespace(conversations=4, turns=3, system_blocks=2, turn_blocks=1, sets=2,
                           policy="lru,lirs", capacity="8,64")
    d = run(a)
    assert d["cycle_blocks"] == 4 * (2 + 3)
    got = {(c["policy"], c["capacity_blocks"]): c for c in d["cells"]}
    assert got[("lru", 8)]["hit_rate"] == 0.0
    full = got[("lru", 64)]
    assert full["hit_rate"] > 0.5 and full["per_set"][0] == full["per_set"][1]
    text = table(d)
    assert text.count("\n") == 1 + len(d["policies"])
    assert "| lirs |" in text and "64 blocks" in text
