# Shardline build. `make demo` and `make test` each do all set-up on a fresh machine.
PYTHON_SYS ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
# A CPU wheel of this torch lies on the build machines; an unpinned torch pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test files run on two processes, each file on one of them (module fixtures share a cluster):
# the integration tests mostly wait on daemons, so two cores take two at a time. TEST_JOBS=0: serial.
TEST_JOBS  ?= 2
XDIST      := $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

PROTOS     := $(wildcard protos/*.proto)
PB_STAMP   := services/pb/.generated

.PHONY: all venv protos system-deps lint test test-unit test-integration fuzz demo bench chaos clean distclean

all: protos

$(VENV)/.installed: pyproject.toml setup.py services/_copycheck.c
	$(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,hf]" "$(TORCH_SPEC)"
	touch $@

venv: $(VENV)/.installed

# The install already generated them (setup.py runs protos/generate.py); this regenerates after
# a .proto changes. Modules land in services/pb/ and import each other as shardline.services.pb.*
$(PB_STAMP): $(PROTOS) protos/generate.py $(VENV)/.installed
	$(PY) protos/generate.py
	touch $@

protos: $(PB_STAMP)

# systemd-analyze and Prometheus (promtool, server) for the operations tests.
system-deps:
	scripts/install-system-deps.sh

# ruff with the rule set in pyproject.toml ([tool.ruff]); the layering rules are a test
# (tests/unit/test_layering.py).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: protos system-deps lint
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-unit: protos
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: protos
	$(PY) -m pytest -q $(XDIST) tests/integration $(PYTEST_ARGS)

# Longer fuzzing than make test's bounded run of tests/fuzz (hypothesis profile "ci": a fixed seed,
# few examples): profile "fuzz", fresh seeds, FUZZ_EXAMPLES examples per property (the live-PS
# ones a quarter of that or more); a failure is kept in .hypothesis/ and tried first next time.
FUZZ_EXAMPLES ?= 3000
fuzz: protos
	SHARDLINE_FUZZ_PROFILE=fuzz SHARDLINE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -o timeout=3600 tests/fuzz $(PYTEST_ARGS)

demo: protos
	$(VENV)/bin/shardline up --ps 2 --workers 2 --job examples/demo_job.yaml

bench: protos
	$(PY) bench/run.py --out bench/results/latest.json
	$(PY) bench/checkpoint.py --out bench/results/checkpoint.json
	$(PY) bench/balance.py --out bench/results/balance.json
	$(PY) bench/rebalance.py --out bench/results/rebalance.json
	$(PY) bench/vs_ddp.py --out bench/results/vs_ddp.json
	$(PY) bench/vs_ddp.py --workload balanced --out bench/results/vs_ddp_balanced.json
	$(PY) bench/step_overhead.py --out bench/results/step_overhead.json
	$(PY) bench/many_tensors.py --out bench/results/many_tensors.json
	$(PY) bench/rack_cache.py --out bench/results/rack_cache.json
	$(PY) bench/rack_cache.py --subscribers --out bench/results/rack_cache_subscribers.json
	$(PY) bench/subscriber.py --out bench/results/subscriber.json
	$(PY) bench/ps_memory.py --model 25m --out bench/results/ps_memory.json
	$(PY) bench/vs_ddp.py --link 2gbit --ps 2 --ps-on-ranks --modes ddp,ddp_balanced,shardline_default,shardline,shardline_plain --out bench/results/vs_ddp_link.json

# Longer seeded fault schedules than make test's (tests/fault/chaos.py): kills, pauses, restarts
# of PS nodes, workers and the leading dispatcher while two workers train; nothing may be lost.
# The last run puts every daemon and worker on an emulated host and cuts the network too.
CHAOS_SEEDS ?= 1,2,3
CHAOS_FAULTS ?= 40
chaos: protos system-deps
	$(PY) tests/fault/chaos.py --seeds $(CHAOS_SEEDS) --faults $(CHAOS_FAULTS) --out bench/results/chaos.json
	$(PY) tests/fault/chaos.py --seeds 4 --faults $(CHAOS_FAULTS) --rebalance --out bench/results/chaos_rebalance.json
	$(PY) tests/fault/chaos.py --seeds 5,6 --faults $(CHAOS_FAULTS) --partitions --out bench/results/chaos_partitions.json
	$(PY) tests/fault/chaos.py --seeds 7 --faults $(CHAOS_FAULTS) --host-aggregation --out bench/results/chaos_host_aggregation.json

clean:
	rm -rf services/pb/*_pb2*.py services/pb/*_pb2*.pyi $(PB_STAMP) .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info build dist
