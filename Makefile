# Two commands do everything on a fresh machine (both install what they need, idempotently):
#   make test   - install into .venv/, then run the whole test suite
#   make demo   - install into .venv/, then run the demo training job
PY := .venv/bin/python

.PHONY: setup test demo bench dataset clean
setup:
	bash scripts/bootstrap.sh

test: setup
	$(PY) -m pytest tests

demo: setup
	$(PY) examples/demo.py

dataset: setup
	bash scripts/dataset.sh

bench: setup
	$(PY) benchmarks/overhead.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache
