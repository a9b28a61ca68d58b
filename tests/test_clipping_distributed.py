"""Clipping on 2 CPU processes (gloo): clipped parameters equal a single-process run on the same global batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from clip_reference import AGCRef, AutoClipRef, NormRef, ValueRef, ZClipRef, total_norm
from helpers import MLPModule, loader, run_distributed

pytestmark = pytest.mark.distributed

REFERENCES: dict[str, Callable[[], Callable[[nn.Module], None]]] = {
    "norm": lambda: NormRef(0.8),
    "value": lambda: ValueRef(0.1),
    "agc": lambda: AGCRef(0.05),
    "autoclip": lambda: AutoClipRef(25.0, 4),
    "zclip": lambda: ZClipRef(0.9, 0.5, 3, 1.4),
}


def reference(case: str, device: str = "cpu") -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """A plain loop on the global batches (2 ranks x 4 interleaved samples are 8 contiguous ones)."""
    torch.manual_seed(0)
    model = MLPModule().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=model.lr)
    clip = REFERENCES[case]()
    pre, post = [], []
    for x, y in loader(n=64, batch_size=8):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        pre.append(total_norm(model))
        clip(model)
        post.append(total_norm(model))
        opt.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, pre, post


def check_against_reference(
    results: list[dict], strategies: list[str], device: str = "cpu", atol: float = 1e-6
) -> None:
    for strategy, case in ((s, c) for s in strategies for c in REFERENCES):
        if case not in results[0][strategy]:
            continue
        ranks = [r[strategy] for r in results]
        expected, pre, post = reference(case, device)
        for rank in ranks:
            params = rank[case]["params"]
            for name, value in expected.items():
                msg = f"{strategy} {case} {name}"
                torch.testing.assert_close(torch.tensor(params[name]), value, rtol=0, atol=atol, msg=msg)
            rows = rank[case]["metrics"]
            assert len(rows) == len(pre) == 8
            # Global norms on every rank, before and after clipping (derived, or measured after a clamp).
            assert [r["grad_norm/total"] for r in rows] == pytest.approx(pre, rel=1e-5), case
            assert [r["grad_norm/total_post_clip"] for r in rows] == pytest.approx(post, rel=1e-5), case
        # Every rank applies the same coefficient and logs the same values; under FSDP2 AGC counts the steps it
        # clipped from its own rows.
        local = {"grad_clip/clipped_fraction"} if case == "agc" and strategy == "fsdp2" else set()
        same = [[{k: v for k, v in r.items() if k not in local} for r in rank[case]["metrics"]] for rank in ranks]
        assert same[0] == same[1], f"{strategy} {case}"


def test_every_rank_clips_like_a_single_process_under_fsdp2_and_ddp(tmp_path: Path) -> None:
    results = run_distributed("clip_script.py", tmp_path)
    assert results[0].keys() == {"fsdp2", "ddp"}
    check_against_reference(results, ["fsdp2", "ddp"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_every_rank_clips_like_a_single_process_on_gpus(tmp_path: Path) -> None:
    strategies = ["fsdp1", "fsdp2", "ddp"]
    results = run_distributed("clip_script.py", tmp_path, "--strategies", ",".join(strategies), "--accelerator", "gpu")
    check_against_reference(results, strategies, device="cuda", atol=1e-5)
