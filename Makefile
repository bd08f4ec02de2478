.PHONY: setup setup-dev demo lint test bench clean airflow airflow-stop

# the runtime (what the demo and make airflow need)
setup:
	bash scripts/setup.sh

# the runtime and the test tools (pytest, mypy, ruff, moto, selenium, the benchmark's peers)
setup-dev:
	KB_SETUP_EXTRAS=airflow,dev,s3 bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

lint: setup-dev
	bash scripts/lint.sh

test: setup-dev
	bash scripts/test.sh

bench: setup-dev
	.venv/bin/python bench/run.py

airflow: setup
	bash scripts/airflow.sh

airflow-stop:
	bash scripts/airflow-stop.sh

clean:
	rm -rf .kb .airflow .kb-demo.log .airflow-migrate.log .airflow-pools.json
