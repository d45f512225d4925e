"""Routes, one module per resource: tasks, results, events (a task's changes), queues
(queues and workers), observe (health, metrics, stats and the dashboard), openai
(models, embeddings), generate (completions, streams), usage."""

__all__ = ["events", "generate", "observe", "openai", "queues", "results", "tasks", "usage"]
