"""Pretrain a small GPT with Lightning Fabric in litgpt's style, gradkit guarding every optimizer step.

    python examples/fabric_pretrain.py --out-dir /tmp/fabric-run                  # TinyGPT, 200 steps, CPU or GPU
    python examples/fabric_pretrain.py --out-dir /tmp/fabric-run --inject-nan-at 40   # a NaN batch: skipped
    python examples/fabric_pretrain.py --out-dir /tmp/fabric-run --resume auto --max-steps 300  # go on from there
    python examples/fabric_pretrain.py --out-dir /tmp/fabric-run --model litgpt   # litgpt's GPT (pip install litgpt)
    python examples/fabric_pretrain.py --out-dir /tmp/fabric-run --devices 2 --strategy ddp       # or --strategy fsdp
    python examples/fabric_pretrain.py --help                                      # every option

The loop has the shape of the ``fit`` loop of litgpt's ``pretrain.py``: ``fabric.launch()``, ``fabric.setup``, a
learning-rate warmup and cosine decay set by hand, gradient accumulation under ``fabric.no_backward_sync``,
``fabric.backward(loss / accum)``, ``fabric.log_dict`` and ``fabric.save(path, state)`` (every ``--save-interval``
steps and always at the end, so ``--resume auto`` finds the run's last step). Where litgpt calls
``fabric.clip_gradients`` and ``optimizer.step()``, it calls ``kit.step(optimizer)``: gradkit measures the gradients
once, clips them, skips the step when a guard says so and steps the optimizer otherwise. ``kit.state_dict()`` goes
into each checkpoint beside the model and the optimizer, so ``--resume`` continues with the clipper's statistics, the
guards' history and the skip count.

Nothing is downloaded: the text is the Python standard library's source, read byte by byte (vocabulary of 256).
``--strategy fsdp`` shards each transformer block with FSDP2's ``fully_shard`` through Fabric's
``ModelParallelStrategy`` (a folder checkpoint per step, one file per rank).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import ModelParallelStrategy, Strategy
from torch import Tensor, nn

from gradkit import ClipGradNorm, GradKit, GradNormMonitor, NonFiniteGuard, SpikeGuard, ZClip
from lightning_gradkit.demos import GPTConfig, TinyGPT, stdlib_text

VOCAB_SIZE = 256  # bytes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add = parser.add_argument
    add("--model", choices=("tinygpt", "litgpt"), default="tinygpt", help="litgpt: litgpt's GPT (needs litgpt)")
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=64)
    add("--block-size", type=int, default=64, help="tokens per sample")
    add("--accelerator", default="auto", help="Fabric's accelerator: auto, cpu, cuda, ...")
    add("--devices", type=int, default=1)
    add("--strategy", choices=("auto", "ddp", "fsdp"), default="auto", help="fsdp: FSDP2 through ModelParallelStrategy")
    add("--precision", default="32-true", help="Fabric's precision: 32-true, bf16-mixed, 16-mixed, ...")
    add("--max-steps", type=int, default=200, help="optimizer steps")
    add("--micro-batch-size", type=int, default=8)
    add("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    add("--lr", type=float, default=3e-3)
    add("--min-lr", type=float, default=3e-4)
    add("--warmup-steps", type=int, default=20)
    add("--weight-decay", type=float, default=0.1)
    add("--clip", choices=("zclip", "norm"), default="zclip", help="ZClip, or ClipGradNorm(--max-norm)")
    add("--max-norm", type=float, default=1.0)
    add("--monitor-depth", type=int, default=None, help="GradNormMonitor(depth=...); default: one norm per block")
    add("--log-interval", type=int, default=10, help="optimizer steps between logged rows")
    add("--save-interval", type=int, default=None, help="optimizer steps between checkpoints (one at the end anyway)")
    add("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "gradkit-fabric-pretrain")
    add("--resume", default=None, help='a checkpoint written by this script, or "auto": the last one in --out-dir')
    add("--max-bytes", type=int, default=200_000, help="bytes of standard-library text to train on")
    add("--seed", type=int, default=42)
    add("--inject-nan-at", type=int, default=None, help="optimizer step whose first micro-batch gives NaN logits")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> nn.Module:
    """TinyGPT, or litgpt's ``GPT`` with a tiny ``Config`` of the same size."""
    if args.model == "tinygpt":
        return TinyGPT(GPTConfig(VOCAB_SIZE, args.block_size, args.n_layer, args.n_head, args.n_embd))
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as err:
        raise SystemExit(f"`--model litgpt` needs litgpt: `pip install litgpt` ({err}).") from err
    config = Config(
        block_size=args.block_size,
        vocab_size=VOCAB_SIZE,
        padded_vocab_size=VOCAB_SIZE,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    return GPT(config)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: ``blocks`` of TinyGPT, ``transformer.h`` of litgpt's GPT."""
    return model.blocks if hasattr(model, "blocks") else model.transformer.h


def shard_blocks(model: nn.Module, device_mesh: Any) -> nn.Module:
    """``ModelParallelStrategy``'s ``parallelize_fn``: FSDP2 over every block, then over the rest."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_strategy(name: str, devices: int) -> str | Strategy:
    """Fabric's strategy for ``--strategy``: ``fsdp`` shards over all ``devices`` (no tensor parallelism)."""
    if name == "fsdp":
        return ModelParallelStrategy(shard_blocks, data_parallel_size=devices, tensor_parallel_size=1)
    return name


def block_depth(model: nn.Module) -> int:
    """The module depth of the blocks' names (``blocks.0``: 2, ``transformer.h.0``: 3)."""
    blocks = transformer_blocks(model)
    name = next(n for n, m in model.named_modules() if m is blocks)
    return name.count(".") + 2


def make_policies(args: argparse.Namespace, model: nn.Module) -> list[Any]:
    clip = ZClip() if args.clip == "zclip" else ClipGradNorm(args.max_norm)
    depth = block_depth(model) if args.monitor_depth is None else args.monitor_depth
    return [
        GradNormMonitor(depth=depth),
        clip,
        NonFiniteGuard(action="skip"),
        SpikeGuard(monitor="loss", action="warn"),
    ]


def get_lr(lr: float, step: int, warmup_steps: int, max_steps: int, min_lr: float) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps`` (litgpt's schedule)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def micro_batch(tokens: Tensor, index: int, batch_size: int, block_size: int) -> tuple[Tensor, Tensor]:
    """The ``index``-th micro-batch: consecutive windows of the text, cycling. A function of ``index`` alone, so a
    resumed run reads the same batches as an uninterrupted one."""
    windows = (len(tokens) - 1) // block_size
    rows = [((index * batch_size + r) % windows) * block_size for r in range(batch_size)]
    chunks = torch.stack([tokens[s : s + block_size + 1] for s in rows])
    return chunks[:, :-1], chunks[:, 1:]


@contextmanager
def nan_injected(model: nn.Module, active: bool) -> Iterator[None]:
    """While active, the model's logits are NaN (a fault for ``NonFiniteGuard`` to catch)."""
    handle = model.register_forward_hook(lambda module, args, out: out + math.nan) if active else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def find_resume(resume: str | None, out_dir: Path) -> Path | None:
    """The checkpoint ``--resume`` names: a path, or with ``"auto"`` the last one in ``out_dir`` (``None``: none)."""
    if resume != "auto":
        return Path(resume) if resume else None
    checkpoints = sorted(out_dir.glob("step-*/state.pth"))
    return checkpoints[-1] if checkpoints else None


class Summary(NamedTuple):
    """What the run did: optimizer steps, of which skipped, the last logged loss, the model, gradkit, the folder."""

    steps: int
    skipped_steps: int
    last_loss: float
    model: nn.Module
    kit: GradKit
    out_dir: Path


def fit(fabric: L.Fabric, state: dict[str, Any], kit: GradKit, tokens: Tensor, args: argparse.Namespace) -> float:
    """Train until ``state["step_count"]`` reaches ``--max-steps``. Returns the last logged loss."""
    model, optimizer = state["model"], state["optimizer"]
    accum = args.accumulate
    window_loss = torch.zeros((), device=fabric.device)
    last_loss = math.nan
    while state["step_count"] < args.max_steps:
        step = state["step_count"]
        lr = get_lr(args.lr, step, args.warmup_steps, args.max_steps, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = state["iter_num"] * fabric.world_size + fabric.global_rank  # each rank its own micro-batches
        batch = micro_batch(tokens, index, args.micro_batch_size, args.block_size)
        x, y = (t.to(fabric.device) for t in batch)
        faulty = step == args.inject_nan_at and state["iter_num"] % accum == 0  # the window's first micro-batch
        state["iter_num"] += 1
        is_accumulating = state["iter_num"] % accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating), nan_injected(model, faulty):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            fabric.backward(loss / accum)
        kit.note_loss(loss)  # the undivided micro-batch loss
        window_loss += loss.detach() / accum
        if is_accumulating:
            continue

        kit.step(optimizer)  # measure, clip, skip or step: replaces clip_gradients + optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step_count"] += 1
        done = state["step_count"] == args.max_steps
        if state["step_count"] % args.log_interval == 0 or done:
            last_loss = window_loss.item()  # device-to-host sync on logging steps only
            fabric.log_dict({"loss": last_loss, "lr": lr, "iter": state["iter_num"]}, step=step)
            fabric.print(f"step {step:5d} | loss {last_loss:.4f} | lr {lr:.2e}")  # gradkit's step numbers
        window_loss.zero_()
        if done or (args.save_interval and state["step_count"] % args.save_interval == 0):
            path = args.out_dir / f"step-{state['step_count']:08d}" / "state.pth"
            fabric.print(f"Saving checkpoint to {str(path)!r}")
            fabric.save(path, {**state, "gradkit": kit.state_dict()})
    return last_loss


def main(argv: Sequence[str] | None = None) -> Summary:
    args = parse_args(argv)
    logger = CSVLogger(args.out_dir, name="logs")
    strategy = make_strategy(args.strategy, args.devices)
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        loggers=logger,
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    with fabric.init_module(empty_init=False):
        model = build_model(args)
    fabric.print(f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters")
    policies = make_policies(args, model)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    kit = GradKit(
        model,
        optimizer,
        policies,
        fabric=fabric,
        log_every_n_steps=args.log_interval,
        max_steps=args.max_steps,
        log_dir=args.out_dir,
    )
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    resume = find_resume(args.resume, args.out_dir)
    if resume is None and args.resume == "auto":
        fabric.print(f"--resume auto: no checkpoint in {str(args.out_dir)!r} (step-*/state.pth): starting from step 0")
    if resume is not None:
        # gradkit's state as a plain entry, handed back in what `load` did not restore: Fabric's sharded (FSDP)
        # checkpoints would return a dict in place of an object given in `state`, rather than call its load_state_dict.
        kit.load_state_dict(fabric.load(resume, state)["gradkit"])
        fabric.print(f"Resuming training from {str(resume)!r} at step {state['step_count']}")
        if state["step_count"] >= args.max_steps:
            fabric.print(f"Step {state['step_count']} is --max-steps {args.max_steps} or past it: raise it to go on")

    tokens = torch.frombuffer(bytearray(stdlib_text(max_bytes=args.max_bytes)), dtype=torch.uint8).long()
    last_loss = fit(fabric, state, kit, tokens, args)
    kit.finish()
    logger.finalize("success")
    summary = Summary(state["step_count"], kit.skipped_steps, last_loss, model, kit, args.out_dir)
    fabric.print(f"Done: {summary.steps} steps, {summary.skipped_steps} skipped, last loss {summary.last_loss:.4f}")
    return summary


if __name__ == "__main__":
    main()
