"""Fetch the intersphinx inventories of Python, torch and Lightning into docs/_inventories/ (`make docs-inventories`).

The docs build never downloads: it reads the copies committed here (see ``docs/conf.py``). Run this where the
documentation hosts are reachable, check the result with ``python -m sphinx.ext.intersphinx docs/_inventories/X.inv``,
and commit the files to link the names of those projects in the site.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

# name -> the documentation root that the inventory's links are relative to
INVENTORIES = {
    "python": "https://docs.python.org/3/",
    "torch": "https://docs.pytorch.org/docs/stable/",
    "lightning": "https://lightning.ai/docs/pytorch/stable/",
}
FOLDER = Path(__file__).parent / "_inventories"


def main() -> int:
    FOLDER.mkdir(exist_ok=True)
    failed = []
    for name, root in INVENTORIES.items():
        target = FOLDER / f"{name}.inv"
        try:
            with urllib.request.urlopen(root + "objects.inv", timeout=30) as response:
                data = response.read()
        except OSError as error:
            failed.append(f"{name}: {root}objects.inv: {error}")
            continue
        if not data.startswith(b"# Sphinx inventory version 2"):
            failed.append(f"{name}: {root}objects.inv is not a Sphinx inventory (version 2)")
            continue
        target.write_bytes(data)
        print(f"{target}: {len(data)} bytes from {root}objects.inv")
    for line in failed:
        print(f"not fetched: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
