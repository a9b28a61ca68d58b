"""The proof of ``benchmarks/bench_early_warning.py``, short: one seed, 160 steps, the same twins and criteria.

The unstable twin (plain attention at a peak learning rate of 0.1) is warned about its attention logits at least 20
optimizer steps before its loss first exceeds the stable twin's (qk-layernorm) by 10%; the stable twin is never
warned; with ``action="escalate"`` the unstable twin ends below its unmitigated self (the 5-seed run checks the
issue's "within 10% of the stable twin" over 300 steps; 160 leave the mitigation too little time for that). And the
example rules of ``docs/jobs/early_warning.md`` stay quiet on two of the bench's healthy kinds (40 steps, every step
logged).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

STEPS = 160


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_early_warning.py"
    spec = importlib.util.spec_from_file_location("bench_early_warning", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_warning_comes_before_the_unstable_twins_loss_shows_it_and_never_on_the_stable_twin() -> None:
    bench = _bench()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = bench.run_seed(0, STEPS)
    finally:
        torch.set_num_threads(threads)
    assert result.first_warning is not None and result.first_warning[1] == "attn_logit_max"
    assert result.divergence is not None and result.lead >= bench.LEAD, (result.first_warning, result.divergence)
    assert result.stable_warnings == 0
    assert result.escalations >= 1 and result.end_mitigated < result.end_unstable


# The example rules of docs/jobs/early_warning.md ("The detector and its actions"), merged into the defaults.
DOCS_RULES = {"thresholds": {"spike_score": 0.01, "adam_spike_frac": 1e-3}, "floors": {"update_ratio_spread": 20.0}}


def test_the_documented_example_rules_stay_quiet_on_healthy_vision_and_encoder_training() -> None:
    """Issue 44: "the docs' example rules must not fire at step 1". Before the Adam signals waited for 10 steps of
    second moments, ``adam_spike_frac`` fired at step 1 on every run (0.01 to 0.22: after one step ``g^2/v`` of a
    fresh coordinate is Cauchy-like). The reference is a healthy run: a ResNet under AdamW and a BERT from scratch,
    both learning (their loss falls), watched on every step."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "jobs" / "early_warning.md").read_text()
    assert 'thresholds={"spike_score": 0.01, "adam_spike_frac": 1e-3}' in docs  # the rules are still the docs'
    assert 'floors={"update_ratio_spread": 20.0}' in docs
    bench = _bench()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {
            name: bench.train_kind(bench.KINDS[name], 0, 40, log_every=1, **DOCS_RULES)
            for name in ("resnet_adam", "bert")
        }
    finally:
        torch.set_num_threads(threads)
    for name, run in runs.items():
        assert run.warnings == [], (name, run.warnings)
        assert sum(run.losses[-10:]) / 10 < run.losses[0], (name, run.losses)  # it trains: a healthy run
