"""The names of other projects that the documentation site links, and the official page of each (``make docs``).

autodoc writes a type as the module that defines it (``torch.nn.modules.module.Module``,
``lightning.pytorch.core.module.LightningModule``), while the projects document the public name (``torch.nn.Module``,
``lightning.pytorch.core.LightningModule``), so their own inventories would not resolve these names even where they
can be downloaded. ``NAMES`` maps each name the site references, as Sphinx sees it, to the page and anchor that
document it on the project's site; ``docs/conf.py`` writes a Sphinx inventory per project from it into the build
folder (``write_inventories``) and points intersphinx at those files, so the build reads nothing from the network.

Every page and anchor was checked against the project's published documentation (the ``stable`` roots of torch and
Lightning, ``3`` of Python, the current transformers docs). The build is nitpicky: a reference to another project's
name that is not in ``NAMES`` fails ``make docs``, so a docstring that starts naming a new torch or Lightning type
needs its entry here, with its page checked the same way. ``tests/test_docs.py`` checks that each entry names an
object of the installed package and that each URL stays under its project's root.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import NamedTuple

# project -> the documentation root its pages are relative to
ROOTS = {
    "python": "https://docs.python.org/3/",
    "torch": "https://docs.pytorch.org/docs/stable/",
    "lightning": "https://lightning.ai/docs/pytorch/stable/",
    "transformers": "https://huggingface.co/docs/transformers/",
}
# project -> its name in a link's tooltip ("(in PyTorch)")
TITLES = {"python": "Python", "torch": "PyTorch", "lightning": "PyTorch Lightning", "transformers": "Transformers"}


class Link(NamedTuple):
    project: str  # a key of ROOTS
    page: str  # the page, relative to the project's root
    anchor: str  # the fragment on that page
    role: str = "class"  # the Python domain object type the references use: class, function
    target: str = ""  # the importable object when the name is not itself an import path (a short form)


_LIGHTNING_API = "api/"  # Sphinx autosummary pages: api/<public name>.html

NAMES: dict[str, Link] = {
    # Python
    "collections.abc.Callable": Link("python", "library/collections.abc.html", "collections.abc.Callable"),
    "collections.abc.Iterable": Link("python", "library/collections.abc.html", "collections.abc.Iterable"),
    "collections.abc.Mapping": Link("python", "library/collections.abc.html", "collections.abc.Mapping"),
    "collections.abc.Sequence": Link("python", "library/collections.abc.html", "collections.abc.Sequence"),
    "datetime.timedelta": Link("python", "library/datetime.html", "datetime.timedelta"),
    "pathlib.Path": Link("python", "library/pathlib.html", "pathlib.Path"),
    "Path": Link("python", "library/pathlib.html", "pathlib.Path", target="pathlib.Path"),
    # torch
    "torch.Tensor": Link("torch", "tensors.html", "torch.Tensor"),
    "torch.device": Link("torch", "tensor_attributes.html", "torch.device"),
    "torch.nn.modules.module.Module": Link("torch", "generated/torch.nn.Module.html", "torch.nn.Module"),
    "torch.optim.optimizer.Optimizer": Link("torch", "optim.html", "torch.optim.Optimizer"),
    # torch documents the scaler as torch.cuda.amp.GradScaler only: the section on gradient scaling instead
    "torch.amp.grad_scaler.GradScaler": Link("torch", "amp.html", "gradient-scaling"),
    "torch.autograd.graph.save_on_cpu": Link(
        "torch", "autograd.html", "torch.autograd.graph.save_on_cpu", role="function"
    ),
    "torch.utils.checkpoint.checkpoint": Link(
        "torch", "checkpoint.html", "torch.utils.checkpoint.checkpoint", role="function"
    ),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts": Link(
        "torch", "checkpoint.html", "torch.utils.checkpoint.create_selective_checkpoint_contexts", role="function"
    ),
    # gradkit.expert_parallel's group (the same page and anchor as the short name below)
    "torch.distributed.device_mesh.DeviceMesh": Link(
        "torch", "distributed.html", "torch.distributed.device_mesh.DeviceMesh"
    ),
    # the string annotations of Lightning's FSDPStrategy signature
    "DeviceMesh": Link(
        "torch",
        "distributed.html",
        "torch.distributed.device_mesh.DeviceMesh",
        target="torch.distributed.device_mesh.DeviceMesh",
    ),
    "MixedPrecision": Link(
        "torch", "fsdp.html", "torch.distributed.fsdp.MixedPrecision", target="torch.distributed.fsdp.MixedPrecision"
    ),
    "CPUOffload": Link(
        "torch", "fsdp.html", "torch.distributed.fsdp.CPUOffload", target="torch.distributed.fsdp.CPUOffload"
    ),
    # Lightning (its pages document the lightning.pytorch names; the fabric classes are the same objects)
    "lightning.pytorch.core.module.LightningModule": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.core.LightningModule.html",
        "lightning.pytorch.core.LightningModule",
    ),
    "lightning.pytorch.accelerators.accelerator.Accelerator": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.accelerators.Accelerator.html",
        "lightning.pytorch.accelerators.Accelerator",
    ),
    "pl.accelerators.Accelerator": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.accelerators.Accelerator.html",
        "lightning.pytorch.accelerators.Accelerator",
        target="lightning.pytorch.accelerators.Accelerator",
    ),
    "lightning.fabric.plugins.environments.cluster_environment.ClusterEnvironment": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.plugins.environments.ClusterEnvironment.html",
        "lightning.pytorch.plugins.environments.ClusterEnvironment",
    ),
    "lightning.fabric.plugins.io.checkpoint_io.CheckpointIO": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.plugins.io.CheckpointIO.html",
        "lightning.pytorch.plugins.io.CheckpointIO",
    ),
    "lightning.pytorch.plugins.precision.precision.Precision": Link(
        "lightning",
        _LIGHTNING_API + "lightning.pytorch.plugins.precision.Precision.html",
        "lightning.pytorch.plugins.precision.Precision",
    ),
    # transformers (the Hugging Face door)
    "transformers.trainer.Trainer": Link("transformers", "main_classes/trainer", "transformers.Trainer"),
}


def url(name: str) -> str:
    """The address of ``name``'s documentation."""
    link = NAMES[name]
    return f"{ROOTS[link.project]}{link.page}#{link.anchor}"


def inventory(project: str) -> bytes:
    """``project``'s entries of ``NAMES`` as a Sphinx inventory (``objects.inv``, version 2), URIs relative to its
    root; the display name ``-`` keeps the text autodoc wrote."""
    lines = "".join(
        f"{name} py:{link.role} 1 {link.page}#{link.anchor} -\n"
        for name, link in sorted(NAMES.items())
        if link.project == project
    )
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {TITLES[project]}\n"
        "# Version: \n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    return header.encode() + zlib.compress(lines.encode())


def write_inventories(folder: Path) -> dict[str, tuple[str, str]]:
    """Write one inventory per project into ``folder``; return the ``intersphinx_mapping`` that reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    mapping = {}
    for project, root in ROOTS.items():
        path = folder / f"{project}.inv"
        path.write_bytes(inventory(project))
        mapping[project] = (root, str(path))
    return mapping
