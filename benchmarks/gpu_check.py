"""``make gpu-check``: the GPU proof in one command, one results file.

On a machine with CUDA (no network needed) it runs, each as a subprocess with a time limit and all of it within
8 minutes: the ``gpu``-marked tests, the sync count (``bench_gpu_syncs.py``), the norm pass against the bandwidth
floor (``bench_norm_floor.py``) and the whole-step benchmark at 4 x 256 and 12 x 768 (``bench_gpu_step.py``). It
writes ``gpu-check-results/results.md`` (device, versions, the test summary, every benchmark's output and its
PASS/FAIL lines) and ``results.json`` (the same, with each benchmark's JSON). Without CUDA it says it skipped and
exits 0.

The interpreter is the one that runs this script (``make gpu-check GPU_PYTHON=...``); the package comes from
``src/`` (put on ``PYTHONPATH`` here) or from an install (``pip install --no-deps -e .``).

    python3 benchmarks/gpu_check.py [--out gpu-check-results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 470  # the whole check, under 8 minutes


@dataclass
class Part:
    title: str
    argv: list[str]
    timeout_s: int
    json_name: str | None = None
    ok_codes: tuple[int, ...] = (0,)
    rc: int | None = None
    seconds: float = 0.0
    output: str = ""
    timed_out: bool = False
    data: dict[str, Any] = field(default_factory=dict)


def parts(out: Path) -> list[Part]:
    py = sys.executable
    bench = ROOT / "benchmarks"
    return [
        # pytest exits 5 when it collects no test: no gpu-marked test is not a failure of the check.
        Part("gpu-marked tests", [py, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider"], 150,
             ok_codes=(0, 5)),
        Part("sync count (bench_gpu_syncs.py)", [py, str(bench / "bench_gpu_syncs.py"), "--steps", "12"], 60,
             "syncs.json"),
        Part("norm pass vs floor (bench_norm_floor.py)", [py, str(bench / "bench_norm_floor.py"), "--iters", "30"], 40,
             "norm_floor.json"),
        Part("whole step, GPT 4 x 256 (bench_gpu_step.py --small)",
             [py, str(bench / "bench_gpu_step.py"), "--small", "--steps", "60", "--warmup", "15", "--repeats", "3"],
             80, "step_small.json"),
        Part("whole step, GPT 12 x 768 (bench_gpu_step.py)",
             [py, str(bench / "bench_gpu_step.py"), "--steps", "60", "--warmup", "15", "--repeats", "3"], 140,
             "step_default.json"),
    ]  # fmt: skip


def run(part: Part, out: Path, env: dict[str, str], deadline: float) -> None:
    argv = list(part.argv)
    if part.json_name:
        argv += ["--json", str(out / part.json_name)]
    limit = max(1, min(part.timeout_s, int(deadline - time.monotonic())))
    print(f"gpu-check: {part.title} (limit {limit} s): {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        part.rc, part.output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        part.timed_out = True
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        part.output = partial + f"\n(timed out after {limit} s)"
    part.seconds = time.monotonic() - t0
    if part.json_name and (out / part.json_name).exists():
        part.data = json.loads((out / part.json_name).read_text())
    print(part.output.rstrip()[-3000:], flush=True)


def verdict(part: Part) -> str:
    if part.timed_out:
        return "TIMEOUT"
    if part.rc == 5 and 5 in part.ok_codes:
        return "no test collected"
    return "ok" if part.rc in part.ok_codes else f"FAIL (exit {part.rc})"


def summary(part: Part) -> str:
    """pytest's last summary line, or the count of a benchmark's PASS and FAIL lines."""
    if part.argv[1:3] == ["-m", "pytest"]:
        found = re.findall(
            r"^=*\s*(.*\b(?:passed|failed|skipped|error|errors|no tests ran)\b.*?)\s*=*$", part.output, re.M
        )
        return found[-1] if found else "-"
    passed, failed = (len(re.findall(rf"\b{w}\b", part.output)) for w in ("PASS", "FAIL"))
    return f"{passed} PASS, {failed} FAIL" if passed or failed else "-"


def environment() -> dict[str, str]:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        info["lightning"] = "not importable"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not importable"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info["commit"] = head.stdout.strip() or "unknown (not a git checkout)"
    return info


def shown(argv: list[str]) -> str:
    """A command line as run from the repository root with ``python``."""
    return " ".join(["python", *(a.removeprefix(f"{ROOT}{os.sep}") for a in argv[1:])])


def markdown(info: dict[str, str], done: list[Part], seconds: float) -> str:
    lines = ["# gpu-check results", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- command: `make gpu-check` ({seconds:.0f} s in all)", "", "## Summary", ""]
    lines += ["| part | status | summary | seconds |", "| --- | --- | --- | ---: |"]
    lines += [f"| {p.title} | {verdict(p)} | {summary(p)} | {p.seconds:.0f} |" for p in done]
    targets = [m for p in done for m in re.findall(r"^.*\b(?:PASS|FAIL)\b.*$", p.output, flags=re.M)]
    if targets:
        lines += ["", "Targets:", "", *[f"    {t.strip()}" for t in targets]]
    for p in done:
        lines += ["", f"## {p.title}", "", f"`{shown(p.argv)}`", ""]
        lines += ["```", p.output.rstrip()[-12000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check-results", help="results folder")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: torch is not importable by {sys.executable} (set GPU_PYTHON)")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device (torch {torch.__version__}, {sys.executable}); nothing written")
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    info = environment()
    start = time.monotonic()
    deadline = start + BUDGET_S
    done: list[Part] = []
    for part in parts(out):
        if time.monotonic() >= deadline:
            part.timed_out, part.output = True, "(not run: the 8-minute budget was spent)"
        else:
            run(part, out, env, deadline)
        done.append(part)
    seconds = time.monotonic() - start
    (out / "results.md").write_text(markdown(info, done, seconds))
    payload = {
        "environment": info,
        "seconds": seconds,
        "parts": [
            {"title": p.title, "argv": p.argv, "rc": p.rc, "status": verdict(p), "seconds": p.seconds, "data": p.data}
            for p in done
        ],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    failed = [p.title for p in done if verdict(p) not in ("ok", "no test collected")]
    print(f"gpu-check: wrote {out / 'results.md'} and results.json in {seconds:.0f} s")
    print(f"gpu-check: {'FAIL: ' + '; '.join(failed) if failed else 'all parts passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
