"""How deep one optimizer step goes into gradkit: the functions it runs and the files they live in, per door.

Counts, with ``sys.setprofile``, the distinct gradkit functions (``src/gradkit`` and ``src/lightning_gradkit``) that
one steady-state ``ClipGradNorm`` step calls, and their files, behind each of the four doors: the loop door, Fabric
(the loop door on Fabric's wrappers), the Hugging Face Trainer (the loop door inside HF's optimizer step) and the
Lightning Trainer. Behind the Trainer and HF the count covers the whole step, the door's hooks around the forward and
the backward included (behind the loop door the user's forward and backward call nothing of gradkit's); functions of
Lightning, Transformers or torch are never counted. The targets (issues 31 and 40): at most 25 functions in at most 5
files behind each door; a measurement, not a test.

    python benchmarks/bench_call_depth.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOTS = tuple(str(Path(__file__).resolve().parents[1] / "src" / name) for name in ("gradkit", "lightning_gradkit"))


class _Profile:
    """A ``sys.setprofile`` function that keeps the distinct gradkit functions (``file:qualname``) called."""

    def __init__(self) -> None:
        self.seen: dict[str, None] = {}

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            # Comprehensions, generator expressions and lambdas are expressions, not functions a reader follows.
            if code.co_filename.startswith(ROOTS) and not code.co_name.startswith("<"):
                self.seen[f"{Path(code.co_filename).name}:{code.co_qualname}"] = None

    def found(self) -> tuple[list[str], list[str]]:
        functions = list(self.seen)
        return functions, sorted({f.split(":")[0] for f in functions})


def traced(fn: Callable[[], object]) -> tuple[list[str], list[str]]:
    """The distinct gradkit functions (``file:qualname``) and files ``fn`` runs."""
    profile = _Profile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return profile.found()


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


def fabric_step() -> tuple[list[str], list[str]]:
    from lightning.fabric import Fabric

    from gradkit import ClipGradNorm, GradKit

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)),
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
    )
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    kit = GradKit(model, optimizer, [ClipGradNorm(1.0)], fabric=fabric, log_every_n_steps=0, log_dir=False)

    def one_step() -> None:
        fabric.backward(model(torch.randn(4, 8)).sum())
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        one_step()
    return traced(one_step)


def hf_step(optim: str = "adamw_torch_fused", whole: bool = True) -> tuple[list[str], list[str]]:
    """A Hugging Face step with HF's ``optim``: the whole step (``whole``), or from HF's ``optimizer.step()`` call to
    its return, the count issue 40 gives for this door (its "27 in 7" at ``ba0dd62``, with ``adamw_torch``)."""
    import tempfile

    import transformers

    from gradkit import ClipGradNorm, install

    result: dict[str, tuple[list[str], list[str]]] = {}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.net(x).squeeze(-1) - labels).square().mean()}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}

    class Tracer(transformers.TrainerCallback):
        # One whole HF step (forward, backward, the door's optimizer step), from its first callback to its last.
        def on_step_begin(self, args, state, control, **kwargs):
            if whole and state.global_step == 3:
                result["profile"] = _Profile()
                sys.setprofile(result["profile"])

        def on_step_end(self, args, state, control, **kwargs):
            if "profile" in result and "step" not in result:
                sys.setprofile(None)
                result["step"] = result["profile"].found()

        # Only HF's `optimizer.step()`: the door's step, wrapped for the one call (after the door's own wrapper).
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            if not whole and state.global_step == 3:
                door_step = optimizer.step

                def traced_step(*a, **k):
                    out = []
                    result["step"] = traced(lambda: out.append(door_step(*a, **k)))
                    return out[0]

                optimizer.step = traced_step
                result["door_step"] = door_step

        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            if "door_step" in result:
                optimizer.step = result.pop("door_step")

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out, max_steps=5, per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no",
            logging_steps=50, max_grad_norm=0.0, disable_tqdm=True, optim=optim,
        )  # fmt: skip
        trainer = transformers.Trainer(model=Net(), args=args, train_dataset=Data(), callbacks=[Tracer()])
        install(trainer, [ClipGradNorm(1.0)], events=False)
        trainer.train()
    return result["step"]


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
    doors = (
        ("loop door", loop_door_step),
        ("Fabric", fabric_step),
        ("HF Trainer, a whole step, fused AdamW (HF's default)", hf_step),
        ("HF Trainer, its optimizer.step(), AdamW (issue 40's count)", lambda: hf_step("adamw_torch", whole=False)),
        ("Trainer", trainer_step),
    )
    for door, measure in doors:
        functions, files = measure()
        print(f"{door}: {len(functions)} gradkit functions in {len(files)} files ({', '.join(files)})")
        if verbose:
            print("   " + "\n   ".join(functions))
