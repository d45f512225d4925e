"""GPUs: discovery and pinning (devices), claiming a card through Redis (claim),
classifying CUDA errors (health) and telemetry sampling (sampler). Nothing here
imports a CUDA library."""

__all__: list[str] = []
