"""What the API and the workers share: every Redis key, the job and record format, the
Lua scripts and their loader, settings, the metrics record format, worker states, exit
codes, backoff and logging. Nothing here imports FastAPI or task code."""

__all__: list[str] = []
