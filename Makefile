# Two commands for a fresh machine: `make demo` and `make test`. `make docs` builds the documentation site.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradkit-installed

.PHONY: demo test test-compat lint bench gpu-check docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU wheel of torch first: any other spec pulls the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# dev: the test tools; docs: `make docs`; huggingface: transformers and accelerate for the Hugging Face door's tests;
	# wandb and mlflow: the report's tests read it back from an offline W&B run and an MLflow file store.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,docs,huggingface,wandb,mlflow]'
	touch $(STAMP)

# One torch thread: the demo's model is too small to gain from a second one, and on a busy machine two threads cost
# 7x the CPU time for the same numbers (measured: 117 s against 16 s of CPU time, load average 6-9).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) examples/tiny_gpt.py fit --config examples/configs/demo.yaml --trainer.enable_progress_bar=false

# `make test` runs every test, in two pytest-xdist workers (one per core of a 2-core machine: most tests are short
# single-process Trainer runs, bound by Python, not by torch's threads), one torch thread in each and in every process
# a distributed test starts (two threads a process oversubscribe the cores: 9m40s against 6m29s, measured), the
# 8-process HSDP x TP job included: no marker leaves one out, so a newcomer's run and CI's are the same proof and no
# second entry point can collect nothing. A distributed job (tests/helpers.py) is robust to a busy machine instead: its
# timeout, set for an idle 2-core machine, grows with the load at launch (`launch_timeout`), and so does its process
# group's; a job that still times out is started once more, a job that fails never is. Any non-zero pytest status
# fails, 5 (no test collected) included.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q -n 2 --dist worksteal

# `make test-compat`: the compat subset below against the newest patch release of each Lightning minor the package
# supports (`lightning>=2.5,<3` in pyproject.toml), each in its own venv under $(COMPAT_DIR), with the same CPU torch.
# constraints/lightning-X.txt names the packages that release pins otherwise than constraints.txt. One release:
# `make test-compat COMPAT_LIGHTNING=2.5.6`. Any non-zero pytest status fails, 5 (no test collected) included.
COMPAT_LIGHTNING ?= 2.5.6 2.6.6
COMPAT_DIR := .venv-compat
# The compat subset: every Lightning integration point, the private reads of src/lightning_gradkit/_compat.py in [ ].
#   strategy, package_layout   registry names at import, device resolution [_root_device, _start_method]
#   strategy_gate              the optimizer.step gate, lr_scheduler_step and scheduler frequency, mid-epoch resume
#   setup_errors               callback classes refused (Lightning's callback validation)
#   clipping, monitor(_amp)    the step boundary, 16-mixed [GradScaler._scale], fused found_inf, logging step and
#                              epoch end [_batches_that_stepped, _num_ready_batches_reached]
#   clipping_manual_amp        manual optimization with a GradScaler [_per_optimizer_states]
#   accumulation               accumulate_grad_batches, training_step patch, a checkpoint inside a window
#   guards, guards_faults      skips, fused found_inf, forensics replay [torchmetrics Metric._defaults]
#   step_state                 buffers on a skip, replays, DDP buffers (2 processes)
#   rollback, legacy_checkpoint   state_dict save/load, resume, the checkpoint fixtures of the previous layout
#   door_state                 a Trainer checkpoint resumes the loop door and the reverse (one state format)
#   sync_audit, validation     on_train_batch_end patch; validation loop under inference mode
#   cli                        LightningCLI (class_path, strategy names)
#   *_distributed              DDP and FSDP2 (ModelParallelStrategy) on 2 processes, TP x FSDP2 on 4
#   front_doors(_distributed)  the Fabric door: Fabric's wrappers, precision plugin, log_dict, DDP and ModelParallel
#   deepspeed                  DeepSpeedStrategy detection and the refusals at setup
COMPAT_TESTS := \
	tests/test_strategy.py \
	tests/test_strategy_gate.py \
	tests/test_package_layout.py \
	tests/test_setup_errors.py \
	tests/test_door_state.py \
	tests/test_clipping.py \
	tests/test_clipping_manual_amp.py \
	tests/test_monitor.py \
	tests/test_monitor_amp.py \
	tests/test_accumulation.py \
	tests/test_guards.py \
	tests/test_guards_faults.py \
	tests/test_step_state.py \
	tests/test_rollback.py \
	tests/test_legacy_checkpoint.py \
	tests/test_sync_audit.py \
	tests/test_validation.py \
	tests/test_cli.py \
	tests/test_clipping_distributed.py \
	tests/test_accumulation_distributed.py \
	tests/test_scale_distributed.py \
	tests/test_front_doors.py \
	tests/test_front_doors_distributed.py \
	tests/test_deepspeed.py

test-compat: $(addprefix test-compat-,$(COMPAT_LIGHTNING))

.PRECIOUS: $(COMPAT_DIR)/lightning-%/.gradkit-installed  # a venv is reused, never removed as an intermediate file

test-compat-%: $(COMPAT_DIR)/lightning-%/.gradkit-installed
	@start=$$(date +%s); \
	$(COMPAT_DIR)/lightning-$*/bin/python -m pytest $(COMPAT_TESTS) -q -p no:cacheprovider; status=$$?; \
	echo "Lightning $*: pytest exit $$status after $$(( $$(date +%s) - start )) s"; exit $$status

$(COMPAT_DIR)/lightning-%/.gradkit-installed: pyproject.toml constraints.txt constraints/lightning-%.txt
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q torch==2.13.0
	# constraints.txt less the packages constraints/lightning-$*.txt pins, plus its pins.
	grep -v -i -E "^($$(grep -o -E '^[A-Za-z0-9_.-]+==' constraints/lightning-$*.txt | sed 's/==$$//' | paste -sd'|'))==" \
		constraints.txt | cat - constraints/lightning-$*.txt > $(@D)/constraints.txt
	$(@D)/bin/python -m pip install -q -c $(@D)/constraints.txt -e '.[dev]' lightning==$*
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks docs/conf.py docs/external_names.py
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs/conf.py docs/external_names.py

# `make docs`: the documentation site (Sphinx: MyST pages, autodoc + napoleon for the API reference) into docs/_build
# (git-ignored), every warning an error (-W; --keep-going lists them all first). -E re-reads every page, so a warning
# in an unchanged page fails a second build too. The build is nitpicky: a cross-reference that resolves nowhere is an
# error, short of the private names docs/conf.py's nitpick_ignore lists. No network: the names of Python, torch,
# Lightning and transformers link to their official pages through inventories the build writes from the table in
# docs/external_names.py, so a docstring that names a new torch or Lightning type fails until the table has its page.
# tests/test_docs.py runs the pages' code blocks and checks that table (part of `make test`).
SPHINXOPTS ?=

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -b html -W --keep-going -E -q $(SPHINXOPTS) docs docs/_build/html

bench: $(STAMP)
	$(PY) benchmarks/bench_monitoring.py

# `make gpu-check`: the GPU proof on a machine with CUDA and no network, in under 8 minutes: the gpu-marked tests, the
# sync count, the norm pass against the bandwidth floor and the whole-step benchmark (benchmarks/gpu_check.py), all in
# gpu-check-results/results.md (and .json). No .venv: an interpreter that already has torch (CUDA), Lightning and
# pytest, the package from src/ (or installed with `pip install --no-deps -e .`). Without CUDA it skips, exit 0.
GPU_PYTHON ?= python3

gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(COMPAT_DIR) lightning_logs .pytest_cache gpu-check-results docs/_build
