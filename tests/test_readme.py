"""The README is what a visitor needs: the two commands, an install, the quick start and links into the docs site.
Its quick start is the getting-started page's and runs as written (without jsonargparse; without matplotlib); its
commands are accepted and its links lead to pages and sections that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_docs import Block, _check_make, _check_pip, _commands

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def quick_start(path: Path) -> str:
    (snippet,) = re.findall(r"## Quick start\n\n```python\n(.*?)```", path.read_text(), re.S)
    return snippet


def test_readme_quick_start_is_the_getting_started_one() -> None:
    """One quick start: the README's is the docs' (whose run tests/test_docs.py checks), character for character."""
    assert quick_start(README) == quick_start(ROOT / "docs" / "getting_started.md")


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and MyST's ``myst_heading_anchors``) gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_lead_to_files_and_sections_that_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 15, local  # the README points into the site for everything it no longer carries
    broken = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists():
            broken.append(link)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(link)
    assert not broken, f"README links to missing files or sections: {broken}"
    pages = {link.partition("#")[0] for link in local if link.startswith("docs/")}
    assert {"docs/index.md", "docs/getting_started.md", "docs/callbacks/index.md", "docs/limitations.md"} <= pages


def test_readme_commands_are_accepted() -> None:
    """The fenced shell blocks: `make demo` and `make test` first, each `make` target exists (``make -n``), each
    `pip` line names extras pyproject.toml declares."""
    text = README.read_text()
    shell = [m for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)]
    commands = [
        argv for m in shell for argv in _commands(Block("README.md", text.count("\n", 0, m.start()) + 1, "bash", m[1]))
    ]
    assert commands[:2] == [["make", "demo"], ["make", "test"]], commands[:2]
    for argv in commands:
        match argv:
            case ["make", *rest]:
                _check_make(rest)
            case ["pip", ("install" | "wheel"), *_]:
                _check_pip(argv[1:])
            case _:
                raise AssertionError(f"README.md: no check for `{' '.join(argv)}`")


def test_quick_start_runs_without_jsonargparse(tmp_path: Path) -> None:
    """The README's quick start, as written (two optimizer steps instead of 48), in a process where `jsonargparse`
    cannot be imported: only LightningCLI needs it (the `cli` extra)."""
    snippet = quick_start(README)
    assert "max_steps=48" in snippet
    blocker = (
        "import sys\n"
        "class _NoJsonargparse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'jsonargparse':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoJsonargparse())\n"
    )
    script = blocker + snippet.replace("max_steps=48", "max_steps=2") + "assert 'jsonargparse' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.glob("lightning_logs/version_*/gradient_report.png"))


def site_packages_without(tmp_path: Path, *prefixes: str) -> Path:
    """A copy of this interpreter's site-packages made of links, less the entries whose names start with one of
    ``prefixes`` (the package, its ``.dist-info``): an environment where those packages were never installed, for
    the import system and for ``importlib.metadata`` alike (torchmetrics and Lightning ask the latter)."""
    import site

    (source,) = [Path(p) for p in site.getsitepackages() if Path(p).name == "site-packages"]
    mirror = tmp_path / "site-packages"
    mirror.mkdir()
    for entry in source.iterdir():
        if not entry.name.lower().startswith(prefixes):
            (mirror / entry.name).symlink_to(entry)
    return mirror


def test_quick_start_runs_after_a_plain_install_without_matplotlib(tmp_path: Path) -> None:
    """`pip install .` brings no matplotlib (the `report` extra does): the quick start, as written (two optimizer
    steps instead of 48), runs in an environment without it; `report=True` says in one line, at the user's
    `trainer.fit(...)` line, that it draws nothing and how to get the figure."""
    snippet = quick_start(README)
    assert "GradNormMonitor(report=True)" in snippet
    mirror = site_packages_without(tmp_path, "matplotlib", "mpl_toolkits", "pylab")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (
        "import site, sys, warnings\n"
        f"site.addsitedir({str(mirror)!r})\n"
        f"sys.path.insert(0, {str(ROOT / 'src')!r})\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        + "".join(f"    {line}\n" for line in snippet.replace("max_steps=48", "max_steps=2").splitlines())
        + "assert 'matplotlib' not in sys.modules\n"
        "notes = [w for w in caught if 'matplotlib' in str(w.message)]\n"
        "assert len(notes) == 1, [str(w.message) for w in notes]\n"
        "print(notes[0].filename, notes[0].lineno, str(notes[0].message), sep='|')\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=run_dir, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    filename, line, message = done.stdout.strip().splitlines()[-1].split("|")
    assert "\n" not in message and "pip install" in message and "matplotlib" in message
    # The note names the user's line (`trainer.fit(...)`), not a file of gradkit or Lightning.
    assert (filename, int(line)) == ("<string>", script.count("\n", 0, script.index("trainer.fit(")) + 1)
    assert not list(run_dir.glob("lightning_logs/version_*/gradient_report.png"))
    assert list(run_dir.glob("lightning_logs/version_*/gradkit_run.json"))  # the run itself went on and logged
