"""Models, data and reference loops for the Hugging Face door's tests (``test_hf_door*.py`` and the DDP script).

Two models built from config (random init, no download, no dropout so that a left-out batch changes nothing but
itself): a tiny GPT-2 language model and a BERT sequence classifier. A *poisoned* sample starts with the token
``POISON``; :func:`poison` makes such a micro-batch non-finite inside the model (a forward hook), the same way under
every loop, so the door, the loop door and the hand-written loop meet the same NaN.

The references replay what the Trainer computes, with nothing of its loop: the loss exactly as HF's ``compute_loss``
and ``training_step`` form it (:func:`hf_loss`), then either the loop door (:func:`loop_door_run`) or a hand-written
step with ``clip_grad_norm_`` (:func:`hand_written_run`).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import Dataset

from gradkit.doors.loop import GradKit

VOCAB, SEQ, BATCH = 64, 12, 4
POISON = VOCAB - 1  # a token the clean samples never hold

Batch = dict[str, Tensor]


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


class NormNet(nn.Module):
    """A classifier with BatchNorm (running statistics a skipped step's forward writes) and no ``**kwargs`` in its
    forward: HF divides its loss by the window's micro-batches instead of passing ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 2)

    def forward(self, input_ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
        logits = self.head(self.norm(self.embed(input_ids).mean(dim=1)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "bert": bert, "norm": NormNet}
# The submodule whose output a poisoned micro-batch turns to NaN (the culprit a replay should name).
CULPRITS = {"gpt2": "transformer.h.1.mlp", "bert": "bert.encoder.layer.1.output", "norm": "norm"}
# Whether HF passes the model the window's `num_items_in_batch` (`Trainer.model_accepts_loss_kwargs`).
TAKES_ITEMS = {"gpt2": True, "bert": True, "norm": False}


class TokenData(Dataset):
    """``n`` samples of ``SEQ`` tokens; for GPT-2 the labels are the tokens, for BERT a class from the first token."""

    def __init__(self, kind: str, n: int, poisoned: Sequence[int] = (), seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(POISON, (n, SEQ), generator=g)
        self.ids[list(poisoned), 0] = POISON
        if kind == "gpt2":
            # Position 0 is never a target (the model shifts the labels): -100 there makes HF's count of the window's
            # labels the same whether it counts them shifted or not (it shifts only when the model's `loss_type` is
            # resolved at the Trainer's construction, which a model built from config resolves at its first forward).
            self.labels = self.ids.clone()
            self.labels[:, 0] = -100
        else:
            self.labels = self.ids[:, 1] % 2

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Batch:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def batches(data: TokenData, batch_size: int = BATCH, drop: Sequence[int] = ()) -> list[Batch]:
    """The micro-batches of a sequential pass over ``data`` (HF's ``train_sampling_strategy="sequential"``)."""
    out = []
    for start in range(0, len(data), batch_size):
        rows = [i for i in range(start, min(start + batch_size, len(data)))]
        out.append({"input_ids": data.ids[rows], "labels": data.labels[rows]})
    return [b for i, b in enumerate(out) if i not in drop]


def windows(micro: list[Batch], accumulate: int) -> list[list[Batch]]:
    return [micro[i : i + accumulate] for i in range(0, len(micro), accumulate)]


def poison(model: nn.Module, kind: str, where: str = "grad") -> None:
    """Make every micro-batch that holds a ``POISON`` sample bad: ``where="grad"`` multiplies the culprit module's
    output rows of those samples by NaN (NaN loss and gradients), ``where="loss"`` adds NaN to the loss only (finite
    gradients: only a loss check sees it), ``where="spike"`` multiplies the loss by 100 (a finite spike)."""
    state: dict[str, Tensor] = {}

    def remember(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        state["bad"] = (kwargs["input_ids"] if "input_ids" in kwargs else args[0])[:, 0] == POISON

    model.register_forward_pre_hook(remember, with_kwargs=True)
    if where == "grad":

        def corrupt(module: nn.Module, args: Any, output: Tensor) -> Tensor:
            factor = torch.where(state["bad"], math.nan, 1.0).to(output.dtype)
            return output * factor.view(-1, *([1] * (output.dim() - 1)))

        model.get_submodule(CULPRITS[kind]).register_forward_hook(corrupt)
    else:

        def corrupt_loss(module: nn.Module, args: Any, output: Any) -> Any:
            if state["bad"].any():
                output["loss"] = output["loss"] + math.nan if where == "loss" else output["loss"] * 100.0
            return output

        model.register_forward_hook(corrupt_loss)


def num_items(window: list[Batch]) -> Tensor:
    """HF's ``num_items_in_batch``: the window's labels that count (``TokenData`` makes a shift change nothing)."""
    return sum(b["labels"].ne(-100).sum() for b in window)


def hf_loss(model: nn.Module, batch: Batch, items: Tensor | None, accumulate: int) -> Tensor:
    """The micro-batch loss HF back-propagates: the model normalizes by the window's ``num_items_in_batch`` when it
    takes it (GPT-2, BERT), else HF divides the batch mean by the window's micro-batches."""
    if items is not None:
        return model(**batch, num_items_in_batch=items)["loss"]
    return model(**batch)["loss"] / accumulate


def step_loss(loss: Tensor, accumulate: int) -> Tensor:
    """What the door hands to ``note_loss``: the back-propagated loss times the window's micro-batches."""
    return loss.detach() * accumulate if accumulate != 1 else loss.detach()


def loop_door_run(
    model: nn.Module,
    kind: str,
    micro: list[Batch],
    accumulate: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    policies: list[Any],
    log_every_n_steps: int,
    log_dir: Path | Literal[False] = False,
    autocast: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    epochs: int = 1,
) -> tuple[GradKit, list[tuple[int, dict[str, float]]]]:
    """The same training through the loop door, the loss formed as HF forms it for ``kind``'s model: ``epochs``
    passes over ``micro``, each cut into windows of ``accumulate`` micro-batches (the last one shorter, as HF's)."""
    rows: list[tuple[int, dict[str, float]]] = []
    finishing = [False]

    def log(metrics: dict[str, float], step: int) -> None:
        # As HF numbers the door's rows: `global_step` counts the step done, and `finish` logs after the last one.
        rows.append((step if finishing[0] else step + 1, metrics))

    kit = GradKit(
        model,
        optimizer,
        policies,
        log=log,
        log_every_n_steps=log_every_n_steps,
        scaler=scaler,
        schedulers=[scheduler],
        max_steps=len(windows(micro, accumulate)) * epochs,
        log_dir=log_dir,
    )
    model.train()
    device_type = next(model.parameters()).device.type
    for window in [window for _ in range(epochs) for window in windows(micro, accumulate)]:
        items = num_items(window) if TAKES_ITEMS[kind] else None
        for batch in window:
            with torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = hf_loss(model, batch, items, len(window))
            (loss if scaler is None else scaler.scale(loss)).backward()
            kit.note_loss(step_loss(loss, len(window)))
        kit.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    finishing[0] = True
    kit.finish()
    return kit, rows


def hand_written_run(
    model: nn.Module,
    kind: str,
    micro: list[Batch],
    accumulate: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    max_norm: float,
) -> None:
    """The reference with nothing of gradkit: backward, ``clip_grad_norm_``, step, scheduler step."""
    model.train()
    for window in windows(micro, accumulate):
        items = num_items(window) if TAKES_ITEMS[kind] else None
        for batch in window:
            hf_loss(model, batch, items, len(window)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def optimizer_and_scheduler(model: nn.Module, steps: int, name: str = "sgd") -> tuple[torch.optim.Optimizer, Any]:
    """SGD with momentum, or ``"hf"``: the optimizer HF's Trainer builds by default (fused AdamW on torch >= 2.8, its
    parameters in two groups, with and without weight decay; built by ``Trainer.create_optimizer``, whose parameter
    order the pipeline's norm sums follow), and HF's linear decay to 0 over ``steps``. SGD for comparisons with a
    hand-written loop: the attention key biases get a gradient that is zero up to rounding, which Adam amplifies into
    full-size updates that follow the rounding of two summation orders."""
    if name == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        builder = transformers.Trainer(model, training_args(Path(tempfile.mkdtemp()), learning_rate=1e-3))
        optimizer = builder.create_optimizer()
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, 0, steps)


def training_args(out: Path, **kwargs: Any) -> transformers.TrainingArguments:
    """Arguments of a short, deterministic CPU run: sequential data, no reporters, no progress bar, gradkit clips."""
    defaults: dict[str, Any] = {
        "use_cpu": True,
        "report_to": "none",
        "per_device_train_batch_size": BATCH,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 0,
    }
    return transformers.TrainingArguments(str(out), **{**defaults, **kwargs})


def gradkit_rows(log_history: list[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """The door's rows of HF's ``log_history`` (those with gradkit's keys), as ``(step, values)``."""
    prefixes = ("grad_norm/", "grad_clip/", "gradkit/", "spike/", "nonfinite/", "zclip/", "autoclip/", "agc/")
    out = []
    for row in log_history:
        values = {k: v for k, v in row.items() if k.startswith(prefixes)}
        if values:
            out.append((row["step"], values))
    return out


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    """Every entry of ``b``'s ``state_dict`` is bitwise the same in ``a``'s (``torch.equal``: a NaN fails even where
    both hold one, unlike :func:`helpers.assert_same_state`)."""
    state = a.state_dict()
    for key, value in b.state_dict().items():
        assert torch.equal(state[key], value), key


def merged_rows(rows: list[tuple[int, dict[str, float]]]) -> dict[int, dict[str, str]]:
    """Rows of one step merged (the last step may log twice: the step, then ``finish``), each value as its ``repr``
    so that rows compare exactly, NaN included."""
    out: dict[int, dict[str, str]] = {}
    for step, values in rows:
        out.setdefault(step, {}).update({k: repr(float(v)) for k, v in values.items()})
    return out
