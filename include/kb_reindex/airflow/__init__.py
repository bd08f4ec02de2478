"""Floor 6, an edge: the Airflow adapter. May import every floor below (mostly `run`), never `cli` or `web`.

What it holds: Airflow's names (`constants`), its Connections as Settings (`connections`), the task
bodies (`tasks`, thin wrappers over kb_reindex.run.pipeline turning typed values into XCom dicts), the failure
callback (`callbacks`), the one definition of the reindex and migration DAGs (`factory`), and the `hostname` callable Airflow's config names.

Only `constants` and `factory` are imported when a DAG file is parsed; they import the Airflow SDK and
nothing heavy. Nothing outside this package imports it: the CLI works without Airflow.
"""
