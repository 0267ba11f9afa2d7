"""The benchmarks: `bench/<area>/<name>.py`, each runnable as a script, and the helpers
they share in `bench/_lib/` (bench/README.md lists them)."""
