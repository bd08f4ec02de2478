"""Airflow's own login and authorization, as the page uses them.

Every route is behind Airflow's login, checked by Airflow's own API dependency (`get_user`: the auth manager
validates the JWT of the `Authorization: Bearer` header or the `_token` cookie): anonymous JSON requests get
401; the page and the report links redirect to the auth manager's login, as Airflow's UI does. An action
requires what Airflow's `requires_access_dag` requires, and the page asks the same question in advance to
hide what would be refused.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.responses import RedirectResponse, Response

from kb_reindex.web.airflow_api import DagIds


class AirflowAuth:
    """Airflow's checks, imported when the app is made (not at module import): only the API server needs them."""

    def __init__(self, dags: DagIds | None = None) -> None:
        self.dags = dags or DagIds()
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.auth.managers.models.resource_details import (
            DagAccessEntity,
            DagDetails,
        )
        from airflow.api_fastapi.core_api.security import (
            bearer_scheme,
            get_user,
            requires_access_dag,
        )
        from airflow.models.dag import DagModel

        self.get_user = get_user
        self._auth_manager = get_auth_manager
        self._bearer_scheme = bearer_scheme
        self._requires_access_dag = requires_access_dag
        self._run = DagAccessEntity.RUN
        self._dag_details = DagDetails
        self._team_name = DagModel.get_team_name

    def signed_in(self) -> list[Any]:
        return [Depends(self.get_user)]

    def may_trigger(self, dag_id: str) -> list[Any]:
        """The route's dependency: the caller may create runs of `dag_id`."""
        return [Depends(self._requires_access_dag("POST", self._run, param_dag_id=dag_id))]

    def may_edit(self, dag_id: str) -> list[Any]:
        """The route's dependency: the caller may change `dag_id` (pause it)."""
        return [Depends(self._requires_access_dag("PUT", param_dag_id=dag_id))]

    def allowed(self, user: Any, method: Literal["GET", "POST", "PUT", "DELETE"], dag_id: str,
                entity: Any = None) -> bool:
        """What requires_access_dag would answer, asked in advance: the page hides what would be refused."""
        return self._auth_manager().is_authorized_dag(
            method=method, access_entity=entity, user=user,
            details=self._dag_details(id=dag_id, team_name=self._team_name(dag_id)))

    def may(self, user: Any) -> dict[str, bool]:
        """The buttons the page shows this caller (the JSON edge: /api/status's `may`)."""
        dags = self.dags
        return {"rollback": self.allowed(user, "POST", dags.rollback, self._run),
                "promote_shadow": self.allowed(user, "POST", dags.promote_shadow, self._run),
                "pause_reindex": self.allowed(user, "PUT", dags.reindex), "freeze": self.allowed(user, "PUT", dags.reindex)}

    async def login_redirect(self, request: Request) -> Response | None:
        """A browser without a valid login is sent to the auth manager's login page and back, as Airflow's UI
        does (its API answers 401 and the UI redirects): a bare 401 would strand on-call on raw JSON."""
        try:
            await self.get_user(request, None, await self._bearer_scheme(request))
        except HTTPException as refused:
            if refused.status_code not in (401, 403):
                raise
            return RedirectResponse(self._auth_manager().get_url_login(next_url=str(request.url)))
        return None
