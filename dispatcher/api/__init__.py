"""The HTTP API (FastAPI): app factory, routes, admission, the task store, the pool read
model, auth and rate limits, metrics export and the dashboard."""

__all__: list[str] = []
