# Two commands on a fresh machine: `make run` and `make test`. Everything they
# need (virtualenv, Mosquitto, Cassandra 5.0 from Maven Central, the schema) is
# set up here, idempotently. State (data, logs, pids) lives in .state/ (git-ignored).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
GATEWAY := $(VENV)/bin/gateway
export STATE_DIR ?= $(CURDIR)/.state
# Settings for `make run`: the local services plus a small simulated fleet.
SIM_DEVICES ?= 50
SIM_RATE ?= 20

.PHONY: help venv up down status run test lint schema bench bench-models bench-rare bench-api clean

help:
	@echo "make run     set up everything, run the gateway in the foreground with a small simulated fleet"
	@echo "make test    set up everything and run the tests against the real broker and Cassandra"
	@echo "make test-quick  the same without the fault tests (which restart the services) and slow ones"
	@echo "make bench-models  measure the state-view data models (about 30 min)"
	@echo "make up      start Mosquitto and Cassandra (installs/resolves what is missing), apply the schema"
	@echo "make down    stop the Mosquitto and Cassandra processes this project started"
	@echo "make status  show what is running"
	@echo "make lint    ruff + mypy --strict"

# uv (from PyPI) installs the same packages as pip in seconds instead of about a
# minute, a tenth of make test's budget on a fresh clone.
$(VENV)/.installed: pyproject.toml setup.py
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q uv
	GATEWAY_COMPILE=0 $(VENV)/bin/uv pip install -q --python $(VPY) -e '.[test,compile]'
	@touch $@

# The per-message modules compiled with mypyc (setup.py: about 40 s here),
# again whenever a source changes: a compiled module whose source changed
# will not load. GATEWAY_COMPILE=0 removes them: everything runs as plain
# Python. The stamp names the choice, so switching it rebuilds.
GATEWAY_COMPILE ?= 1
CLEAR_COMPILED := find gateway -name '*.so' -delete; rm -f gateway/compiled.txt
$(VENV)/.compiled-$(GATEWAY_COMPILE): $(VENV)/.installed $(wildcard gateway/*.py gateway/*/*.py)
	@rm -f $(VENV)/.compiled-*
	@$(CLEAR_COMPILED)
	@if [ "$(GATEWAY_COMPILE)" = 1 ]; then \
		echo "compiling the per-message modules with mypyc (setup.py; GATEWAY_COMPILE=0 skips this)"; \
		GATEWAY_COMPILE=1 $(VENV)/bin/uv pip install -q --python $(VPY) \
			--no-build-isolation --no-deps --reinstall-package mqtt-cassandra-gateway -e . \
		|| { $(CLEAR_COMPILED); exit 1; }; \
	fi
	@touch $@

venv: $(VENV)/.compiled-$(GATEWAY_COMPILE)

# CASSANDRA_NODES=3 make up: a three-node cluster on 127.0.0.1..3 instead of
# the single node (cassandra/cassandra.sh), and the keyspace with replication
# factor 3 across the three contact points (unless GATEWAY_* says otherwise).
ifneq ($(filter-out 1,$(CASSANDRA_NODES)),)
export GATEWAY_CASSANDRA__REPLICATION_FACTOR ?= 3
export GATEWAY_CASSANDRA__CONTACT_POINTS ?= $(shell seq -s, -f '127.0.0.%g' 1 $(CASSANDRA_NODES))
endif

# Compiling (about 40 s on a fresh clone) and starting the services (Cassandra
# answers about 8 s after it starts) run at once; `make test` also installs
# the browser and starts the test brokers meanwhile. Every line names what it
# is about and is printed as it comes (no --output-sync: that held a slow
# step's progress back until it ended).
PARALLEL := $(MAKE) -s -j4
up:
	@$(PARALLEL) venv services
	@$(GATEWAY) schema apply

# Debian packages go in one at a time (apt holds a lock): Mosquitto's first,
# then the browser's (only the tests need it).
.PHONY: packages
packages:
	@bash mosquitto/mosquitto.sh install

# Mosquitto and Cassandra, without the schema (up applies it).
.PHONY: services
services: $(VENV)/.installed packages
	@bash mosquitto/mosquitto.sh start
	@bash cassandra/cassandra.sh start
	@bash cassandra/cassandra.sh wait

# Every process is told at once and each is waited for (a broker saves its
# store, a node drains: seconds each).
down:
	-@bash mosquitto/mosquitto.sh stop & \
	for d in $(STATE_DIR)/test-broker-*; do \
		[ -d "$$d" ] && { STATE_DIR=$$d bash mosquitto/mosquitto.sh stop & }; \
	done; \
	if [ -z "$(filter-out 1,$(CASSANDRA_NODES))" ] && ls $(STATE_DIR)/run/cassandra-node*.pid >/dev/null 2>&1; then \
		echo "(a three-node cluster left running: stopping it too)"; \
		CASSANDRA_NODES=3 bash cassandra/cassandra.sh stop & \
	fi; \
	bash cassandra/cassandra.sh stop; \
	wait; true

# Exits non-zero when Mosquitto or Cassandra is not running (each line is
# still printed); the browser is only the tests' concern, so it just reports.
status:
	@rc=0; \
	bash mosquitto/mosquitto.sh status || rc=1; \
	bash cassandra/cassandra.sh status || rc=1; \
	bash tests/browser/chromium.sh status || true; \
	exit $$rc

schema: venv
	$(GATEWAY) schema apply

run: up
	@$(VPY) -m gateway.tools.demo --devices $(SIM_DEVICES) --rate $(SIM_RATE)

# The browser the page's tests drive (Debian's chromium); only the tests need it.
.PHONY: browser
browser: packages
	@bash tests/browser/chromium.sh install

# The suite runs in TEST_WORKERS pytest-xdist workers (a test file per worker
# at a time): most of its time is waiting on the services, not CPU (3 workers
# took 3.5 min here where 2 took 4.2 and 4 gained nothing, at first; with 930
# tests, 4 took 279 s where 3 took 375, one run each on 2026-11-27). Worker N talks to a
# Mosquitto of its own on port 1883 + N (worker 0 to the one `make up`
# starts), so no worker's gateway receives another's messages; Cassandra is
# shared (fresh tenant names keep tests apart). The fault tests restart the
# shared services, so they run afterwards, alone; then the three-node
# cluster's (below; TEST_CLUSTER=0 leaves them out). Exit status 5 (nothing
# selected, e.g. PYTEST_ARGS names a file with no fault tests) is not a failure.
# A worker that crashes (a native fault) ends the suite at once, naming the
# test it ran (XDIST_ARGS): with --dist loadfile, pytest-xdist 3.8 restarting
# it hung the whole run, every worker idle (seen once in a clean-clone .ci/run; a test with
# a deliberate segfault hangs it every time). The 15 slowest tests are
# listed at the end: `make test` must stay under 10 minutes on a clean clone.
TEST_WORKERS ?= 4
# --no-loadscope-reorder: the files in tests/conftest.py's order, the longest
# first (xdist's own order puts the files of most tests first, so the few long
# tests of small files ran last, one worker alone for over a minute; the
# total was about the same, 308 s against 312, one run each).
XDIST_ARGS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 \
	--durations=15
TEST_CLUSTER ?= 1
.PHONY: test-brokers
test-brokers: packages
	@for i in $$(seq 1 $$(( $(TEST_WORKERS) - 1 ))); do \
		MQTT_PORT=$$((1883 + i)) STATE_DIR=$(STATE_DIR)/test-broker-$$i bash mosquitto/mosquitto.sh start || exit 1; \
	done

# Each failed test's final error and last warnings are printed again at the
# very end (TEST_DIGEST, tests/conftest.py): CI shows the end of the output.
export TEST_DIGEST := $(STATE_DIR)/logs/failed-tests.txt

# What the tests need, at once where it can be (PARALLEL above).
.PHONY: test-setup
test-setup:
	@$(PARALLEL) venv services browser test-brokers
	@$(GATEWAY) schema apply

test: test-setup
	@rc=0; rm -f $(TEST_DIGEST); \
	$(VPY) -m pytest $(XDIST_ARGS) -m "not faults and not cluster" $(PYTEST_ARGS) || rc=$$?; \
	[ $$rc = 5 ] && rc=0; \
	if [ "$(TEST_CLUSTER)" != 0 ]; then \
		{ CASSANDRA_NODES=3 bash cassandra/cassandra.sh start-others && $(VPY) -m tests.cluster.prepare; } \
			>$(STATE_DIR)/cluster-start.log 2>&1 & others=$$!; \
	fi; \
	$(VPY) -m pytest -m "faults and not cluster" $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	if [ "$(TEST_CLUSTER)" != 0 ]; then \
		wait $$others || rc=1; cat $(STATE_DIR)/cluster-start.log; \
		$(MAKE) -s test-cluster || rc=$$?; \
	fi; \
	if [ $$rc != 0 ] && [ -s $(TEST_DIGEST) ]; then \
		echo "---- failed tests: final error, last warnings logged (whole reports above)"; \
		cat $(TEST_DIGEST); \
	fi; \
	exit $$rc

# The three-node cluster's fault tests (tests/cluster/; about 2 min at the end
# of `make test`: 1 min 25 s of pytest plus starting node 1 and stopping): the
# single node is stopped, three nodes start on 127.0.0.1..3 one at a time
# (768 MB heap each), the tests run, the cluster stops, and the single node is
# started again (not waited for: `make up` waits when it is next needed).
# `make test` starts the cluster's nodes 2 and 3 while the fault tests run
# (they don't need 127.0.0.1) and applies the tests' keyspace through them
# (tests/cluster/prepare.py), so only node 1 is left to start here.
.PHONY: test-cluster
test-cluster: venv
	@bash cassandra/cassandra.sh stop
	@CASSANDRA_NODES=3 $(MAKE) -s services
	@rc=0; CASSANDRA_NODES=3 $(VPY) -m pytest -m cluster tests/cluster $(PYTEST_ARGS) || rc=$$?; \
	CASSANDRA_NODES=3 bash cassandra/cassandra.sh stop; \
	bash cassandra/cassandra.sh start >/dev/null; \
	exit $$rc

.PHONY: test-quick
test-quick: test-setup
	$(VPY) -m pytest $(XDIST_ARGS) -m "not faults and not slow and not cluster" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check gateway tests bench setup.py
	$(VENV)/bin/ruff format --check gateway tests bench setup.py
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict tests
	$(VENV)/bin/mypy --strict bench

clean: down
	rm -rf $(STATE_DIR)

# End-to-end benchmark (~13 min; ~7 with BENCH_ARGS="--skip overload,scaling,states"):
# gateway vs broker/Cassandra ceilings, a naive bridge and Node-RED. Results in
# bench/results/. BENCH_ARGS="--help" for options.
bench: up
	@$(VPY) -c "import matplotlib" 2>/dev/null || $(VPY) -m pip install -q -e '.[bench]'
	$(VPY) bench/run.py $(BENCH_ARGS)

# The state-view data models (issue: the state view), measured on the real
# Cassandra: the article's Solutions 1-5 plus SAI. Writes bench/results/models.json.
bench-models: up
	$(VPY) bench/models.py $(BENCH_ARGS)

# Case 1 of the state view through the real gateway (~15 min): bench/results/rare_state.*
bench-rare: up
	$(VPY) bench/rare_state.py $(BENCH_ARGS)

# Devices leaving a large state in device-id order (~3 min): the first page's
# tombstones and latency with rows clustered by device id (before) and by device
# hash, then id (now). Writes bench/results/ordered_departure.{json,md}.
.PHONY: bench-ordered
bench-ordered: up
	$(VPY) bench/ordered_departure.py $(BENCH_ARGS)

# The receive path alone (no database): µs of CPU per MQTT message for our
# connection.py, paho and aiomqtt 3. Writes bench/results/receive.{json,md}.
.PHONY: bench-receive
bench-receive: up
	$(VPY) bench/receive.py $(BENCH_ARGS)

# Read API under load: 20 clients at 1k/10k/100k devices through `gateway serve`.
# Writes bench/results/read_api.{json,md}.
bench-api: up
	$(VPY) bench/read_api.py $(BENCH_ARGS)

# The gateway with Cassandra 0/20/50/100 ms round trip away (through a delaying
# proxy), adaptive in-flight limit vs the old fixed 64, lz4 on the Python driver
# (~8 min). Writes bench/results/slow_link.{json,md}.
.PHONY: bench-link
bench-link: up
	$(VPY) bench/slow_link.py $(BENCH_ARGS)

# One gateway instance on two tenant shards vs two instances with one shard
# each, the same backlog, interleaved runs (~6 min). Writes
# bench/results/instances.{json,md}.
.PHONY: bench-instances
bench-instances: up
	$(VPY) bench/instances.py $(BENCH_ARGS)

# What the spool costs (~8 min): spool off and on alternately, 3 pairs: a
# drain's CPU per message and msg/s, latency and bytes written to disk at
# 100 msg/s. Writes bench/results/spool_cost.{json,md}.
.PHONY: bench-spool
bench-spool: up
	$(VPY) bench/spool_cost.py $(BENCH_ARGS)

# The Python driver against acsylla, before the packing (9cb0ef7) and now (~20 min): CPU
# per message of the same drain, in rounds. Writes bench/results/python_driver.{json,md}.
.PHONY: bench-python-driver
bench-python-driver: up
	$(VPY) bench/python_driver.py $(BENCH_ARGS)
