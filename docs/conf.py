"""Sphinx configuration of the lightning_gradkit documentation (``make docs``).

The pages are Markdown (MyST); the API reference comes from the docstrings of the public names (autodoc, Google
style through napoleon). The build reads nothing from the network: see ``intersphinx_mapping`` below.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).parent
# The package from this checkout, installed or not (`make docs` uses the venv's editable install; a bare
# `sphinx-build docs ...` works too).
sys.path.insert(0, str(DOCS.parent / "src"))
sys.path.insert(0, str(DOCS))

from fetch_inventories import INVENTORIES  # noqa: E402 (after the path it needs)

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
exclude_patterns = ["_build", "_inventories"]

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
# is ever downloaded at build time: each project's objects.inv is read from docs/_inventories/ when a copy is
# committed there (`make docs-inventories` fetches them where the network allows), and a project without a copy is
# left out of the mapping: its names (torch.Tensor, lightning.pytorch.Trainer) then render as code without a link,
# instead of failing a `-W` build on a fetch error. The build says which inventories it used.
intersphinx_mapping = {
    name: (url, str(DOCS / "_inventories" / f"{name}.inv"))
    for name, url in INVENTORIES.items()
    if (DOCS / "_inventories" / f"{name}.inv").is_file()
}
print(
    "intersphinx inventories in docs/_inventories: "
    + (", ".join(sorted(intersphinx_mapping)) or "none (names of torch and Lightning are not linked)")
)

html_theme = "furo"
html_title = "lightning_gradkit"
html_static_path: list[str] = []
