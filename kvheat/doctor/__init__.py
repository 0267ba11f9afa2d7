"""`kvheat doctor`: scrape a live server's /metrics twice (or read a Prometheus at the two
ends of a time range, `prometheus.py`) and rank the likely causes of an SLO breach or a
hit-rate drop, each with its evidence and the action that fixes it."""

from .causes import CAUSES, FLOOR, Finding, Snapshot, diagnose
from .scrape import MAX_BYTES, DoctorError, admin_stats, parse_metrics, scrape

__all__ = ["CAUSES", "FLOOR", "MAX_BYTES", "DoctorError", "Finding", "Snapshot",
           "admin_stats", "diagnose", "parse_metrics", "scrape"]
