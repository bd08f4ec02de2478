.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/test.sh

bench: setup
	.venv/bin/python bench/run.py

clean:
	rm -rf .kb .airflow .kb-demo.log .airflow-migrate.log
