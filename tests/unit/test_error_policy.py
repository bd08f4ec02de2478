"""errors.classify as the one error policy: the Qdrant store's open errors and the page's HTTP answers ask it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import settings_for
from fastapi import HTTPException
from qdrant_client import QdrantClient
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from kb_reindex.domain.errors import ConfigError, LockHeldError, StoreError, StoreUnreachable, classify
from kb_reindex.services.store import _open_error, describe_qdrant_failure
from kb_reindex.web.context import refusal


def refused(status: int) -> UnexpectedResponse:
    return UnexpectedResponse(status_code=status, reason_phrase="Unauthorized", content=b"{}", headers=httpx.Headers())


def connect_error() -> ResponseHandlingException:
    try:
        raise httpx.ConnectError("[Errno 111] Connection refused")
    except httpx.ConnectError as exc:
        return ResponseHandlingException(exc)


def test_a_refused_api_key_is_a_setting_to_fix_and_never_retried(project: Path) -> None:
    settings = settings_for(project, KB_QDRANT_URL="http://qdrant.example:6333", KB_QDRANT_API_KEY="secret-1")
    client = QdrantClient(url="http://qdrant.example:6333", api_key="secret-1")
    failure = classify(refused(401), qdrant=lambda e: describe_qdrant_failure(e, settings, client))
    assert (failure.kind, failure.transient, failure.exit_code) == ("config", False, 2)
    assert "refused the API key (HTTP 401)" in failure.message and "secret-1" not in failure.message
    opened = _open_error(refused(403), settings, client)
    assert isinstance(opened, ConfigError) and "KB_QDRANT_API_KEY" in str(opened)
    client.close()


def test_whether_a_request_got_through_decides_unreachable_or_store_error(project: Path) -> None:
    settings = settings_for(project, KB_QDRANT_URL="http://127.0.0.1:9")
    client = QdrantClient(url="http://127.0.0.1:9")
    never = connect_error()
    assert not classify(never).reached and classify(httpx.ReadTimeout("slow")).reached
    unreachable = _open_error(never, settings, client)
    assert isinstance(unreachable, StoreUnreachable) and "is unreachable (connection refused)" in str(unreachable)
    slow = _open_error(ResponseHandlingException(httpx.ReadTimeout("slow")), settings, client)
    assert type(slow) is StoreError and "no answer in time" in str(slow) and "not touched" in str(slow)
    client.close()


def test_the_page_answers_a_failure_as_the_policy_says(project: Path) -> None:
    settings = settings_for(project)
    assert refusal(ConfigError("no state DB at x (KB_STATE_URL)"), settings).status_code == 503
    assert refusal(LockHeldError("held"), settings).status_code == 409
    assert refusal(LockHeldError("held"), settings, status=503).status_code == 503
    assert isinstance(refusal(ConfigError("x"), settings), HTTPException)
    with pytest.raises(ZeroDivisionError):  # a bug is not dressed up as an answer: a 500, logged
        refusal(ZeroDivisionError("bug"), settings)
