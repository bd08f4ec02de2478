"""Floor 6, an edge: the "Knowledge index" page. May import every floor below, never `cli` or `airflow`.

The page is a FastAPI app the Airflow plugin mounts on the API server.

It shows what the alias serves, every version with its scores (table and chart) and, for a failed one, why;
build progress, the state DB's runs, held locks and notes, the freeze, the alias history, the metrics and the
reports; and, from Airflow, whether our DAGs are paused and their recent runs. It offers a rollback button
(versions that served and pass the structural check), a separate shadow promotion (versions never served), a
pause toggle for the reindex, and a freeze (Pause/Unfreeze) of the alias. The status is read-only
(kb_reindex.run.pageview: never creates a state DB; answers from the state DB alone while a build holds the local
Qdrant store).

Every route is behind Airflow's login, checked by Airflow's own API dependency (`get_user`: the auth manager
validates the JWT of the `Authorization: Bearer` header or the `_token` cookie): anonymous JSON requests get
401; the page and the report links redirect to the auth manager's login, as Airflow's UI does. The buttons are
shown only to a caller Airflow would allow, and move nothing themselves: the caller must be allowed to act on
the DAG (Airflow's `requires_access_dag`), and the action goes through Airflow's REST API *with the caller's
own token*, so Airflow's authorization decides twice. Runs and the paused flags are read the same way, as the
caller. A trigger carries the live version on-call confirmed ("vX -> vY") and is refused once the alias has
moved; a paused on-call DAG is unpaused first only when on-call agreed in the dialog.

Modules: `app` (the factory), `views` (the routes that read), `actions` (the routes that act), `context` (what
they share: the settings, the typed status, errors.classify as HTTP answers), `airflow_api` (Airflow's REST API
as the caller), `auth` (Airflow's login and authorization checks).
"""
