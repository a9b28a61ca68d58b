"""Sphinx configuration of the lightning_gradkit documentation (``make docs``).

The pages are Markdown (MyST); the API reference comes from the docstrings of the public names (autodoc, Google
style through napoleon). The names of Python, torch, Lightning and transformers link to their official pages through
inventories written at build time from ``docs/external_names.py``: the build reads nothing from the network. The build
is nitpicky: a reference that resolves nowhere fails it (``nitpick_ignore`` below lists what the site leaves out).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from docutils.nodes import Element
    from sphinx.addnodes import pending_xref
    from sphinx.application import Sphinx
    from sphinx.config import Config
    from sphinx.environment import BuildEnvironment

DOCS = Path(__file__).parent
# The package from this checkout, installed or not (`make docs` uses the venv's editable install; a bare
# `sphinx-build docs ...` works too).
sys.path.insert(0, str(DOCS.parent / "src"))
sys.path.insert(0, str(DOCS))

from external_names import write_inventories  # noqa: E402 (after the path it needs)

project = "lightning_gradkit"
author = "lightning_gradkit contributors"
copyright = "lightning_gradkit contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: `{directive}` fences (the autodoc directives go through `{eval-rst}`) and heading anchors, so that a page
# can link to another page's section (`[text](page.md#section)`).
myst_heading_anchors = 3

# autodoc: a callback's reference is its class docstring and its constructor; the signature shows the arguments,
# their types and defaults as the code has them. Members are listed only where a page asks for them.
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# intersphinx without the network. The build must pass in CI, which reaches no documentation host, so no inventory
# is downloaded: docs/external_names.py maps every name of another project that the site references (as autodoc
# writes it: torch.nn.modules.module.Module, lightning.pytorch.core.module.LightningModule) to its page on that
# project's site, and at the start of the build an inventory per project is written from it into the doctree folder
# (the build folder, git-ignored) and intersphinx reads those files (`_link_external_names` in `setup` below).
intersphinx_mapping: dict[str, tuple[str, str]] = {}

# Every reference must resolve: a name of the site, or one of docs/external_names.py. A docstring that names a new
# torch, Lightning or Python type fails `make docs` until its page is added there. Ignored below: only what the site
# leaves out on purpose, each group with its reason.
nitpicky = True
nitpick_ignore = [
    # gradkit's torch-level classes and modules that do the work behind the documented policies: a policy's docstring
    # (its callback's page) names them, while the site documents the policies only. A reference to a policy itself
    # (`gradkit.ZClip`) or to the loop door links to its page (`_link_torch_root` below).
    ("py:class", "gradkit.step.accumulate.WindowScale"),
    ("py:class", "gradkit.step.host_lag.HostLag"),
    ("py:class", "gradkit.policies.rollback.StepSnapshot"),
    ("py:class", "StepSnapshot"),
    ("py:class", "StepsToSkip"),
    ("py:func", "gradkit.step.replay.replay"),
    ("py:mod", "gradkit.policies.escalation"),
    ("py:mod", "gradkit.doors.distributed_checkpoint"),
    ("py:class", "gradkit.doors.distributed_checkpoint.DistributedState"),
    ("py:mod", "gradkit.policies.forensics"),
    ("py:mod", "gradkit.report.loggers"),
    ("py:mod", "gradkit.step.selection"),
    ("py:mod", "gradkit.policies.signals"),
    ("py:mod", "gradkit.policies.warning_rules"),
    ("py:mod", "lightning_gradkit._deepspeed"),
    ("py:mod", "lightning_gradkit.activation_checkpointing.injection"),
    ("py:mod", "lightning_gradkit.activation_checkpointing.planner"),
    ("py:mod", "lightning_gradkit.diagnostics.autograd_graph"),
    ("py:data", "lightning_gradkit.diagnostics.host_sync.SYNC_CALLS"),
    # the protocol's internals that the documented StepContext, StepStats, Decision, StepOutcome and Policy name: the
    # contexts of each door, the pipeline's record of a step, the roster and micro-batch records, the helpers of the
    # protocol and of the callbacks' checks
    ("py:class", "gradkit.doors.loop.LoopContext"),
    ("py:class", "gradkit.step.pipeline.StepRecord"),
    ("py:class", "gradkit.step.pp_stages.PipelineStages"),
    ("py:class", "lightning_gradkit.trainer_door.TrainerContext"),
    ("py:class", "MicroBatch"),
    ("py:class", "gradkit.step.protocol.MicroBatch"),
    ("py:class", "gradkit.step.norms.ParamIndex"),
    ("py:class", "gradkit.step.plan.UnitNorms"),
    ("py:class", "Snapshot"),
    ("py:class", "ReplicaCheck"),
    # torch documents ProcessGroup without an object entry of its own to link (expert_parallel's `group` type)
    ("py:class", "torch.distributed.distributed_c10d.ProcessGroup"),
    ("py:class", "Roster"),
    ("py:func", "is_policy"),
    ("py:func", "selective_policy"),
    ("py:func", "find_inference_tensors"),
    ("py:func", "inference_mode_unsafe_reason"),
    # members named in a docstring in single backticks (the default role) that the reference does not list:
    # the pipeline record's methods, a callback's attributes, HFGradKit.kit
    ("py:meth", "add_skip"),
    ("py:meth", "multiply_scale"),
    ("py:meth", "release_gradients"),
    ("py:attr", "framework_report"),
    ("py:attr", "report"),
    ("py:attr", "reports"),
    ("py:attr", "sampled"),
    ("py:attr", "snapshot_bytes"),
    ("py:attr", "trainer_only"),
    ("py:attr", "HFGradKit.kit"),
    # private type aliases in the signature of Lightning's FSDPStrategy (inherited by GradKitFSDPStrategy), defined
    # under TYPE_CHECKING only and documented nowhere
    ("py:class", "_POLICY"),
    ("py:class", "_SHARDING_STRATEGY"),
]


html_theme = "furo"
html_title = "lightning_gradkit"
html_static_path: list[str] = []


def _link_external_names(app: Sphinx, config: Config) -> None:
    """Write the inventories of docs/external_names.py into the doctree folder and point intersphinx at them (before
    intersphinx validates its mapping, priority 800)."""
    config.intersphinx_mapping = write_inventories(Path(app.doctreedir) / "external_names")


def _link_torch_root(app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: Element) -> Element | None:
    """A reference into a module of the torch root (``gradkit.ZClip``,
    ``gradkit.GradKit.note_loss``) links to where the site documents that class under its public name: the loop
    door as ``gradkit.GradKit``, a policy on its callback's page (``lightning_gradkit.ZClip``, the same docstring)."""
    parts = node.get("reftarget", "").split(".")
    if node.get("refdomain") != "py" or parts[0] != "gradkit":
        return None
    domain = env.get_domain("py")
    for i, part in enumerate(parts[1:], start=1):
        if part[:1].isupper():  # the class, after its module's path
            name = ".".join(parts[i:])
            known = domain.objects  # type: ignore[attr-defined]
            public = next((p for p in (f"gradkit.{name}", f"lightning_gradkit.{name}") if p in known), None)
            if public is None:
                return None
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)
    return None


def setup(app: Sphinx) -> None:
    app.connect("config-inited", _link_external_names, priority=500)
    app.connect("missing-reference", _link_torch_root)
