"""Adapters that run kvheat's policies inside other serving engines.

Each submodule imports its engine; this package imports none of them, so kvheat works
without any engine installed (`kvheat.integrations.vllm` needs the `vllm` extra).
"""
