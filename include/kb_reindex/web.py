"""The "Knowledge index" page: a FastAPI app the Airflow plugin mounts on the API server.

It shows what the alias serves, every version with its scores (table and chart), build progress, held
locks and notes, the alias history, the metrics and the reports; and, from Airflow, whether
`knowledge_reindex` is paused and the recent runs of our DAGs. It offers a rollback button (versions that
served), a separate shadow promotion (versions never served), and a pause toggle.

Every route is behind Airflow's login, checked by Airflow's own API dependency (`get_user`: the auth manager
validates the JWT of the `Authorization: Bearer` header or the `_token` cookie): anonymous JSON and report
requests get 401, the page redirects to the auth manager's login, as Airflow's UI does. The buttons move
nothing themselves: the caller must be allowed to act on the DAG (Airflow's `requires_access_dag`), and the
action goes through Airflow's REST API *with the caller's own token*, so Airflow's authorization decides
twice. Runs and the paused flag are read the same way, as the caller.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from kb_reindex.config import Settings

REINDEX_DAG = "knowledge_reindex"
ROLLBACK_DAG = "knowledge_rollback"
MIGRATION_DAG = "knowledge_model_migration"
PROMOTE_SHADOW_DAG = "knowledge_promote_shadow"
#: the DAGs whose runs the page lists and follows (no other DAG is proxied)
OUR_DAGS = (REINDEX_DAG, ROLLBACK_DAG, MIGRATION_DAG, PROMOTE_SHADOW_DAG)
RECENT_RUNS_PER_DAG = 5


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


def run_ui_path(dag_id: str, run_id: str) -> str:
    """Where Airflow's UI shows a run (the page is served by the same api-server)."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def run_summary(dag_id: str, run: dict[str, Any]) -> dict[str, Any]:
    """The fields of an Airflow dag run the page shows, with the link to it."""
    run_id = run.get("dag_run_id") or ""
    return {"dag_id": dag_id, "dag_run_id": run_id, "state": run.get("state"), "run_type": run.get("run_type"),
            "run_after": run.get("run_after"), "start_date": run.get("start_date"), "end_date": run.get("end_date"),
            "url": run_ui_path(dag_id, run_id)}


class AirflowApi:
    """Airflow's REST API called *as the signed-in user* (their token), with answers on-call can act on."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def call(self, request: Request, method: str, path: str, *, body: dict[str, Any] | None = None,
                   params: dict[str, Any] | None = None, action: str | None = None) -> dict[str, Any]:
        """`action` names what a write would have done, for the message when its fate is unknown."""
        token = _caller_token(request)
        if not token:
            raise HTTPException(401, "sign in to Airflow first: the page acts as you, through the Airflow API")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.request(method, f"{self.base_url}/api/v2/{path}", params=params, json=body,
                                              headers={"Authorization": f"Bearer {token}"})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.InvalidURL) as exc:
            raise HTTPException(502, f"Airflow API at {self.base_url} (KB_AIRFLOW_API_URL) could not be reached: "
                                     f"{type(exc).__name__}: {exc}"
                                     + (f"; nothing was triggered, the alias is unchanged. {action['fallback']}"
                                        if action else "")) from None
        except httpx.HTTPError as exc:  # the request may have arrived: a second click must not follow blindly
            raise HTTPException(502, f"Airflow API at {self.base_url} (KB_AIRFLOW_API_URL) gave no answer: "
                                     f"{type(exc).__name__}: {exc}"
                                     + (f"; {action['unknown']}" if action else "")) from None
        if answer.status_code in (401, 403):
            raise HTTPException(answer.status_code, f"Airflow refused: you may not {method} {path}")
        if answer.status_code == 404:
            raise HTTPException(404, f"Airflow has no {path}")
        if answer.status_code >= 400:
            raise HTTPException(502, f"Airflow API answered {answer.status_code}: {answer.text[:300]}")
        return answer.json()

    async def trigger(self, request: Request, dag_id: str, conf: dict[str, Any], *, fallback: str) -> dict[str, Any]:
        run = await self.call(request, "POST", f"dags/{dag_id}/dagRuns", body={"logical_date": None, "conf": conf},
                              action={"fallback": fallback,
                                      "unknown": f"a {dag_id} run may have been created. Check its runs (or "
                                                 "`kb-reindex status`) before trying again"})
        return run_summary(dag_id, run)


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
    airflow = AirflowApi(api_url)
    signed_in = [Depends(get_user)]

    def may_trigger(dag_id: str) -> list[Any]:
        return [Depends(requires_access_dag("POST", DagAccessEntity.RUN, param_dag_id=dag_id))]

    async def version_row(number: int) -> dict[str, Any]:
        status = await asyncio.to_thread(_snapshot, settings_factory())
        row = next((v for v in status["versions"] if v["version"] == number), None)
        if row is None:
            raise HTTPException(404, f"no version {number}")
        return row

    def reason_of(body: dict[str, Any]) -> str:
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise HTTPException(422, "a reason is required")
        return reason

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

    @app.post("/api/rollback", dependencies=may_trigger(ROLLBACK_DAG))
    async def rollback(request: Request) -> JSONResponse:
        body = await request.json()
        reason = reason_of(body)
        to_version = body.get("to_version")
        if to_version is not None and (not isinstance(to_version, int) or to_version < 1):
            raise HTTPException(422, "to_version must be a positive integer")
        if to_version is not None and not (await version_row(to_version))["rollback_allowed"]:
            raise HTTPException(409, f"v{to_version} never served or is not kept: a rollback returns only to a "
                                     "version that served (a shadow goes live by promotion)")
        run = await airflow.trigger(request, ROLLBACK_DAG,
                                    {"to_version": to_version, "reason": reason, "confirm": True},
                                    fallback="On-call can run `kb-reindex rollback` instead")
        return JSONResponse(run)

    @app.post("/api/promote-shadow", dependencies=may_trigger(PROMOTE_SHADOW_DAG))
    async def promote_shadow(request: Request) -> JSONResponse:
        body = await request.json()
        reason = reason_of(body)
        version = body.get("version")
        if not isinstance(version, int) or version < 1:
            raise HTTPException(422, "version must be a positive integer")
        if not (await version_row(version))["shadow"]:
            raise HTTPException(409, f"v{version} is not a shadow (ready, never served); a version that served "
                                     "goes back through a rollback")
        run = await airflow.trigger(request, PROMOTE_SHADOW_DAG, {"version": version, "reason": reason, "confirm": True},
                                    fallback=f"On-call can run `kb-reindex promote --version {version}` instead")
        return JSONResponse(run)

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=signed_in)
    async def dag_run(dag_id: str, run_id: str, request: Request) -> JSONResponse:
        """One run of our DAGs, read as the caller: the page follows a run it triggered to its end."""
        if dag_id not in OUR_DAGS:
            raise HTTPException(404, "not a knowledge DAG")
        run = await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
        return JSONResponse(run_summary(dag_id, run))

    @app.get("/api/airflow", dependencies=signed_in)
    async def airflow_view(request: Request) -> JSONResponse:
        """Whether the reindex is paused and the recent runs of our DAGs, from Airflow's own records (runs
        that failed before reaching our code included), as the caller may see them."""
        async def runs_of(dag_id: str) -> list[dict[str, Any]] | str:
            try:
                page = await airflow.call(request, "GET", f"dags/{dag_id}/dagRuns",
                                          params={"order_by": "-run_after", "limit": RECENT_RUNS_PER_DAG})
            except HTTPException as refused:
                return f"{dag_id}: {refused.detail}"
            return [run_summary(dag_id, run) for run in page.get("dag_runs", [])]

        try:
            reindex = await airflow.call(request, "GET", f"dags/{REINDEX_DAG}")
        except HTTPException as refused:
            return JSONResponse({"reindex_paused": None, "runs": [], "errors": [str(refused.detail)]})
        found = await asyncio.gather(*(runs_of(dag_id) for dag_id in OUR_DAGS))
        runs = sorted((run for result in found if isinstance(result, list) for run in result),
                      key=lambda run: run["run_after"] or "", reverse=True)
        return JSONResponse({"reindex_paused": reindex.get("is_paused"), "runs": runs,
                             "errors": [result for result in found if isinstance(result, str)]})

    @app.post("/api/reindex-paused", dependencies=[Depends(requires_access_dag("PUT", param_dag_id=REINDEX_DAG))])
    async def pause_reindex(request: Request) -> JSONResponse:
        """Runbook step 3 after a rollback: pause the reindex so it does not rebuild the bad change."""
        paused = (await request.json()).get("paused")
        if not isinstance(paused, bool):
            raise HTTPException(422, "paused must be true or false")
        dag = await airflow.call(request, "PATCH", f"dags/{REINDEX_DAG}", body={"is_paused": paused})
        return JSONResponse({"dag_id": REINDEX_DAG, "reindex_paused": dag.get("is_paused")})

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


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>Knowledge index</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h2{margin:1.2em 0 .3em;font-size:1.15em}
table{border-collapse:collapse;margin:.3em 0 1em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.live{background:#e7f6e7}.failed{color:#a00}.shadow{background:#f3f0fb}
.problem{color:#a00;font-weight:bold}.note{color:#8a5a00}
#message{margin:.5em 0;padding:.4em .6em;border-radius:4px}#message:empty{display:none}
#message.pending{background:#eef4fb}#message.ok{background:#e7f6e7}#message.bad{background:#fbeaea}
.state-success{color:#080}.state-failed{color:#a00;font-weight:bold}.state-running,.state-queued{color:#036}
button.promote{background:#f3f0fb;border:1px solid #7a5fc0}button.rollback{border:1px solid #888}
.cols{display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start}
progress{width:9em;vertical-align:middle}td.when,td.model,td button{white-space:nowrap}
#chart text{font-size:11px;fill:#444}
</style></head>
<body>
<h1>Knowledge index: <code>{{alias}}</code></h1>
<p id="serving">loading…</p>
<div id="problems"></div><div id="audit"></div>
<div id="notes"></div>
<div id="message"></div>
<h2>Reindex schedule</h2>
<p><span id="reindex-paused">asking Airflow…</span> <button id="pause-toggle" hidden></button></p>
<h2>Versions</h2>
<table id="versions"><thead><tr><th>version</th><th>status</th><th>model</th><th>dim</th><th>points</th><th>layout</th>
<th>hit rate</th><th>MRR</th><th>created (UTC)</th><th>promoted (UTC)</th><th>report</th><th>action</th></tr></thead><tbody></tbody></table>
<div class="cols">
<div><h2>Golden-set scores by version</h2><svg id="chart" width="560" height="230" role="img"
 aria-label="hit rate and MRR by version"></svg></div>
<div><h2>Metrics</h2><table id="metrics"><tbody></tbody></table></div>
</div>
<h2>Recent runs in Airflow</h2>
<div id="runs-errors" class="note"></div>
<table id="runs"><thead><tr><th>DAG</th><th>run</th><th>type</th><th>state</th><th>run after (UTC)</th><th>started</th>
<th>ended</th></tr></thead><tbody></tbody></table>
<h2>Held locks</h2>
<table id="locks"><thead><tr><th>lock</th><th>owner</th><th>since</th><th>expires</th><th>owner alive</th></tr></thead>
<tbody></tbody></table>
<h2>Alias history</h2>
<table id="history"><thead><tr><th>at (UTC)</th><th>action</th><th>from</th><th>to</th><th>reason</th><th>run</th></tr></thead><tbody></tbody></table>
<script>
const ALIAS='{{alias}}';
const SVG='http://www.w3.org/2000/svg';
let lastStatus=null;
function cell(text,cls){const td=document.createElement('td');td.textContent=text==null?'–':String(text);if(cls)td.className=cls;return td;}
function when(iso){return iso==null?null:String(iso).replace('T',' ').replace(/(:\d\d)(\.\d+)?(Z|\+00:00)$/,'$1');}  // times are UTC
function fixed(x){return x==null?null:Number(x).toFixed(3);}
function ago(seconds){if(seconds==null)return null;const s=Number(seconds);
  if(s<120)return s.toFixed(1)+' s';if(s<7200)return (s/60).toFixed(1)+' min';if(s<172800)return (s/3600).toFixed(1)+' h';return (s/86400).toFixed(1)+' days';}
function pct(x){return x==null?null:(100*x).toFixed(1)+' %';}
const METRICS=[['runs','finished runs (reindex, migration)',x=>x],['run_success_rate','run success rate',pct],
  ['failed_runs','failed runs',x=>x],['last_run_duration_s','last run duration',ago],
  ['last_changed_chunks','chunks embedded by the last promotion',x=>x],
  ['last_embedding_reuse_rate','embedding reuse rate of the last promotion',pct],
  ['last_source_to_searchable_s','source change to searchable (last promotion)',ago],
  ['alias_switch_failures','alias-switch failures',x=>x],['embedding_failures','embedding failures',x=>x],
  ['ready_unpromoted_age_s','age of the newest ready, unpromoted version',ago]];
function say(cls,...parts){const m=document.getElementById('message');m.className=cls;m.replaceChildren(...parts);}
function link(href,text,id){const a=document.createElement('a');a.href=href;a.textContent=text;if(id)a.id=id;return a;}

async function load(){
  const r=await fetch('api/status');
  if(r.status===401||r.status===403){location.reload();return;}  // login expired: back through Airflow's login
  const raw=await r.text();
  if(raw===lastStatus)return;  // unchanged: keep the rows (and the button under the pointer) as they are
  lastStatus=raw;const s=JSON.parse(raw);
  document.getElementById('serving').textContent = s.live
    ? `serving v${s.live.version} (${s.live.collection}, ${s.live.points} points, ${s.live.embed_model} ${s.live.dim}-d)`
    : 'nothing is served yet';
  const problems=document.getElementById('problems');problems.innerHTML='';
  for(const p of s.problems){const d=document.createElement('div');d.className='problem';d.textContent='problem: '+p;problems.append(d);}
  const a=s.audit;document.getElementById('audit').textContent=a
    ? `audit of live v${a.version} (${when(a.at)}): ${a.points} points, manifest ${a.expected}; missing ${a.missing}, orphans ${a.orphans}`
    : '';
  const notes=document.getElementById('notes');notes.innerHTML='';
  for(const n of s.notes){const d=document.createElement('div');d.className='note';d.textContent='note: '+n;notes.append(d);}
  versions(s);chart(s.versions,s.live);metrics(s.metrics);locks(s.locks);
  const hist=document.querySelector('#history tbody');hist.innerHTML='';
  for(const e of s.history.slice().reverse()){const tr=document.createElement('tr');
    [when(e.at),e.action,e.from_version,e.to_version,e.reason,e.run_id].forEach((x,i)=>tr.append(cell(x,i?'':'when')));hist.append(tr);}
}
function versions(s){
  const body=document.querySelector('#versions tbody');body.innerHTML='';
  for(const v of s.versions){
    const tr=document.createElement('tr');tr.id='version-'+v.version;
    tr.className=v.status==='live'?'live':v.status==='failed'?'failed':v.shadow?'shadow':'';
    const status=cell(v.status+(v.rollback_target?' (rollback target)':'')+(v.shadow?' · shadow, never served':'')
      +(v.pinned?` · pinned: ${v.pin.reason} (${v.pin.by}, ${when(v.pin.at)})`:''));
    if(v.pinned)status.classList.add('pinned');
    if(v.status==='building'){
      const bar=document.createElement('progress');bar.max=v.points_expected||1;bar.value=v.points_written||0;
      bar.className='build-progress';status.append(' ',bar,` ${v.points_written??0}/${v.points_expected} points`);}
    tr.append(cell(v.version,'num'),status);
    [v.embed_model,v.dim,v.points].forEach((x,i)=>tr.append(cell(x,i?'num':'model')));
    const layout=cell(v.payload_layout,'layout');layout.title='embedding profile '+v.embed_profile;tr.append(layout);
    [fixed(v.hit_rate),fixed(v.mrr)].forEach(x=>tr.append(cell(x,'num')));
    [v.created_at,v.promoted_at].forEach(x=>tr.append(cell(when(x),'when')));
    const rep=document.createElement('td');
    if(v.hit_rate!=null)rep.append(link('reports/v'+v.version+'/validation.html','report'));
    tr.append(rep);
    const act=document.createElement('td');
    if(v.rollback_allowed && s.live){
      const b=document.createElement('button');b.textContent='Roll back to v'+v.version;b.className='rollback';
      b.onclick=()=>rollback(v.version,s.live.version);act.append(b);}
    if(v.shadow){
      const b=document.createElement('button');b.className='promote';
      b.textContent=`Promote shadow v${v.version} (${v.embed_model}, ${v.dim}-d)`;
      b.onclick=()=>promoteShadow(v,s.live);act.append(b);}
    tr.append(act);body.append(tr);
  }
}
function chart(all,live){
  const svg=document.getElementById('chart');svg.replaceChildren();
  const pts=all.filter(v=>v.hit_rate!=null).sort((a,b)=>a.version-b.version);
  const W=560,H=230,L=40,R=100,T=12,B=34,w=W-L-R,h=H-T-B;
  const el=(name,attrs,text)=>{const e=document.createElementNS(SVG,name);for(const k in attrs)e.setAttribute(k,attrs[k]);if(text!=null)e.textContent=text;svg.append(e);return e;};
  for(const y of [0,0.25,0.5,0.75,1]){const py=T+h-y*h;
    el('line',{x1:L,x2:L+w,y1:py,y2:py,stroke:y===0?'#888':'#e3e3e3'});el('text',{x:L-6,y:py+4,'text-anchor':'end'},y.toFixed(2));}
  if(!pts.length){el('text',{x:L+10,y:T+h/2},'no validated version yet');return;}
  const x=i=>L+(pts.length===1?w/2:i*w/(pts.length-1));
  pts.forEach((p,i)=>{const t=el('text',{x:x(i),y:T+h+16,'text-anchor':'middle',class:'x-label'},'v'+p.version);
    if(live&&p.version===live.version)t.setAttribute('font-weight','bold');});
  el('text',{x:L+w/2,y:H-2,'text-anchor':'middle'},'version');
  for(const [key,color,name] of [['hit_rate','#1f77b4','hit rate'],['mrr','#d9730d','MRR']]){
    el('polyline',{points:pts.map((p,i)=>`${x(i)},${T+h-p[key]*h}`).join(' '),fill:'none',stroke:color,'stroke-width':2,class:'series-'+key});
    pts.forEach((p,i)=>{const c=el('circle',{cx:x(i),cy:T+h-p[key]*h,r:3.5,fill:color,class:'point-'+key});
      const t=document.createElementNS(SVG,'title');t.textContent=`v${p.version} ${name} ${fixed(p[key])}`;c.append(t);});
  }
  el('rect',{x:L+w+14,y:T+4,width:12,height:3,fill:'#1f77b4'});el('text',{x:L+w+30,y:T+9},'hit rate');
  el('rect',{x:L+w+14,y:T+22,width:12,height:3,fill:'#d9730d'});el('text',{x:L+w+30,y:T+27},'MRR');
}
function metrics(m){
  const body=document.querySelector('#metrics tbody');body.innerHTML='';
  const known=new Set(METRICS.map(x=>x[0]));
  for(const [key,label,show] of METRICS.concat(Object.keys(m).filter(k=>!known.has(k)).map(k=>[k,k,x=>x]))){
    if(!(key in m))continue;const tr=document.createElement('tr');tr.id='metric-'+key;
    const th=document.createElement('th');th.textContent=label;tr.append(th,cell(show(m[key]),'num'));body.append(tr);}
}
function locks(held){
  const body=document.querySelector('#locks tbody');body.innerHTML='';
  if(!held.length){const tr=document.createElement('tr');const td=cell('no lock is held');td.colSpan=5;tr.append(td);body.append(tr);}
  for(const l of held){const tr=document.createElement('tr');
    [l.name,l.owner,when(l.since),when(l.expires)+(l.expired?' (expired)':''),l.owner_alive].forEach(x=>tr.append(cell(x)));body.append(tr);}
}
async function loadAirflow(){
  const r=await fetch('api/airflow');
  if(r.status===401){location.reload();return;}
  const a=r.ok?await r.json():{reindex_paused:null,runs:[],errors:[(await r.json()).detail]};
  const label=document.getElementById('reindex-paused'),toggle=document.getElementById('pause-toggle');
  if(a.reindex_paused==null){label.textContent='whether knowledge_reindex is paused is unknown (Airflow did not say)';toggle.hidden=true;}
  else{
    label.textContent=a.reindex_paused?'knowledge_reindex is PAUSED: scheduled reindexes do not run'
                                      :'knowledge_reindex is active: scheduled reindexes run';
    label.className=a.reindex_paused?'note':'';
    toggle.hidden=false;toggle.textContent=a.reindex_paused?'Unpause knowledge_reindex':'Pause knowledge_reindex';
    toggle.onclick=()=>setPaused(!a.reindex_paused);
  }
  document.getElementById('runs-errors').textContent=a.errors.join('; ');
  const body=document.querySelector('#runs tbody');body.innerHTML='';
  for(const run of a.runs){const tr=document.createElement('tr');
    const name=document.createElement('td');name.append(link(run.url,run.dag_run_id));
    tr.append(cell(run.dag_id),name,cell(run.run_type),cell(run.state,'state-'+run.state),cell(when(run.run_after),'when'),
              cell(when(run.start_date),'when'),cell(when(run.end_date),'when'));body.append(tr);}
}
async function setPaused(paused){
  const why=paused?'Scheduled reindexes stop until you unpause it (runbook step 3 after a rollback: the next run '+
    'would rebuild the bad change).':'Scheduled reindexes run again: is the bad change fixed in knowledge/?';
  if(!confirm(`${paused?'Pause':'Unpause'} knowledge_reindex? ${why}`))return;
  const r=await fetch('api/reindex-paused',{method:'POST',headers:{'Content-Type':'application/json'},body:JSON.stringify({paused})});
  const answer=await r.json();
  if(r.ok)say('ok',`knowledge_reindex is now ${answer.reindex_paused?'paused':'unpaused'}`);
  else say('bad',`pause refused: ${answer.detail}`);
  loadAirflow();
}
async function trigger(route,payload,what){
  const r=await fetch(route,{method:'POST',headers:{'Content-Type':'application/json'},body:JSON.stringify(payload)});
  const answer=await r.json();
  if(!r.ok){say('bad',`${what} refused: ${answer.detail}`);return;}
  follow(answer,what);
}
async function follow(run,what){
  const ref=`${run.dag_id} run ${run.dag_run_id}`;
  for(;;){
    const r=await fetch(`api/runs/${encodeURIComponent(run.dag_id)}/${encodeURIComponent(run.dag_run_id)}`);
    const now=r.ok?await r.json():null;
    const state=now?now.state:'unknown ('+(await r.json()).detail+')';
    if(state==='success'){say('ok',`${what}: ${ref} succeeded. `,link(run.url,'open the run in Airflow','run-link'));break;}
    if(state==='failed'){say('bad',`${what}: ${ref} FAILED; its task log says why, and what serves is shown above. `,
                             link(run.url,'open the run in Airflow','run-link'));break;}
    say('pending',`${what}: triggered ${ref}, now ${state}… `,link(run.url,'open the run in Airflow','run-link'));
    await new Promise(done=>setTimeout(done,1000));
  }
  load();loadAirflow();
}
function rollback(version,live){
  const reason=prompt(`Roll ${ALIAS} back from v${live} to v${version}? Reason:`);
  if(reason)trigger('api/rollback',{to_version:version,reason},`rollback to v${version}`);
}
function promoteShadow(v,live){
  const reason=prompt(`Promote shadow v${v.version} (${v.embed_model}, ${v.dim}-d, never served) to serve ${ALIAS}`+
    (live?` instead of v${live.version} (${live.embed_model}, ${live.dim}-d)`:'')+
    '? It is validated again first; readers then embed queries with this model. Reason:');
  if(reason)trigger('api/promote-shadow',{version:v.version,reason},`promotion of shadow v${v.version}`);
}
load();loadAirflow();setInterval(load,3000);setInterval(loadAirflow,5000);
</script></body></html>
"""
