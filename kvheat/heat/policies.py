"""The heat eviction policies, one module each; importing this module registers them
(`make_policy` imports it the first time it meets a name it does not know).

- `kvheat` (heat_policy.py): the default heat policy. A block's key (`KVHeat.key`) is its
  exponentially decayed access count on a virtual clock (counts.py: the per-block record
  and the generations of `HeatClock`; the policy's ghost history lets a returning prefix
  resume its count) times penalty factors (penalties.py: one-hit suffix demotion of
  partial tails, the admission penalty of a high entropy regime, the learned extension
  penalty, root pinning in a low one), adapted while it runs (feedback.py: the half-life
  following the measured reuse gap, the entropy regime, the optional tuner and drift
  detector; miniature.py: the half-life's multiple of the reuse gap, chosen by miniature
  simulations on a sample of the keys). The coldest evictable leaf goes first, from a bucketed min-heap (heap.py).
  docs/heat.md has the measurements behind every default.
- `lruk` (lruk.py): LRU-K (K=2) with retained history, on the same heap.
- `fused` (fused.py): sampled eviction by the fused sigmoid-gated score.
- `sae` (sae.py): Session-Aware Eviction, vLLM PR #50422's proposal, as a baseline.
"""

from __future__ import annotations

from .counts import HeatRecord
from .fused import Fused
from .heat_policy import KVHeat
from .lruk import LRUK, LRUKHistory
from .penalties import EXTENSION, FRESH, ONE_OFF, PINNED
from .sae import SAE, SAEParams

__all__ = ["EXTENSION", "FRESH", "LRUK", "ONE_OFF", "PINNED", "Fused", "HeatRecord", "KVHeat",
           "LRUKHistory", "SAE", "SAEParams"]
