"""Heat: decay functions, decayed access entropy, heat scores and the heat policies.

Importing this package registers the `kvheat`, `lruk` and `fused` eviction policies.
"""

from . import policies  # noqa: F401  (registers the heat policies)
from .decay import Decay, exponential, hyperbolic, log_add_exp, logarithmic, rate_for_half_life
from .drift import DriftDetector
from .entropy import EntropyTracker, shannon_bits
from .policies import LRUK, Fused, KVHeat
from .scoring import HotnessCounter, LRUKHistory, Regime, decayed_log_count, fused_score
from .tuning import OnlineTuner

__all__ = [
    "LRUK", "Decay", "DriftDetector", "EntropyTracker", "Fused", "HotnessCounter", "KVHeat",
    "LRUKHistory", "OnlineTuner", "Regime", "decayed_log_count", "exponential", "fused_score",
    "hyperbolic", "log_add_exp", "logarithmic", "rate_for_half_life", "shannon_bits",
]
