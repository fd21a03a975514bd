"""The in-engine vLLM plugin: composite drafting, the fast loop, telemetry and directives.

See docs/vllm-plugin.md. Only ``controller.vllm.engine_hooks`` imports vLLM; the rest is plain Python
and numpy so it can be tested without an engine.
"""
