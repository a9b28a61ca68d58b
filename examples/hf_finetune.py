"""Fine-tune a small GPT-2 with the Hugging Face ``Trainer``, gradkit guarding every optimizer step.

    python examples/hf_finetune.py --out-dir /tmp/hf-run                       # 60 steps, CPU or GPU
    python examples/hf_finetune.py --out-dir /tmp/hf-run --inject-nan-at 20    # a NaN batch: the step is skipped
    python examples/hf_finetune.py --out-dir /tmp/hf-run --resume --max-steps 120   # go on from the last checkpoint
    python examples/hf_finetune.py --out-dir /tmp/hf-run --clip zclip          # ZClip instead of max_grad_norm
    python examples/hf_finetune.py --help                                      # every option

The script is an ordinary ``Trainer`` run: ``TrainingArguments``, a dataset of token ids with labels, ``Trainer(...)``,
``trainer.train()``. One line adds gradkit: ``install(trainer, [...])``, with gradkit's policies as plain torch
objects, imported from ``gradkit`` (no Lightning is imported). From then on every
optimizer step goes through gradkit's pipeline: the gradient norms are measured once (per block, in HF's logs and
reporters, and as HF's own ``grad_norm``), HF's ``max_grad_norm`` clipping runs there after the guards' read, a step
with a NaN/Inf loss or gradient is skipped (the model, the optimizer state and the LR schedule stay as they were), and
each checkpoint folder holds the policies' state (``gradkit_state.pt``), so ``--resume`` continues with their
statistics.

The model is GPT-2's architecture at a small size, built from its config (``GPT2Config``; random initialization, no
download), and the text is the Python standard library's source, read byte by byte (a vocabulary of 256): nothing is
fetched. To fine-tune a real checkpoint, build the model with ``GPT2LMHeadModel.from_pretrained(...)`` and tokenize
your text; the rest stays.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import Dataset

from gradkit import GradNormMonitor, NonFiniteGuard, SpikeGuard, ZClip, install

VOCAB_SIZE = 256  # bytes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add = parser.add_argument
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--block-size", type=int, default=64, help="tokens per sample")
    add("--max-steps", type=int, default=60, help="optimizer steps")
    add("--batch-size", type=int, default=8, help="per device")
    add("--accumulate", type=int, default=2, help="HF's gradient_accumulation_steps")
    add("--lr", type=float, default=1e-3)
    add("--clip", choices=("hf", "zclip"), default="hf", help="hf: HF's max_grad_norm (run by the door); zclip: ZClip")
    add("--max-grad-norm", type=float, default=1.0, help="TrainingArguments(max_grad_norm=...) with --clip hf")
    add("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="fp16 needs a GPU")
    add("--logging-steps", type=int, default=10)
    add("--save-steps", type=int, default=20)
    add("--report-to", default="none", help='HF reporters: "none", "tensorboard", "wandb", ...')
    add("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "gradkit-hf-finetune")
    add("--resume", action="store_true", help="go on from the last checkpoint in --out-dir")
    add("--max-bytes", type=int, default=300_000, help="bytes of standard-library text to train on")
    add("--seed", type=int, default=42)
    add("--inject-nan-at", type=int, default=None, help="optimizer step whose first micro-batch gives NaN logits")
    add("--cpu", action="store_true", help="train on the CPU even where a GPU is present")
    return parser.parse_args(argv)


def stdlib_text(max_bytes: int) -> bytes:
    """The source of the Python standard library's largest modules, concatenated in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ("typing.py", "inspect.py", "argparse.py", "dataclasses.py", "pathlib.py", "functools.py", "ast.py")
    return b"\n".join((root / name).read_bytes() for name in names if (root / name).is_file())[:max_bytes]


class ByteBlocks(Dataset):
    """Consecutive windows of ``block_size`` bytes, each its own labels (the model shifts them: next-byte loss)."""

    def __init__(self, data: bytes, block_size: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_model(args: argparse.Namespace) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class InjectNaN(transformers.TrainerCallback):
    """Turn the logits of the first micro-batch of optimizer step ``step`` (0-based, as HF's ``global_step`` before
    the step) into NaN: the loss and every gradient of that step become non-finite."""

    def __init__(self, model: nn.Module, step: int) -> None:
        self.step, self.armed = step, False
        model.lm_head.register_forward_hook(self._poison)

    def on_step_begin(self, args: Any, state: transformers.TrainerState, control: Any, **kwargs: Any) -> None:
        self.armed = state.global_step == self.step

    def _poison(self, module: nn.Module, inputs: Any, output: Tensor) -> Tensor | None:
        if not (self.armed and module.training):
            return None
        self.armed = False
        return output * math.nan


def main(argv: Sequence[str] | None = None) -> transformers.Trainer:
    args = parse_args(argv)
    transformers.set_seed(args.seed)
    model = build_model(args)
    training_args = transformers.TrainingArguments(
        output_dir=str(args.out_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 10),
        # HF's own clipping, which the door runs in its pipeline; 0 with ZClip, which adapts its threshold.
        max_grad_norm=args.max_grad_norm if args.clip == "hf" else 0.0,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        report_to=args.report_to,
        use_cpu=args.cpu,
        seed=args.seed,
        disable_tqdm=True,
    )
    data = ByteBlocks(stdlib_text(args.max_bytes), args.block_size)
    trainer = transformers.Trainer(model, training_args, train_dataset=data)
    if args.inject_nan_at is not None:
        trainer.add_callback(InjectNaN(model, args.inject_nan_at))

    # The one line gradkit needs: the policies, as the Lightning Trainer and the loop door take them.
    policies: list[Any] = [
        GradNormMonitor(),  # the total norm and one per transformer block (transformer.h.0, ...) and embedding
        NonFiniteGuard(action="skip"),
        SpikeGuard(monitor="loss", action="warn"),
    ]
    if args.clip == "zclip":
        policies.append(ZClip())
    door = install(trainer, policies)

    trainer.train(resume_from_checkpoint=args.resume or None)

    last = next((row for row in reversed(trainer.state.log_history) if "grad_norm" in row), {})
    print(
        f"{trainer.state.global_step} optimizer steps, {door.kit.skipped_steps if door.kit else 0} skipped; "
        f"last logged grad_norm {last.get('grad_norm', float('nan')):.4g}. Checkpoints and gradkit_events.jsonl "
        f"in {args.out_dir}"
    )
    return trainer


if __name__ == "__main__":
    main()
