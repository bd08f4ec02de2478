"""The Airflow adapter: Airflow's names (`constants`), its Connections as Settings (`connections`), the task
bodies (`tasks`, thin wrappers over kb_reindex.pipeline turning typed values into XCom dicts), the failure
callback (`callbacks`), and the one definition of the reindex and migration DAGs (`factory`).

Only `constants` and `factory` are imported when a DAG file is parsed; they import the Airflow SDK and
nothing heavy. Nothing outside this package imports it: the CLI works without Airflow.
"""
