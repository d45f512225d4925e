"""Observability routes: ``GET /metrics`` (Prometheus) and ``GET /`` (dashboard)."""

from __future__ import annotations

from fastapi import APIRouter

__all__ = ["router"]

router = APIRouter()
