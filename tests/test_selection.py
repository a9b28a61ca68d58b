"""One selection grammar: ``re:`` means the same full match for checkpointing targets and AGC's ``exclude``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from clip_reference import AGCRef
from helpers import MLPModule, loader, make_trainer
from lightning_gradkit import ActivationCheckpointing, AdaptiveGradClip, inject_activation_checkpointing
from lightning_gradkit.activation_checkpointing.injection import select_modules

STEPS = 6


class TwoHeads(MLPModule):
    """``head`` and ``subhead``: the name ``head`` is a substring of ``subhead.weight``, a whole name of neither."""

    def __init__(self) -> None:
        super().__init__()
        self.subhead = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.encoder(x))
        return self.head(h) + self.subhead(h)


def _fit(tmp_path: Path, callback: AdaptiveGradClip) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = TwoHeads()
    make_trainer(tmp_path, callbacks=[callback], max_steps=STEPS).fit(model, loader(n=STEPS * 8))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(exclude: str) -> dict[str, Tensor]:
    """The plain loop with timm's AGC written out, leaving the parameters whose name ``exclude`` searches."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = model.configure_optimizers()
    clip = AGCRef(0.05, exclude=exclude)
    for x, y in loader(n=STEPS * 8):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        clip(model)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_regex_selects_the_same_whole_names_for_checkpointing_and_agc(tmp_path: Path) -> None:
    """``re:head`` is the module ``head`` for both: not ``subhead``, although ``head`` is a substring of it."""
    model = TwoHeads()
    whole = [name for name, _ in model.named_modules() if re.fullmatch("head", name)]
    assert [name for name, _ in select_modules(model, ["re:head"])] == whole == ["head"]

    got = _fit(tmp_path, AdaptiveGradClip(clip_factor=0.05, exclude=["re:head"]))
    expected = _reference(exclude=r"^head\.")  # only head.weight and head.bias are left unclipped
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    # The comparison is not vacuous: `subhead` was clipped (leaving it unclipped too gives other parameters).
    assert not torch.allclose(got["subhead.weight"], _reference(exclude="head")["subhead.weight"])


def test_agc_regex_that_only_searched_fails_at_setup_and_names_the_fix(tmp_path: Path) -> None:
    """``re:^head\\.`` used to search names; it matches no whole name, so setup says so and gives patterns that do."""
    trainer = make_trainer(tmp_path, callbacks=[AdaptiveGradClip(exclude=[r"re:^head\."])], max_steps=1)
    with pytest.raises(ValueError) as raised:
        trainer.fit(TwoHeads(), loader())
    message = str(raised.value)
    assert r"'re:^head\.' matches no trainable parameter" in message
    assert "must match a whole qualified name (re.fullmatch)" in message
    assert "Nearest names: head.weight, head.bias." in message
    assert r"A pattern that matches: 're:head\.weight'" in message
    assert r"To match it anywhere in a name, as a search would: 're:head\..*'" in message


def test_agc_exclude_takes_a_dotted_class_path_as_checkpointing_does(tmp_path: Path) -> None:
    """``torch.nn.Linear`` selects every Linear: nothing is left to clip, so training equals the unclipped loop."""
    got = _fit(tmp_path, AdaptiveGradClip(clip_factor=0.05, exclude=["torch.nn.Linear"]))
    expected = _reference(exclude=".")  # every parameter left unclipped
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])


def test_checkpointing_regex_matching_nothing_lists_nearby_module_names_and_a_matching_regex() -> None:
    with pytest.raises(ValueError) as raised:
        inject_activation_checkpointing(Stack(), [r"re:layer\.\d+"])
    message = str(raised.value)
    assert r"`targets=['re:layer\.\d+']` match no submodule of `Stack`." in message
    assert r"'re:layer\.\d+' must match a whole qualified name (re.fullmatch)." in message
    # The module names the regex was matched against (not class names), and a regex that matches some of them.
    assert "Nearest names: layers, layers.0, layers.1, layers.2, layers.2.1." in message
    assert r"A pattern that matches: 're:layers\.\d+'." in message
    assert [n for n, _ in select_modules(Stack(), [r"re:layers\.\d+"])] == ["layers.0", "layers.1", "layers.2"]


def test_checkpointing_class_name_typo_names_the_nearest_class(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"'Sequental': no module class of that name\. Nearest class names: Sequential\."
    ):
        inject_activation_checkpointing(Stack(), ["Sequental"])


def test_a_module_name_given_as_class_is_refused_at_construction_with_its_regex() -> None:
    with pytest.raises(ValueError, match=r"`targets` entry 'layers\.0' is neither a class name .* 're:layers\\\\\.0'"):
        ActivationCheckpointing(["layers.0"])
