"""The Hugging Face door's cost per optimizer step, side by side with HF's own ``max_grad_norm`` clipping.

Every configuration trains the same small GPT-2 (built from config) on the same data with a fresh
``transformers.Trainer``; runs are interleaved over ``--repeats`` and the medians of all measured steps are printed,
with their ratio to HF's own clipping:

- ``HF max_grad_norm=1.0``: HF clips (``clip_grad_norm_`` through accelerate), no door: the baseline;
- ``HF max_grad_norm=0``: no clipping; HF still takes the norm it logs (``clip_grad_norm_(max_norm=inf)``);
- ``door: max_grad_norm=1.0``: ``install(trainer, [])``: the door runs HF's clipping as ``ClipGradNorm(1.0)``;
- ``door: + monitor + guards``: also ``GradNormMonitor``, ``NonFiniteGuard(action="skip")`` and
  ``SpikeGuard(monitor="loss")``.

Per optimizer step: the whole step's wall time (between consecutive ``on_step_begin``), and its boundary, from the
end of the last ``training_step`` of the window (forward and backward) to ``on_step_end``: HF's norm and clip, the
optimizer step (the door's ``kit.step``), the LR scheduler, ``zero_grad``; the boundary both as wall time and as the
process's CPU time (``time.process_time``, all threads), which other jobs of a shared machine disturb less.

    python benchmarks/bench_hf_door.py [--steps 40 --warmup 5 --repeats 3 --optim adamw_torch_fused]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).parent))
from harness import machine, sync_device

from gradkit.doors.huggingface import install
from gradkit.policies.guards import NonFiniteGuard
from gradkit.policies.monitor import GradNormMonitor
from gradkit.policies.spike_guard import SpikeGuard

CONFIGS = ["HF max_grad_norm=1.0", "HF max_grad_norm=0", "door: max_grad_norm=1.0", "door: + monitor + guards"]
VOCAB, SEQ, BATCH = 256, 64, 8


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Timer(transformers.TrainerCallback):
    """Step starts, and the end of each window's last ``training_step`` to the step's end (the boundary)."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.starts: list[float] = []
        self.boundaries: list[float] = []
        self.boundaries_cpu: list[float] = []
        self._backward_done = self._backward_done_cpu = 0.0
        inner = trainer.training_step

        def timed(*args: Any, **kwargs: Any) -> Tensor:
            loss = inner(*args, **kwargs)
            sync_device()
            self._backward_done, self._backward_done_cpu = time.perf_counter(), time.process_time()
            return loss

        trainer.training_step = timed  # type: ignore[method-assign]  # outside the door's wrapper

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync_device()
        self.starts.append(time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync_device()
        self.boundaries.append(time.perf_counter() - self._backward_done)
        self.boundaries_cpu.append(time.process_time() - self._backward_done_cpu)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync_device()
        self.starts.append(time.perf_counter())


def run(config: str, args: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    """(whole-step times, boundary times, boundary CPU times) of one run, warm-up steps dropped."""
    transformers.set_seed(0)
    config_ = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config_)
    steps = args.steps + args.warmup
    training_args = transformers.TrainingArguments(
        tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        max_grad_norm=0.0 if config == "HF max_grad_norm=0" else 1.0,
        optim=args.optim,
        logging_steps=50,  # HF's default 500: the measured steps log nothing, as most steps of a run
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = transformers.Trainer(model, training_args, train_dataset=Tokens(steps * BATCH))
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no printed rows between the runs
    if config.startswith("door"):
        monitor = [GradNormMonitor(), NonFiniteGuard(action="skip"), SpikeGuard(monitor="loss")]
        install(trainer, monitor if "guards" in config else [])
    timer = Timer(trainer)
    trainer.add_callback(timer)
    trainer.train()
    whole = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]
    return whole[args.warmup :], timer.boundaries[args.warmup :], timer.boundaries_cpu[args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped from each run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    default_optim = str(transformers.TrainingArguments.__dataclass_fields__["optim"].default)
    parser.add_argument("--optim", default=default_optim, help="HF's `optim` (default: HF's default)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="HFGradKit clips for HF")
    # The process's first run pays its lazy initializations (thread pools, kernels): not one of the measured ones.
    run(CONFIGS[-1], argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 0}))
    samples: dict[str, tuple[list[float], list[float], list[float]]] = {c: ([], [], []) for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            for kept, new in zip(samples[config], run(config, args), strict=True):
                kept += new
    print(f"{machine()}, transformers {transformers.__version__}")
    print(
        f"GPT-2 n_layer={args.n_layer} n_embd={args.n_embd}, batch {BATCH} x {SEQ} tokens, optim {args.optim}; "
        f"{args.steps} steps per run ({args.warmup} warm-up dropped), {args.repeats} interleaved runs, medians\n"
    )
    medians = {c: [statistics.median(values) for values in samples[c]] for c in CONFIGS}
    base = medians[CONFIGS[0]]
    print("| configuration | step | boundary | boundary, CPU | step / HF clip | boundary / HF clip | CPU / HF clip |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for config in CONFIGS:
        times = medians[config]
        cells = [f"{t * 1e3:.2f} ms" for t in times] + [f"{t / b:.2f}x" for t, b in zip(times, base, strict=True)]
        print(f"| {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
