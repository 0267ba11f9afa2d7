"""Heat: decayed access entropy, drift, tuning and the heat eviction policies.

The policies (`kvheat`, `lruk`, `fused`) need no import to be found: `make_policy` loads
them by name (kvheat/cache/eviction.py).
"""

from .counts import HeatClock, HeatRecord
from .drift import DriftDetector
from .entropy import EntropyTracker, shannon_bits
from .fused import Fused, fused_score
from .heap import BlockHeap
from .heat_policy import KVHeat
from .lruk import LRUK, LRUKHistory
from .penalties import Penalties
from .regime import Regime
from .tuning import OnlineTuner

__all__ = [
    "LRUK", "BlockHeap", "DriftDetector", "EntropyTracker", "Fused", "HeatClock", "HeatRecord",
    "KVHeat", "LRUKHistory", "OnlineTuner", "Penalties", "Regime", "fused_score", "shannon_bits",
]
