# Two commands for a newcomer: `make serve` (set up + run the main job) and `make test`.
.PHONY: setup serve demo test

setup:
	bash scripts/bootstrap.sh

demo: setup
	.venv/bin/python -m kvp_vllm.demo --budget 128

serve: demo

test: setup
	.venv/bin/python -m pytest -q tests
