"""What a state-changing request must show before the page acts on it (rollback, promotion, pause, freeze,
unfreeze, try): JSON, from the page itself.

A browser sends the signed-in `_token` cookie with any request to the API server, also one a foreign page's
`<form enctype="text/plain">` makes, and a cookie `SameSite=Lax` travels from a sibling subdomain or another port
of the same host. So a request the cookie authenticates must carry:
- `Content-Type: application/json` (a form cannot send it without a CORS preflight, which we never answer), else 415;
- an `Origin` (or, without one, a `Referer`) of the page's own host, else 403;
- the page's token (`X-KB-Page-Token`): derived from the session cookie, written into the page when it is served,
  so only a page this session opened knows it, else 403.
A caller that sends its own `Authorization: Bearer` header (a script, the CLI's peers) chose to: no browser adds
that header by itself, so it needs neither Origin nor token. Every refusal is a line, never a 500.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from fastapi import HTTPException, Request

#: the header the page's script sends its token in
TOKEN_HEADER = "X-KB-Page-Token"
#: Airflow's session cookie (its auth manager's JWT)
SESSION_COOKIE = "_token"


def page_token(session: str) -> str:
    """The token of the page a session (its cookie's value) opened."""
    return hashlib.sha256(b"kb-reindex page token\0" + session.encode("utf-8")).hexdigest()[:40]


def token_for(request: Request) -> str:
    """The token written into the page served to this request ('' without a session cookie)."""
    session = request.cookies.get(SESSION_COOKIE)
    return page_token(session) if session else ""


def _own_host(request: Request) -> str:
    forwarded = request.headers.get("x-forwarded-host")
    return (forwarded.split(",")[0].strip() if forwarded else request.headers.get("host", "")).lower()


def _origin(request: Request) -> str | None:
    origin = request.headers.get("origin")
    if origin and origin != "null":
        return origin
    referer = request.headers.get("referer")
    if referer:
        parts = urlsplit(referer)
        return f"{parts.scheme}://{parts.netloc}" if parts.netloc else None
    return "null" if origin == "null" else None


async def page_json(request: Request) -> Mapping[str, Any]:
    """The JSON object a state-changing request sends, once it has shown it comes from the page (a FastAPI
    dependency: use its value as the body)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(415, f"send JSON (Content-Type: application/json), not {kind or 'no content type'}; "
                                 "nothing was done")
    if "authorization" not in request.headers:
        origin = _origin(request)
        if origin is None:
            raise HTTPException(403, "the request names no Origin or Referer; only the page itself may act, "
                                     "nothing was done")
        host = urlsplit(origin).netloc.lower() if origin != "null" else "null"
        if host != _own_host(request):
            raise HTTPException(403, f"a request from {origin[:100]} is refused: only the page itself may act, "
                                     "nothing was done")
        sent = request.headers.get(TOKEN_HEADER, "")
        expected = token_for(request)
        if not expected or not sent or not hmac.compare_digest(sent, expected):
            raise HTTPException(403, f"the page's token ({TOKEN_HEADER}) is missing or not this session's: reload "
                                     "the page and try again; nothing was done")
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise HTTPException(400, f"the body is not JSON ({exc}); nothing was done") from None
    if not isinstance(body, dict):
        raise HTTPException(400, f"the body must be a JSON object, got {type(body).__name__}; nothing was done")
    return body
