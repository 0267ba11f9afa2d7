"""kvheat.server: the OpenAI-compatible HTTP server (`kvheat serve`).

app.py (the server: engines per arm, request checks, routes), responses.py (OpenAI
response bodies and server-sent events), errors.py (errors in OpenAI's shape),
prompts.py (prompts to checked token ids), detokenizer.py (token ids to text, stop
strings), handle.py (a request's token stream between the engine thread and its handler),
worker.py (the engine thread), config.py (tenants and arms from TOML/YAML), arms.py (A/B
routing and per-arm report), metrics.py (Prometheus), misses.py (miss causes), tracing.py
(OpenTelemetry), admin.py (admin API), protocol.py (request bodies), events.py (KV events),
guard.py (checks before the body is read), cli.py (`serve` and `arms` commands). Needs the
`server` extra: fastapi, uvicorn, prometheus-client, opentelemetry-sdk.
"""
