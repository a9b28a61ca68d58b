"""Faults on one rank of a 2-process CPU (gloo) ``gradkit_ddp`` run that used to crash, hang or split the ranks: a
forensic replay of a ``training_step`` that issues collectives, and a gradient that turns NaN on one rank after the
all-reduce. After each, the run finishes, the ranks hold bitwise identical parameters, and they equal a
single-process loop that never took the bad step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from helpers import MLPModule, loader, run_distributed
from test_guards import reference_params

pytestmark = pytest.mark.distributed


def reference_centred(skip_window: int, accumulate: int = 2, lr: float = 0.01) -> dict[str, Tensor]:
    """Plain Adam over the global batches (both ranks' samples), inputs centred on the global batch mean,
    accumulating ``accumulate`` micro-batches, skipping one window."""
    torch.manual_seed(0)
    model = MLPModule(lr=lr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batches = list(loader(n=64, batch_size=8))
    for w in range(len(batches) // accumulate):
        if w == skip_window:
            continue
        opt.zero_grad()
        for x, y in batches[w * accumulate : (w + 1) * accumulate]:
            (nn.functional.mse_loss(model(x - x.mean(dim=0)), y) / accumulate).backward()
        opt.step()
    return {n: p.detach().reshape(-1) for n, p in model.named_parameters()}


def test_faults_on_one_rank_neither_hang_nor_split_the_ranks(tmp_path: Path) -> None:
    # The script's process group times out after 60 s: a hang fails the run instead of blocking the suite.
    ranks = run_distributed("faults_script.py", tmp_path, timeout=400)
    expected = {"gather": reference_centred(skip_window=2), "after_reduce": reference_params(skip={2})}
    for case, first in ranks[0].items():
        second = ranks[1][case]
        assert first["global_step"] == second["global_step"] == (4 if case == "gather" else 8), case
        for name, values in first["params"].items():
            assert torch.equal(torch.tensor(values), torch.tensor(second["params"][name])), (case, name)
        assert first["unchanged"] and second["unchanged"], case  # the bad step left params and Adam state alone
        reference = expected["gather" if case == "gather" else "after_reduce"]
        for name, values in first["params"].items():
            ref = reference[name].reshape(-1)
            torch.testing.assert_close(torch.tensor(values), ref, rtol=1e-5, atol=1e-6, msg=f"{case} {name}")

    (event,) = ranks[0]["gather"]["events"]
    assert event["step"] == 2 and event["batch_idx"] == 4 and event["batches"] == [4, 5]
    assert event["rank"] == [1] and event["culprit"] == "<loss>" and event["culprit_source"] == "replay"
    by_rank = {f["rank"]: f for f in event["values"]["forensics"]}
    assert by_rank[1]["batch_idx"] == 4 and by_rank[0]["phase"] == "not_reproduced"

    for case in ("after_reduce", "after_reduce_no_loss_check"):
        (event,) = ranks[0][case]["events"]
        assert event["step"] == 2 and event["what"] == "nonfinite_grads", case
        assert event["values"]["grad_nonfinite_ranks"] == [1], case
        assert event["culprit"] == "encoder.0.weight" and event["culprit_source"] == "gradients", case
