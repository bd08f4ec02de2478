"""The "Knowledge index" page: a FastAPI app the Airflow plugin mounts on the API server.

It shows what the alias serves, every version with its scores, build progress, the alias history and
the reports, and offers a rollback button. Every route is behind Airflow's login, checked by Airflow's own
API dependency (`get_user`: the auth manager validates the JWT of the `Authorization: Bearer` header or the
`_token` cookie): anonymous JSON and report requests get 401, the page redirects to the auth manager's
login, as Airflow's UI does. The button does not move anything itself: the caller must be allowed to
create runs of `knowledge_rollback` (Airflow's `requires_access_dag`), and the DAG is triggered through
Airflow's REST API *with the caller's own token*, so Airflow's authorization decides twice.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from kb_reindex.config import Settings

ROLLBACK_DAG = "knowledge_rollback"


def _snapshot(settings: Settings) -> dict[str, Any]:
    from kb_reindex import engine
    from kb_reindex.runtime import open_deps

    with open_deps(settings) as deps:
        status = engine.status(deps)
        status["history"] = engine.history(deps)
    return status


def _caller_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return request.cookies.get("_token")


def create_app(
    *,
    settings_factory: Callable[[], Settings] = Settings.from_env,
    airflow_api_url: str | None = None,
) -> FastAPI:
    # Airflow's own checks, imported here (not at module import) because only the API server needs them
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user, requires_access_dag

    app = FastAPI(title="Knowledge index", docs_url=None, redoc_url=None)
    api_url = (airflow_api_url or os.environ.get("KB_AIRFLOW_API_URL", "http://localhost:8080")).rstrip("/")
    signed_in = [Depends(get_user)]
    may_trigger_rollback = [Depends(requires_access_dag("POST", DagAccessEntity.RUN, param_dag_id=ROLLBACK_DAG))]

    @app.get("/api/status", dependencies=signed_in)
    async def status() -> JSONResponse:
        data = await asyncio.to_thread(_snapshot, settings_factory())
        return JSONResponse(json.loads(json.dumps(data, default=str)))

    @app.get("/reports/v{version}/{name}", dependencies=signed_in)
    async def report(version: int, name: str) -> FileResponse:
        if name not in ("validation.html", "validation.md", "validation.csv"):
            raise HTTPException(404, "unknown report")
        settings = settings_factory()
        path = settings.reports_dir / settings.alias / f"v{version}" / name
        if not path.is_file():
            raise HTTPException(404, f"no {name} for v{version}")
        return FileResponse(path)

    @app.post("/api/rollback", dependencies=may_trigger_rollback)
    async def rollback(request: Request) -> JSONResponse:
        body = await request.json()
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise HTTPException(422, "a reason is required")
        to_version = body.get("to_version")
        if to_version is not None and (not isinstance(to_version, int) or to_version < 1):
            raise HTTPException(422, "to_version must be a positive integer")
        token = _caller_token(request)
        if not token:
            raise HTTPException(401, "sign in to Airflow first: rollback runs as you, through the Airflow API")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(
                    f"{api_url}/api/v2/dags/{ROLLBACK_DAG}/dagRuns",
                    headers={"Authorization": f"Bearer {token}"},
                    json={"logical_date": None, "conf": {"to_version": to_version, "reason": reason, "confirm": True}},
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.InvalidURL) as exc:
            raise HTTPException(502, f"Airflow API at {api_url} (KB_AIRFLOW_API_URL) could not be reached: "
                                     f"{type(exc).__name__}: {exc}; nothing was triggered, the alias is unchanged. "
                                     "On-call can run `kb-reindex rollback` instead") from None
        except httpx.HTTPError as exc:  # the request may have arrived: a second rollback must not follow blindly
            raise HTTPException(502, f"Airflow API at {api_url} (KB_AIRFLOW_API_URL) gave no answer: "
                                     f"{type(exc).__name__}: {exc}; a knowledge_rollback run may have been created. "
                                     "Check its runs (or `kb-reindex status`) before trying again") from None
        if answer.status_code in (401, 403):
            raise HTTPException(answer.status_code, "Airflow refused: you may not trigger knowledge_rollback")
        if answer.status_code >= 400:
            raise HTTPException(502, f"Airflow API answered {answer.status_code}: {answer.text[:300]}")
        run = answer.json()
        return JSONResponse({"dag_id": ROLLBACK_DAG, "dag_run_id": run.get("dag_run_id"), "state": run.get("state")})

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        """A browser without a valid login is sent to the auth manager's login page and back, as Airflow's
        UI does (its API answers 401 and the UI redirects): a bare 401 would strand on-call on a blank page."""
        try:
            await get_user(request, None, await bearer_scheme(request))
        except HTTPException as refused:
            if refused.status_code not in (401, 403):
                raise
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)))
        return HTMLResponse(PAGE.replace("{{alias}}", html.escape(settings_factory().alias)))

    return app


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Knowledge index</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.live{background:#e7f6e7}.failed{color:#a00}.target{font-weight:bold}#message{margin:.5em 0;color:#036}
.problem{color:#a00;font-weight:bold}
</style></head>
<body>
<h1>Knowledge index: <code>{{alias}}</code></h1>
<p id="serving">loading…</p>
<div id="problems"></div>
<div id="message"></div>
<h2>Versions</h2>
<table id="versions"><thead><tr><th>version</th><th>status</th><th>model</th><th>dim</th><th>points</th>
<th>hit rate</th><th>MRR</th><th>created</th><th>promoted</th><th>report</th><th></th></tr></thead><tbody></tbody></table>
<h2>Alias history</h2>
<table id="history"><thead><tr><th>at</th><th>action</th><th>from</th><th>to</th><th>reason</th><th>run</th></tr></thead><tbody></tbody></table>
<h2>Metrics</h2><pre id="metrics"></pre>
<script>
function cell(text){const td=document.createElement('td');td.textContent=text==null?'-':String(text);return td;}
async function load(){
  const r=await fetch('api/status');
  if(r.status===401||r.status===403){location.reload();return;}  // login expired: back through Airflow's login
  const s=await r.json();
  document.getElementById('serving').textContent = s.live
    ? `serving v${s.live.version} (${s.live.collection}, ${s.live.points} points, ${s.live.embed_model} ${s.live.dim}-d)`
    : 'nothing is served yet';
  document.getElementById('problems').innerHTML='';
  for(const p of s.problems){const d=document.createElement('div');d.className='problem';d.textContent=p;document.getElementById('problems').append(d);}
  const body=document.querySelector('#versions tbody');body.innerHTML='';
  for(const v of s.versions){
    const tr=document.createElement('tr');tr.id='version-'+v.version;
    if(v.status==='live')tr.className='live';if(v.status==='failed')tr.className='failed';
    const status=v.status+(v.rollback_target?' (rollback target)':'')+
      (v.status==='building'?` ${v.points??0}/${v.points_expected}`:'');
    [v.version,status,v.embed_model,v.dim,v.points,v.hit_rate,v.mrr,v.created_at,v.promoted_at].forEach(x=>tr.append(cell(x)));
    const rep=document.createElement('td');
    if(v.hit_rate!=null){const a=document.createElement('a');a.href='reports/v'+v.version+'/validation.html';a.textContent='report';rep.append(a);}
    tr.append(rep);
    const act=document.createElement('td');
    if(['retired','ready'].includes(v.status) && s.live){
      const b=document.createElement('button');b.textContent='Roll back to v'+v.version;b.className='rollback';
      b.onclick=()=>rollback(v.version, s.live.version);act.append(b);}
    tr.append(act);body.append(tr);
  }
  const hist=document.querySelector('#history tbody');hist.innerHTML='';
  for(const e of s.history.slice().reverse()){const tr=document.createElement('tr');
    [e.at,e.action,e.from_version,e.to_version,e.reason,e.run_id].forEach(x=>tr.append(cell(x)));hist.append(tr);}
  document.getElementById('metrics').textContent=JSON.stringify(s.metrics,null,2);
}
async function rollback(version, live){
  const reason=prompt(`Roll ${'{{alias}}'} back from v${live} to v${version}? Reason:`);
  if(!reason){return;}
  const r=await fetch('api/rollback',{method:'POST',headers:{'Content-Type':'application/json'},
    body:JSON.stringify({to_version:version,reason:reason})});
  const answer=await r.json();
  document.getElementById('message').textContent = r.ok
    ? `triggered knowledge_rollback (${answer.dag_run_id}); the alias moves when it finishes`
    : `refused: ${answer.detail}`;
}
load();setInterval(load,3000);
</script></body></html>
"""
