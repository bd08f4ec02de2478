"""The hostname Airflow records on a task instance: `[core] hostname_callable = kb_reindex.airflow.hostname.worker_hostname`.

Several Celery workers on one machine would all record the machine's name; scripts/airflow.sh gives each its
own KB_WORKER_HOSTNAME (e.g. `myhost-worker-2`), so the task instance names the worker that ran it. Unset
(a worker alone on its host, every other Airflow component), it is the machine's FQDN, as Airflow's default.
"""

from __future__ import annotations

import os
import socket


def worker_hostname() -> str:
    return os.environ.get("KB_WORKER_HOSTNAME", "").strip() or socket.getfqdn()
