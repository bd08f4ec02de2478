.PHONY: setup demo lint test bench clean airflow airflow-stop

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

lint: setup
	bash scripts/lint.sh

test: setup
	bash scripts/test.sh

bench: setup
	.venv/bin/python bench/run.py

airflow: setup
	bash scripts/airflow.sh

airflow-stop:
	bash scripts/airflow-stop.sh

clean:
	rm -rf .kb .airflow .kb-demo.log .airflow-migrate.log
