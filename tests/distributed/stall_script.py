"""A job with no torch in it (it starts in a fraction of a second), for the launcher's own tests.

Every start appends its ``MASTER_PORT`` and process-group timeout to ``--tries`` and writes ``try<n>.txt`` into
``--out``; a start whose number is at most ``--stall`` sleeps past any timeout, later ones exit with ``--exit`` (0
after writing the rank's result).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tries", type=Path, required=True)
    parser.add_argument("--stall", type=int, default=0)
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()
    with args.tries.open("a") as tries:
        tries.write(f"{os.environ['MASTER_PORT']} {os.environ['GRADKIT_TEST_PG_TIMEOUT_S']}\n")
    attempt = len(args.tries.read_text().splitlines())
    (args.out / f"try{attempt}.txt").write_text("")
    if attempt <= args.stall:
        time.sleep(3600)
    if args.exit == 0:
        (args.out / "rank0.json").write_text(json.dumps({"attempt": attempt}))
    raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
