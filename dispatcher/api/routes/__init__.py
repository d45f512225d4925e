"""Routes, one module per concept: tasks, pool (queues and workers), observe (health,
metrics, stats and the dashboard)."""

__all__ = ["observe", "pool", "tasks"]
