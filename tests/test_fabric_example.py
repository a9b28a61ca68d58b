"""examples/fabric_pretrain.py end to end on CPU: the litgpt-style Fabric loop with GradKit (tiny sizes, in-process).

The reference for the skip is a hand-written plain PyTorch loop (``clip_grad_norm_``, AdamW, the faulty window left
out); the reference for the resume is the same run without the interruption.
"""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_same_state

EXAMPLE = Path(__file__).parents[1] / "examples" / "fabric_pretrain.py"
LITGPT_MISSING = importlib.util.find_spec("litgpt") is None

pytestmark = pytest.mark.filterwarnings("ignore:NonFiniteGuard:UserWarning")

TINY = [
    "--accelerator=cpu",
    "--n-layer=1",
    "--n-head=2",
    "--n-embd=16",
    "--block-size=16",
    "--micro-batch-size=2",
    "--accumulate=2",
    "--warmup-steps=2",
    "--max-bytes=4000",
    "--log-interval=1",
]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fabric_pretrain", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logged(out_dir: Path, key: str, version: str = "version_0") -> dict[int, float]:
    """``key``'s value at each step of one run (``version``) of the folder's CSV logs (Fabric writes one row per
    ``log_dict`` call)."""
    with (out_dir / "logs" / version / "metrics.csv").open() as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row[key]}


def reference_parameters(example: ModuleType, args: list[str], left_out: int) -> dict[str, torch.Tensor]:
    """The example's run as plain PyTorch: the same model, data and learning rates, ``clip_grad_norm_``, and the
    optimizer step ``left_out`` (its micro-batches) not taken at all."""
    a = example.parse_args(args)
    torch.manual_seed(a.seed)
    model = example.build_model(a)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, betas=(0.9, 0.95))
    tokens = torch.frombuffer(bytearray(example.stdlib_text(max_bytes=a.max_bytes)), dtype=torch.uint8).long()
    for step in range(a.max_steps):
        if step == left_out:
            continue
        for group in optimizer.param_groups:
            group["lr"] = example.get_lr(a.lr, step, a.warmup_steps, a.max_steps, a.min_lr)
        for i in range(step * a.accumulate, (step + 1) * a.accumulate):
            x, y = example.micro_batch(tokens, i, a.micro_batch_size, a.block_size)
            logits = model(x)
            (F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) / a.accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_fabric_example_skips_the_nan_window_like_a_loop_that_never_saw_it(tmp_path: Path) -> None:
    example = load_example()
    args = [*TINY, "--max-steps=6", "--clip=norm", "--max-norm=0.5", "--inject-nan-at=3", f"--out-dir={tmp_path}"]
    summary = example.main(args)

    assert (summary.steps, summary.skipped_steps) == (6, 1)
    totals = logged(tmp_path, "grad_norm/total")
    assert sorted(totals) == list(range(6))  # every step logged its norm
    assert math.isnan(totals[3]) and all(math.isfinite(v) for s, v in totals.items() if s != 3)
    skipped = logged(tmp_path, "gradkit/skipped_steps")
    assert (skipped[2], skipped[3], skipped[5]) == (0.0, 1.0, 1.0)
    coefs = [c for c in logged(tmp_path, "grad_clip/coef").values() if math.isfinite(c)]
    assert min(coefs) < 1.0  # the clipper acted
    assert sorted(logged(tmp_path, "loss")) == list(range(6))

    reference = reference_parameters(example, args, left_out=3)
    params = dict(summary.model.module.named_parameters())
    assert params.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(params[name].detach(), value, rtol=1e-5, atol=1e-6, msg=name)


def test_fabric_example_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path: Path) -> None:
    """ZClip's statistics, the skip count and the step counter travel in the checkpoint with the model and the
    optimizer: the resumed run ends bitwise where the uninterrupted one does."""
    example = load_example()
    args = [*TINY, "--max-steps=6", "--clip=zclip", "--inject-nan-at=1", "--save-interval=3"]
    full = example.main([*args, f"--out-dir={tmp_path / 'full'}"])
    checkpoint = tmp_path / "full" / "step-00000003" / "state.pth"
    assert checkpoint.is_file()
    resumed = example.main([*args, f"--out-dir={tmp_path / 'resumed'}", f"--resume={checkpoint}"])

    assert (resumed.steps, resumed.skipped_steps) == (full.steps, full.skipped_steps) == (6, 1)
    assert sorted(logged(tmp_path / "resumed", "grad_norm/total")) == [3, 4, 5]  # went on at step 3
    resumed_parameters = dict(resumed.model.module.named_parameters())
    for name, value in full.model.module.named_parameters():
        assert torch.equal(resumed_parameters[name], value), name
    full_state, resumed_state = full.kit.state_dict(), resumed.kit.state_dict()
    assert full_state["step"] == resumed_state["step"] == 6
    assert_same_state(resumed_state, full_state)


def test_fabric_example_resume_auto_takes_the_last_checkpoint(tmp_path: Path) -> None:
    example = load_example()
    example.main([*TINY, "--max-steps=4", "--save-interval=2", f"--out-dir={tmp_path}"])
    assert example.find_resume("auto", tmp_path) == tmp_path / "step-00000004" / "state.pth"
    assert example.find_resume("auto", tmp_path / "empty") is None
    summary = example.main([*TINY, "--max-steps=5", "--resume=auto", f"--out-dir={tmp_path}"])
    assert summary.steps == 5 and summary.kit.state_dict()["step"] == 5


@pytest.mark.skipif(LITGPT_MISSING, reason="optional: needs litgpt (pip install litgpt)")
def test_fabric_example_trains_litgpt_gpt_with_a_norm_per_block_and_skips_the_nan(tmp_path: Path) -> None:
    example = load_example()
    args = [*TINY, "--model=litgpt", "--max-steps=4", "--inject-nan-at=2", f"--out-dir={tmp_path}"]
    summary = example.main(args)

    assert (summary.steps, summary.skipped_steps) == (4, 1)
    assert type(summary.model.module).__module__ == "litgpt.model"
    assert sorted(logged(tmp_path, "grad_norm/module/transformer.h.0")) == [0, 1, 2, 3]
    assert all(torch.isfinite(p).all() for p in summary.model.parameters())


def documented_fabric_commands() -> list[list[str]]:
    """The `examples/fabric_pretrain.py` commands of the front doors' page (docs/doors.md), split into arguments
    (without `python` and the path)."""
    import shlex

    page = (Path(__file__).parents[1] / "docs" / "doors.md").read_text()
    lines = [line.split("#")[0] for line in page.splitlines() if line.startswith("python examples/fabric_pretrain.py")]
    return [shlex.split(line)[2:] for line in lines]


def test_the_documented_resume_command_resumes_the_documented_first_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: the documented first command saved no checkpoint, so its `--resume auto` started from scratch
    without a word. Both as docs/doors.md writes them, in a folder of their own and tiny (4 steps, then 6, the NaN at
    step 2)."""
    first, resume = documented_fabric_commands()[:2]
    assert "--inject-nan-at" in first and "--save-interval" not in first
    assert resume[resume.index("--resume") + 1] == "auto"
    out = ["--out-dir", str(tmp_path)]  # the page's /tmp/fabric-run, here
    example = load_example()

    example.main([*first, *TINY, "--max-steps=4", "--inject-nan-at=2", *out])
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/state.pth")) == ["step-00000004"]
    capsys.readouterr()
    summary = example.main([*resume, *TINY, "--max-steps=6", *out])
    printed = capsys.readouterr().out
    assert f"Resuming training from '{tmp_path / 'step-00000004' / 'state.pth'}' at step 4" in printed
    assert (summary.steps, summary.skipped_steps) == (6, 1)  # the first run's skip came along in the checkpoint
    assert sorted(logged(tmp_path, "grad_norm/total", version="version_1")) == [4, 5]  # went on at step 4


def test_resume_auto_without_a_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = load_example().main([*TINY, "--max-steps=2", "--resume=auto", f"--out-dir={tmp_path}"])
    assert f"--resume auto: no checkpoint in '{tmp_path}' (step-*/state.pth): starting from step 0" in (
        capsys.readouterr().out
    )
    assert summary.steps == 2
