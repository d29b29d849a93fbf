# keras_ring: `make demo` and `make test` work on a fresh clone with Python 3.11+, pip and a
# C++ compiler. Everything else (TensorFlow, Keras, mpi4py, the mpich wheel's mpirun) is
# installed into .venv from PyPI.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
STAMP := $(VENV)/.keras_ring-installed
CXX ?= g++
# Python writes the bytecode of keras_ring and of the tests once and every later process reads
# it: where PYTHONDONTWRITEBYTECODE is set (these workplace machines; pip compiles what it
# installs, but keras_ring is installed editable), each of the hundreds of processes the
# suites start compiled them again, and each rank of an mpirun'd pytest rewrote every test
# module's asserts (a 2-rank collection of tests/parallel: 12.7 CPU-s, 9.5 with the bytecode).
unexport PYTHONDONTWRITEBYTECODE
# Keep TensorFlow's start-up chatter out of test logs.
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Short bounds in tests: a bug shows up as a failure within a minute, never as a hang.
TEST_ENV := KERAS_RING_TIMEOUT_SECONDS=60
# An outer bound per mpirun, in case a test wedges outside keras_ring's own bounded waits.
GUARD := timeout --signal=TERM --kill-after=30 900
# The unit suite is one pytest of ~720 tests (many start processes): 12 minutes on a 2-core
# AMD EPYC VM (15.5 before its benchmark and build tests were cut), close to the 900 s above,
# so its bound is longer.
GUARD_UNIT := timeout --signal=TERM --kill-after=30 1800
# Most of the unit suite's time is spent waiting (on the jobs it starts, on the timeouts its
# fault tests provoke): alone, one pytest kept 1.15 of 2 cores busy. Two xdist workers, each
# taking a whole module at a time (a module's tests share jobs and fixtures), fill the idle
# core. Tests that check /dev/shm run their jobs in one of their own (private_shm.py), so
# the other worker's jobs cannot pass for a leak. Modules go out in the order that
# tests/unit/conftest.py collects them: the long ones first.
UNIT_WORKERS := -n 2 --dist loadscope --no-loadscope-reorder

CORE_SRC := $(wildcard keras_ring/ops/cc/core/*.cc keras_ring/ops/cc/core/nccl/*.cc)
CORE_HDR := $(wildcard keras_ring/ops/cc/core/*.h keras_ring/ops/cc/core/nccl/*.h)
CPP_TEST_SRC := $(wildcard keras_ring/ops/cc/tests/*.cc)
OPS_SRC := $(CORE_SRC) $(CORE_HDR) $(wildcard keras_ring/ops/cc/tf/*)
OPS_LIB := keras_ring/ops/_keras_ring_ops.so

.PHONY: venv venv-oldest ops test test-cpp test-cpp-asan test-unit test-parallel test-elastic test-multihost test-oldest demo \
	bench \
	bench-multihost clean

venv: $(STAMP) $(OPS_LIB)

# pip byte-compiles what it installs (30 of the 100 s of this install on 2 cores). Keep it:
# where PYTHONDONTWRITEBYTECODE is set (it is on these workplace machines) nothing else
# would, and every process would compile TensorFlow's modules again on import (a unit suite
# took 1305 s instead of ~950 s that way).
$(STAMP): pyproject.toml setup.py
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

# The builder skips the work when the library matches this TensorFlow and these sources.
$(OPS_LIB): $(STAMP) $(OPS_SRC)
	$(VPY) -m keras_ring.ops --if-needed
	touch $@

ops: $(OPS_LIB)

# The C++ tests: one object per source (dependencies on headers from -MMD), compiled by a
# parallel sub-make, so the ~50 files take half the 3 minutes on 2 cores that one g++ took.
NPROC := $(shell nproc 2>/dev/null || echo 2)
CPP_TEST_OBJ := $(patsubst keras_ring/ops/cc/%.cc,build/obj/%.o,$(CORE_SRC) $(CPP_TEST_SRC))

build/obj/%.o: keras_ring/ops/cc/%.cc
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O2 -g -Wall -Wextra -Werror -pthread -MMD -MP -c -o $@ $<

-include $(CPP_TEST_OBJ:.o=.d)

build/core_tests: $(CPP_TEST_OBJ)
	$(CXX) -pthread -o $@ $(CPP_TEST_OBJ) -ldl

test-cpp:
	$(MAKE) --no-print-directory -j$(NPROC) build/core_tests
	./build/core_tests

# The same tests under AddressSanitizer and UndefinedBehaviorSanitizer (leaks checked too):
# not part of `make test`, whose CI budget the ~8 minute build on 2 cores would eat; run it
# after changing the core. (Session 35: 163 passed with no report; ThreadSanitizer ran 160
# clean, its own _exit hangs in the 3 FailureExit tests that hold the stdio locks.)
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
ASAN_OBJ := $(patsubst keras_ring/ops/cc/%.cc,build/asan/%.o,$(CORE_SRC) $(CPP_TEST_SRC))

build/asan/%.o: keras_ring/ops/cc/%.cc
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -g -Wall -Wextra -Werror -pthread $(ASAN_FLAGS) -MMD -MP -c -o $@ $<

-include $(ASAN_OBJ:.o=.d)

build/asan/core_tests: $(ASAN_OBJ)
	$(CXX) -pthread $(ASAN_FLAGS) -o $@ $(ASAN_OBJ) -ldl

test-cpp-asan:
	$(MAKE) --no-print-directory -j$(NPROC) build/asan/core_tests
	ASAN_OPTIONS=detect_leaks=1:detect_stack_use_after_return=1 \
	UBSAN_OPTIONS=print_stacktrace=1 KR_TEST_WATCHDOG_SECONDS=240 ./build/asan/core_tests

test-unit: venv
	$(TEST_ENV) $(GUARD_UNIT) $(VPY) -m pytest tests/unit -q $(UNIT_WORKERS)

# Each whole module set runs under one mpirun per world size: TensorFlow starts once per rank.
# At 2 ranks over shared memory: everything. Without the Keras modules (three quarters of a
# run's time on 2 cores; the Keras layer never sees the transport) and the scaling and
# randomized modules (the same arithmetic as over shared memory; the next run): at 2 ranks
# over TCP between ranks of one host (the path of multi-host jobs). Then the randomized suite
# at 4 ranks over TCP with 8 KiB segments, so its large tensors cross segment boundaries. Last,
# the collectives, process sets and threads at 5 ranks over shared memory: a world that is no
# power of two (recursive doubling folds a rank in, ring segments split unevenly, sets of 3
# and 2), larger than the others, through real processes. The modules without Keras also run
# at 4 ranks on two hosts of two (test-multihost), so no run of their own at 4 on one host.
test-parallel: venv
	$(TEST_ENV) $(GUARD) $(MPIRUN) -np 2 $(VPY) -m pytest tests/parallel -q
	$(TEST_ENV) KERAS_RING_SHM=0 $(GUARD) $(MPIRUN) -np 2 $(VPY) -m pytest tests/parallel -q \
		--ignore-glob='*/test_keras_*.py' --ignore=tests/parallel/test_randomized.py \
		--ignore=tests/parallel/test_scaling.py
	$(TEST_ENV) KERAS_RING_SHM=0 KERAS_RING_SEGMENT_BYTES=8192 $(GUARD) $(MPIRUN) -np 4 \
		$(VPY) -m pytest tests/parallel/test_randomized.py -q
	$(TEST_ENV) $(GUARD) $(MPIRUN) -np 5 $(VPY) -m pytest -q $(addprefix tests/parallel/, \
		test_collectives.py test_scatter.py test_randomized.py test_mismatch.py test_join.py \
		test_process_sets.py test_threads.py test_gradients.py test_errors_in_training.py)

# Elastic jobs through keras-ring-run: a worker killed, the world grown back, a failing
# host blacklisted, below --min-np (each test starts its own job).
test-elastic: venv
	$(GUARD) $(VPY) -m pytest tests/elastic -q

# Hosts made of network namespaces (needs root, as in CI): the parallel suite on 2 hosts x 2
# ranks under mpirun, keras-ring-run -H, uneven hosts, faults and misconfigurations. It took
# 13 minutes on a 2-core AMD EPYC VM when the parallel suite ran whole there: the unit
# suite's bound. The parallel suite's job is half the time and busy; the other tests mostly
# wait (on timeouts, a pulled cable, elastic rejoins), so a second worker takes them beside
# it. Each test's cluster is namespaces of its own; leak checks look at their job's segments.
test-multihost: venv
	$(GUARD_UNIT) $(VPY) -m pytest tests/multihost -q -n 2 --dist worksteal

# The oldest supported TensorFlow + Keras (tests/versions/oldest.txt) in a venv of its own,
# its op library in its own directory: the collectives and the Keras integration at 2 ranks,
# then switching one library directory between the two TensorFlows.
OLD_VENV := .venv-oldest
OLD_STAMP := $(OLD_VENV)/.keras_ring-installed
OLD_OPS_DIR := $(CURDIR)/build/ops-oldest
OLD_OPS := build/ops-oldest/_keras_ring_ops.so
OLD_ENV := $(TEST_ENV) KERAS_RING_OPS_DIR=$(OLD_OPS_DIR)
OLD_TESTS := $(addprefix tests/parallel/,test_collectives.py test_gradients.py test_scatter.py \
	test_keras_equivalence.py test_keras_optimizer.py test_keras_save_load.py \
	test_keras_lazy_models.py test_keras_callbacks.py test_keras_horovod_api.py \
	test_keras_sync_batch_norm.py test_keras_weight_check.py test_keras_custom_train_step.py \
	test_mismatch.py test_keras_float8.py test_keras_model_config.py)

# After the main venv's install (order only): two editable installs at once would both write
# the project's egg-info.
$(OLD_STAMP): pyproject.toml setup.py tests/versions/oldest.txt | $(STAMP)
	test -x $(OLD_VENV)/bin/python || $(PYTHON) -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLD_VENV)/bin/python -m pip install -q -c tests/versions/oldest.txt -e '.[mpi]' \
		tensorflow keras pytest hypothesis
	touch $@

$(OLD_OPS): $(OLD_STAMP) $(OPS_SRC)
	KERAS_RING_OPS_DIR=$(OLD_OPS_DIR) $(OLD_VENV)/bin/python -m keras_ring.ops --if-needed
	touch $@

venv-oldest: $(OLD_STAMP) $(OLD_OPS)

test-oldest: venv venv-oldest
	$(OLD_ENV) $(GUARD) $(OLD_VENV)/bin/mpirun -np 2 $(OLD_VENV)/bin/python -m pytest $(OLD_TESTS) -q
	KERAS_RING_OTHER_PYTHON=$(CURDIR)/$(OLD_VENV)/bin/python $(GUARD) $(VPY) -m pytest tests/versions -q

# First the C++ tests, and meanwhile the venv and its op library: the C++ tests spend most of
# their 75 s waiting on the timeouts they provoke (34% of a core), pip on downloads. Then the
# unit suite beside the oldest TensorFlow's venv and suite: the unit suite keeps 1.4 of 2
# cores busy (its jobs wait on the timeouts and failures they provoke), and the other 0.6 run
# the 2-rank job (session 37, one 2-core VM: 591 s together, 537 + 127 s one after the
# other). The oldest venv's install must wait for the first's (both write the egg-info), so
# built in the first step it held up the unit suite. Each target's output comes out whole.
# Then the other suites, one at a time: each keeps both cores busy.
test:
	$(MAKE) --no-print-directory --output-sync=target -j3 test-cpp venv
	$(MAKE) --no-print-directory --output-sync=target -j2 test-unit test-oldest
	$(MAKE) --no-print-directory test-parallel test-elastic test-multihost

demo: venv
	$(GUARD) $(MPIRUN) -np 2 $(VPY) examples/keras_fit.py

# The memory-bound floor of a 2-rank allreduce on this machine, the yardstick for the tables.
build/allreduce_floor: benchmarks/allreduce_floor.cc $(CORE_SRC) $(CORE_HDR)
	mkdir -p build
	$(CXX) -std=c++17 -O3 -Wall -Wextra -Werror -Ikeras_ring/ops/cc -o $@ $< \
		keras_ring/ops/cc/core/copy.cc keras_ring/ops/cc/core/reduce.cc keras_ring/ops/cc/core/common.cc

# The host-side cost of one NCCL collective (1 and 64 in flight), through the fake GPU of the
# C++ tests: no GPU needed. benchmarks/gpu_check.sh measures the same on a GPU.
NCCL_FAKE_SRC := keras_ring/ops/cc/tests/nccl_fake.cc keras_ring/ops/cc/tests/nccl_fake_world.cc
build/nccl_host_cost: benchmarks/nccl_host_cost.cc $(CORE_SRC) $(CORE_HDR) $(NCCL_FAKE_SRC)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -pthread -Ikeras_ring/ops/cc -o $@ $< \
		$(CORE_SRC) $(NCCL_FAKE_SRC) -ldl

# Opening a collective against world size: threads over the local transport, up to 32 ranks.
build/agreement: benchmarks/agreement.cc $(CORE_SRC) $(CORE_HDR)
	mkdir -p build
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -pthread -Ikeras_ring/ops/cc -o $@ $< \
		$(CORE_SRC) -ldl

# keras_ring over TCP is set against MPICH over TCP too (its own shared memory off).
MPICH_TCP = MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self

bench: venv build/allreduce_floor build/nccl_host_cost build/agreement
	./build/allreduce_floor
	./build/nccl_host_cost
	./build/nccl_host_cost 2 2000 1024 64 3 0 100
	./build/agreement 32
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/agreement.py
	$(GUARD) $(MPIRUN) -np 4 $(VPY) benchmarks/agreement.py
	$(GUARD) $(MPIRUN) -np 8 $(VPY) benchmarks/agreement.py
	KERAS_RING_SHM=0 $(GUARD) $(MPIRUN) -np 8 $(VPY) benchmarks/agreement.py
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/in_graph.py
	$(GUARD) $(MPIRUN) -np 4 $(VPY) benchmarks/in_graph.py --max-bytes 16777216
	$(MPICH_TCP) KERAS_RING_SHM=0 $(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/in_graph.py --max-bytes 67108864
	$(MPICH_TCP) KERAS_RING_SHM=0 $(GUARD) $(MPIRUN) -np 4 $(VPY) benchmarks/in_graph.py --max-bytes 16777216
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/allreduce.py
	$(GUARD) $(MPIRUN) -np 4 $(VPY) benchmarks/allreduce.py --max-bytes 16777216
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/grouped.py
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/scatter.py
	$(GUARD) $(MPIRUN) -np 4 $(VPY) benchmarks/scatter.py --max-bytes 16777216
	$(GUARD) $(VPY) benchmarks/keras_scaling.py --ranks 2
	$(GUARD) $(VPY) benchmarks/elastic_reset.py --repeat 3
	$(GUARD) $(MPIRUN) -np 2 $(VPY) benchmarks/timeline_memory.py --collectives 200000 --trace build/timeline_bench.json
	$(GUARD) $(VPY) benchmarks/iterator_teardown.py --processes 4 --busy 1 --life 3 --iterators 10

# Across two network-namespace hosts (needs root): keras_ring and MPI_Allreduce on one link.
bench-multihost: venv
	$(GUARD) $(VPY) benchmarks/multihost.py
	$(GUARD) $(VPY) benchmarks/multihost.py --bench agreement --hosts 2 --ranks-per-host 4
	$(GUARD) $(VPY) benchmarks/multihost.py --bench agreement --hosts 4 --ranks-per-host 8

clean:
	rm -rf build $(OPS_LIB) $(OLD_VENV) keras_ring/ops/_keras_ring_ops.json
