"""A knowledge base in a bucket under the real scheduler (scripts/airflow.sh on a free port, LocalExecutor): the
knowledge_reindex DAG reads `s3://bucket/docs` from moto's S3 server through Airflow's ObjectStoragePath, with
the credentials and endpoint of the Airflow Connection `aws_default` alone (the tasks' environment holds no AWS
variable, and the server refuses every other key)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_local_airflow import BIN, TEST_STACK_ENV, LocalAirflow, free_port, kb
from kb_reindex.testing.s3_server import REGION, MotoS3Server

pytestmark = pytest.mark.airflow
CONNECTION_KEY = "kb-airflow-connection"


def test_the_dag_reads_a_bucket_through_its_aws_connection(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(REPO / "knowledge", project / "knowledge")
    with MotoS3Server(access_keys={CONNECTION_KEY}) as s3:
        import boto3

        client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=CONNECTION_KEY,
                              aws_secret_access_key="kb-airflow-secret", region_name=REGION)
        client.create_bucket(Bucket="kb-airflow")
        for path in sorted((project / "knowledge" / "docs").glob("*.md")):
            client.put_object(Bucket="kb-airflow", Key=f"docs/{path.name}", Body=path.read_bytes())
        client.put_object(Bucket="kb-airflow", Key="docs/售后 指南/退货 规则.md",
                          Body="# 退货规则\n\n签收后七天内可申请无理由退货。\n".encode())
        s3.clear_requests()

        port = free_port()
        connection = {"conn_type": "aws", "login": CONNECTION_KEY, "password": "kb-airflow-secret",
                      "extra": {"endpoint_url": s3.url, "region_name": REGION}}
        env = {name: value for name, value in os.environ.items() if not name.startswith(("AIRFLOW", "AWS_"))}
        env.update(AIRFLOW_HOME=str(tmp_path / "airflow-home"), KB_PROJECT_ROOT=str(project),
                   KB_AIRFLOW_PORT=str(port), PATH=f"{BIN}:{env.get('PATH', '')}", KB_EMBEDDER="hashing",
                   KB_KNOWLEDGE_DIR="s3://kb-airflow/docs", AIRFLOW_CONN_AWS_DEFAULT=json.dumps(connection),
                   **TEST_STACK_ENV, KB_SMALL_RUN_POINTS="1000")  # the product's default: one task for a small plan
        try:
            started = subprocess.run(["bash", str(REPO / "scripts" / "airflow.sh")], env=env, capture_output=True,
                                     text=True, timeout=240)
            assert started.returncode == 0, started.stdout + started.stderr
            airflow = LocalAirflow(f"http://127.0.0.1:{port}", tmp_path / "airflow-home", env)
            run_id = airflow.trigger("knowledge_reindex")
            airflow.wait_for_success("knowledge_reindex", run_id, 240)
        finally:
            stopped = subprocess.run(["bash", str(REPO / "scripts" / "airflow-stop.sh")], env=env,
                                     capture_output=True, text=True, timeout=120)
            assert stopped.returncode == 0, stopped.stderr
        requests = s3.requests()

    from kb_reindex.services.state.store import StateStore

    status = kb(env, "status")
    assert status["live"]["version"] == 1 and status["problems"] == [], status
    state = StateStore(f"sqlite:///{project / '.kb' / 'state.db'}", create=False)
    try:
        live = state.live_version("mall_knowledge")
        assert "售后 指南/退货 规则" in state.manifest_document_hashes(live.id)
    finally:
        state.dispose()
    read = {r.key for r in requests if r.object_get}
    assert "docs/售后 指南/退货 规则.md" in read and "docs/coupon-rules.md" in read, read
    assert requests and {r.access_key for r in requests} == {CONNECTION_KEY}, "signed with the Connection's key"
    assert all(r.status == 200 for r in requests), [r for r in requests if r.status != 200]
