"""The sidecar: gRPC services, telemetry ingestion, metrics, snapshots, the CLI and the vLLM plugin."""

__version__ = "0.1.0"
