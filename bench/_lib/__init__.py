"""What the benches share: `procs` (free ports, servers, Redis), `load` (the multi-turn
load client), `peers` (fair side-by-side runs against vLLM), `report` (the cluster
bench's tables), `models` (test models saved as Hugging Face directories), `traces`,
`workload` (token prompts from traces), `inproc` (a `kvheat serve` inside the bench's
process) and `netns` (a lossy veth link in a network namespace). The replay through vLLM's
offload manager is the package's: `kvheat.integrations.vllm_replay`.

A bench run as `python bench/<area>/<name>.py` puts the repo root first on sys.path (the
two lines under its imports), so `bench._lib` and this checkout's `kvheat` import from
there; `python -m bench.<area>.<name>` works too.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"  # every bench's default output (git-ignored; `make bench`'s too)
TRACES = ROOT.parent / "shared" / "traces"  # the shared Mooncake traces, when present
