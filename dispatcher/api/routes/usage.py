"""``GET /usage``: device time per tenant, class and task type over a span of whole
minutes, for a billing job to poll (admin keys only, when keys are configured)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from dispatcher.api.deps import caller, services
from dispatcher.api.errors import ApiError, error_responses
from dispatcher.api.usage import INSTANT_PATTERN, UsageReport, parse_instant, read_usage

__all__ = ["router"]

router = APIRouter()

_WHEN = "Unix seconds, rounded down to its minute."
_SINCE = f"First minute counted: {_WHEN} Default: an hour before until."
_UNTIL = f"End (exclusive): {_WHEN} Default: through the current minute (`complete` false)."


@router.get(
    "/usage",
    tags=["pool"],
    response_model=UsageReport,
    response_model_by_alias=True,
    responses=error_responses(401, 404, 422, 429, 503),
)
async def usage(
    request: Request,
    response: Response,
    since: str | None = Query(
        None, description=_SINCE, json_schema_extra={"pattern": INSTANT_PATTERN}
    ),
    until: str | None = Query(
        None, description=_UNTIL, json_schema_extra={"pattern": INSTANT_PATTERN}
    ),
) -> UsageReport:
    """Device seconds used in the whole minutes from `since` to `until`, by tenant and
    by tenant, class and type, as the workers measured them (docs/design.md §4 "Device
    time"). Poll with `since` = the last answer's `until` and `until` = now: each minute
    is counted once, and a `complete` answer never changes."""
    svc = services(request)
    principal = await caller(request, response)
    if not principal.admin:
        raise ApiError(404, "not_found", "No route /usage for this key.")
    return await read_usage(
        svc.client,
        svc.settings.usage_retention_s,
        parse_instant(since, "since"),
        parse_instant(until, "until"),
    )
