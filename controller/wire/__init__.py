"""What crosses the wire between an engine and the sidecar, written once for both ends.

``convert``: arms, Hello and directives to and from protobuf. ``codec``: a step's request columns to
``StepReport`` and back. ``names``: what the sidecar accepts as an engine's names. Nothing here does
I/O or imports the sidecar's modules: the vLLM plugin, the demo engine and the sidecar all import it.
"""
