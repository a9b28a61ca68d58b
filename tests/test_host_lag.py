"""HostLag: a step's device values on the host at the next step, without a host sync; what ZClip and SpikeGuard build
their statistics on."""

from __future__ import annotations

import math

import pytest
import torch

from gradkit.policies.history_clipping import ZClip
from gradkit.step.host_lag import HostLag, as_float32
from helpers import count_syncs
from test_clipping_policies import drive


def test_pop_returns_the_last_pushed_values_once() -> None:
    lag = HostLag()
    assert lag.pop() is None
    lag.push(torch.tensor([1.0, 2.0]))
    lag.push(torch.tensor([3.0, math.nan]))  # replaces what was not popped
    got = lag.pop()
    assert got is not None and got[0] == 3.0 and math.isnan(got[1])
    assert lag.pop() is None and not lag.pending


def test_a_zero_dim_flag_pops_as_a_one_element_list() -> None:
    """A step's skip flag (a 0-dim bool) travels as it is, without a view op to make it 1-D."""
    lag = HostLag()
    lag.push(torch.tensor(True))
    assert lag.pop() == [True]


def test_clear_forgets_the_pending_values() -> None:
    lag = HostLag()
    lag.push(torch.tensor([1.0]))
    lag.clear()
    assert lag.pop() is None


def test_reading_the_host_copy_is_not_counted_as_a_sync() -> None:
    """The values are read from host memory: the test suite's sync counter (SyncAudit's rule) must not see it."""
    lag = HostLag()
    with count_syncs() as counter, counter.active():
        lag.push(torch.tensor([1.5]))
        assert lag.pop() == [1.5]
        assert counter.total == 0
        torch.tensor([1.5]).tolist()  # the counter is live: a read of a tensor counts
        assert counter.total == 1


def test_as_float32_rounds_as_a_float32_tensor_comparison_does() -> None:
    """A float32 tensor compared with a Python number compares with the number rounded to float32."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2000, generator=g, dtype=torch.float64) * 10
    for threshold in values[:200].tolist():
        device = (values.float() > threshold).tolist()
        host = [as_float32(v) > as_float32(threshold) for v in values.float().tolist()]
        assert device == host
    assert as_float32(math.inf) == math.inf and math.isnan(as_float32(math.nan))


def test_zclip_statistics_fold_each_norm_in_at_the_next_step_or_when_read() -> None:
    """A norm passed at step t is in the statistics the decision of step t + 1 uses, and in the state read after
    step t: the lag changes when the host learns a value, never which values count."""
    clipper = ZClip(alpha=0.9, warmup_steps=2)
    drive(clipper, [1.0, 3.0])
    state = clipper.state_dict()["policies"][0]
    assert state["mean"].item() == pytest.approx(2.0) and state["var"].item() == pytest.approx(1.0)
    assert int(state["count"]) == 2
    clone = ZClip(alpha=0.9, warmup_steps=2)
    clone.load_state_dict(clipper.state_dict())
    later = [2.5, 40.0, 2.0]  # a spike in the middle: both clip it the same way
    assert drive(clipper, later) == drive(clone, later)
    ours, theirs = clipper.state_dict()["policies"][0], clone.state_dict()["policies"][0]
    assert all(torch.equal(ours[k], theirs[k]) for k in state)


@pytest.mark.gpu
def test_a_cuda_push_does_not_synchronize_and_lands_in_pinned_memory() -> None:
    lag, flag = HostLag(), HostLag()
    x = torch.arange(3, device="cuda", dtype=torch.float32)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lag.push(x * 2)
        flag.push(x.sum() > 0)  # a fused optimizer's skip flag, 0-dim
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lag.pop() == [0.0, 2.0, 4.0] and flag.pop() == [True]
    assert lag._host is not None and lag._host.is_pinned() and flag._host is not None and flag._host.is_pinned()
