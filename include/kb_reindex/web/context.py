"""What every route of the page shares: the settings, Airflow's API and checks, the typed status, and the one
error policy (errors.classify) turned into HTTP answers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

from kb_reindex.services.config import Settings
from kb_reindex.domain.errors import UNAVAILABLE_KINDS, classify
from kb_reindex.run.pageview import FreshInstall, PageStatus, read_page, read_status
from kb_reindex.run.status import VersionRow
from kb_reindex.services.store import describe_qdrant_failure
from kb_reindex.web.airflow_api import AirflowApi, DagIds
from kb_reindex.web.auth import AirflowAuth

#: failures that mean the page's backing services are missing or down (503), not a refusal of the request (409)
UNAVAILABLE = frozenset({"config"}) | UNAVAILABLE_KINDS


def refusal(exc: Exception, settings: Settings, *, status: int | None = None) -> HTTPException:
    """An exception as the page answers it, by errors.classify: a setting to fix or a service down is 503, a
    refusal 409 (unless `status` says), with the one-line message. A bug is raised as it is (500, logged)."""
    failure = classify(exc, state_url=settings.state_url, qdrant=lambda e: describe_qdrant_failure(e, settings))
    if not failure.expected:
        raise exc
    return HTTPException(status or (503 if failure.kind in UNAVAILABLE else 409), failure.message)


def page_status(settings: Settings) -> PageStatus:
    """The page's status (kb_reindex.run.pageview: read-only, never creates a state DB, fast while a build holds
    the local Qdrant store); a missing or unreadable state DB is a 503 naming KB_STATE_URL."""
    try:
        return read_status(settings)
    except Exception as exc:
        raise refusal(exc, settings, status=503) from None


def page_or_fresh(settings: Settings) -> PageStatus | FreshInstall:
    """The page's status, or what to do first on a fresh install (no state DB yet: not an error); any other
    failure to read is a 503 as in page_status."""
    try:
        return read_page(settings)
    except Exception as exc:
        raise refusal(exc, settings, status=503) from None


def reason_of(body: Mapping[str, Any]) -> str:
    reason = str(body.get("reason") or "").strip()
    if not reason:
        raise HTTPException(422, "a reason is required")
    return reason


def positive_int(body: Mapping[str, Any], key: str, meaning: str = "") -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HTTPException(422, f"{key} must be a positive integer{meaning}")
    return value


@dataclass(frozen=True)
class PageContext:
    settings_factory: Callable[[], Settings]
    airflow: AirflowApi
    auth: AirflowAuth
    #: the DAGs of this page's knowledge base
    dags: DagIds = field(default_factory=DagIds)
    #: its registry entry does not load (kb_reindex.services.registry.KnowledgeBase.problem): why; the page and
    #: its rollback stay
    registry_error: str | None = None

    async def status_now(self) -> PageStatus:
        return await asyncio.to_thread(page_status, self.settings_factory())

    async def page_now(self) -> PageStatus | FreshInstall:
        return await asyncio.to_thread(page_or_fresh, self.settings_factory())

    @staticmethod
    def version_row(page: PageStatus, number: int) -> VersionRow:
        row = page.status.version(number)
        if row is None:
            raise HTTPException(404, f"no version {number}")
        return row

    def confirmed_live(self, page: PageStatus, body: Mapping[str, Any]) -> int | None:
        """The live version on-call saw and confirmed ("vX -> vY"), as `page` (read once per request) shows
        it: refused when the alias has moved since."""
        confirmed = body.get("live_version")
        if confirmed is not None and (isinstance(confirmed, bool) or not isinstance(confirmed, int)):
            raise HTTPException(422, "live_version must be the version number the page showed live")
        live = page.status.live
        now = live.version if live else None
        if confirmed != now:
            raise HTTPException(409, f"{self.settings_factory().alias} serves {f'v{now}' if now else 'nothing'} now, "
                                     f"not {f'v{confirmed}' if confirmed else 'nothing'} as you confirmed: reload the "
                                     "page and confirm again; nothing was triggered")
        return now
