"""How deep one optimizer step goes into gradkit: the functions it runs and the files they live in, per door.

Counts, with ``sys.setprofile``, the distinct gradkit functions (``src/gradkit`` and ``src/lightning_gradkit``) that
one steady-state ``ClipGradNorm`` step calls, and their files, behind the Trainer and behind the loop door. The
targets (issues 31 and 40): at most 25 functions in at most 5 files behind each door; a measurement, not a test.

    python benchmarks/bench_call_depth.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOTS = tuple(str(Path(__file__).resolve().parents[1] / "src" / name) for name in ("gradkit", "lightning_gradkit"))


def traced(fn: Callable[[], object]) -> tuple[list[str], list[str]]:
    """The distinct gradkit functions (``file:qualname``) and files ``fn`` runs."""
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            # Comprehensions, generator expressions and lambdas are expressions, not functions a reader follows.
            if code.co_filename.startswith(ROOTS) and not code.co_name.startswith("<"):
                seen[f"{Path(code.co_filename).name}:{code.co_qualname}"] = None

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    functions = list(seen)
    files = sorted({f.split(":")[0] for f in functions})
    return functions, files


def loop_door_step() -> tuple[list[str], list[str]]:
    from lightning_gradkit import ClipGradNorm, GradKit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kit = GradKit(model, optimizer, [ClipGradNorm(1.0)], log_every_n_steps=0, log_dir=False)

    def one_step() -> None:
        model(torch.randn(4, 8)).sum().backward()
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        one_step()
    return traced(one_step)


def trainer_step() -> tuple[list[str], list[str]]:
    import lightning.pytorch as pl

    from lightning_gradkit import ClipGradNorm

    result: dict[str, tuple[list[str], list[str]]] = {}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            if batch_idx == 3:
                result["step"] = traced(
                    lambda: super(Model, self).optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
                )
            else:
                super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    trainer = pl.Trainer(
        max_steps=5,
        callbacks=[ClipGradNorm(1.0)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        log_every_n_steps=50,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(40, 8), batch_size=4))
    return result["step"]


if __name__ == "__main__":
    verbose = "-v" in sys.argv
    for door, measure in (("loop door", loop_door_step), ("Trainer", trainer_step)):
        functions, files = measure()
        print(f"{door}: {len(functions)} gradkit functions in {len(files)} files ({', '.join(files)})")
        if verbose:
            print("   " + "\n   ".join(functions))
