"""kvheat.server: the OpenAI-compatible HTTP server (`kvheat serve`).

app.py (routes, request checks, streaming), worker.py (the engine thread), config.py
(tenants and arms from TOML/YAML), arms.py (A/B routing and per-arm report), metrics.py
(Prometheus), misses.py (miss causes), tracing.py (OpenTelemetry), admin.py (admin API),
protocol.py (request bodies), cli.py (`serve` and `arms` commands). Needs the `server`
extra: fastapi, uvicorn, prometheus-client, opentelemetry-sdk.
"""
