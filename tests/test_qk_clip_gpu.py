"""QKClip on a CUDA device: the MuonClip rule from the maxima of SDPA and of FlexAttention's kernel (eager and
compiled: its ``max_scores``, which no CPU run can give), ``scale_updates`` as on the CPU, and no host sync off
logging steps. The same references as ``tests/test_qk_clip.py``: the logits and the rule by hand, on the CPU in
float64. Part of ``make gpu-check`` (every ``gpu``-marked test); skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gradkit import GradKit, QKClip
from test_qk_clip import UserAttention, causal_logits, hand_factors, head_max, scaled_rows, threshold_between

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def cpu_logits(model: UserAttention, x: Tensor) -> Tensor:
    """The model's causal logits, computed on the CPU in float64 from its (CUDA) projections."""
    with torch.no_grad():
        q, k = model.qk(x)
        return causal_logits(q.cpu(), k.cpu(), model.head_dim**-0.5)


def rescaled_once(model: UserAttention, x: Tensor, clip: QKClip) -> None:
    """One step that changes the weights only by the rescale (SGD at learning rate 0)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradKit(model, optimizer, clip, log_dir=False) as kit:
        model(x).sum().backward()
        kit.step(optimizer)


class CudaFlexAttention(UserAttention):
    """UserAttention's projections through FlexAttention with a causal block mask; ``compiled``: the inductor kernel,
    whose ``max_scores`` QKClip asks for."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention

        self.flex = torch.compile(flex_attention) if compiled else flex_attention

    def forward(self, x: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        b, t, c = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, t, t, device=x.device)
        y = self.flex(q, k, v, block_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


def check_rule(model: UserAttention, x: Tensor, name: str) -> None:
    """``model``'s heads rescaled by the MuonClip rule computed by hand from its logits."""
    before = cpu_logits(model, x)
    tau = threshold_between(head_max(before))
    _, query, key = hand_factors(head_max(before), tau, kv_heads=2)
    expected = {
        "q_proj.weight": scaled_rows(model.q_proj.weight.cpu(), query, 4),
        "q_proj.bias": scaled_rows(model.q_proj.bias.cpu(), query, 4),
        "k_proj.weight": scaled_rows(model.k_proj.weight.cpu(), key, 4),
        "k_proj.bias": scaled_rows(model.k_proj.bias.cpu(), key, 4),
    }
    rescaled_once(model, x, QKClip(threshold=tau, attention=[name]))
    state = model.state_dict()
    for param, value in expected.items():
        torch.testing.assert_close(state[param].cpu(), value, rtol=1e-5, atol=1e-6, msg=param)


def test_sdpa_heads_on_cuda_are_rescaled_by_the_muonclip_rule() -> None:
    torch.manual_seed(0)
    model = UserAttention(sdpa=True).to(CUDA)
    check_rule(model, torch.randn(2, 6, 16, device=CUDA) * 3, "UserAttention")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_heads_on_cuda_are_rescaled_from_the_kernels_max_scores(compiled: bool) -> None:
    torch.manual_seed(0)
    model = CudaFlexAttention(compiled).to(CUDA)
    check_rule(model, torch.randn(2, 6, 16, device=CUDA) * 3, "CudaFlexAttention")


def test_scale_updates_on_cuda_ends_where_the_cpu_run_ends() -> None:
    torch.manual_seed(0)
    model = UserAttention(sdpa=True)
    xs = [torch.randn(2, 6, 16) * 3 for _ in range(6)]
    tau = threshold_between(head_max(causal_logits(*model.qk(xs[0]), 0.5).detach()))
    runs = {}
    for device in ("cpu", "cuda"):
        net = copy.deepcopy(model).to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        clip = QKClip(threshold=tau, scale_updates=True)
        with GradKit(net, optimizer, clip, log_dir=False) as kit:
            for x in xs:
                net(x.to(device)).pow(2).mean().backward()
                kit.step(optimizer)
                optimizer.zero_grad()
        runs[device] = (net, clip.state_dict()["factors"][""])
    (cpu, cpu_factors), (gpu, gpu_factors) = runs["cpu"], runs["cuda"]
    assert (cpu_factors["query"] < 1).any()  # clipped: the products matter
    for name, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[name].cpu(), value, rtol=1e-4, atol=1e-5, msg=name)
    for part, value in cpu_factors.items():
        torch.testing.assert_close(gpu_factors[part].cpu(), value, rtol=1e-4, atol=0, msg=part)


@pytest.mark.parametrize("scale_updates", [False, True], ids=["rule", "scale_updates"])
def test_no_host_sync_on_cuda_off_logging_steps(scale_updates: bool) -> None:
    # Any CUDA host sync from the second step on is an error: the maxima, the all-reduce-free rule, the rescale and
    # the blend stay on the device (the first step builds the index tensors).
    torch.manual_seed(0)
    model = UserAttention(sdpa=True).to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    clip = QKClip(threshold=1.0, scale_updates=scale_updates)
    with GradKit(model, optimizer, clip, log_every_n_steps=1000, log_dir=False) as kit:
        for step in range(4):
            x = torch.randn(2, 6, 16, device=CUDA) * 3
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            loss.backward()
            if step >= 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                kit.step(optimizer)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            optimizer.zero_grad(set_to_none=True)
    assert clip.clipped_heads > 0
