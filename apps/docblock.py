"""Generated blocks in hand-written pages: a benchmark or the demo report writes its current
figures between two HTML-comment markers and leaves the rest of the page as it was, with the
commit that produced them. One implementation for every page (the README,
docs/benchmarks.md, docs/benchmarks/*.md) and every result file."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_commit() -> str:
    """The checkout's commit (short), with ``+dirty`` for uncommitted changes to tracked
    files; ``?`` outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{sha}+dirty" if dirty else sha


def replace_block(
    path: Path, begin: str, end: str, block: str, *, title: str | None = None, placeholder: str | None = None
) -> None:
    """Writes ``block`` (which starts with ``begin`` and ends with ``end``) into ``path``:
    over the text between the markers when they are there, else in place of ``placeholder``,
    else as a new page headed ``title`` when ``path`` does not exist. A page with neither is
    an error (SystemExit): writing the block anywhere else would guess where it belongs."""
    if not path.exists():
        if title is None:
            raise SystemExit(f"{path}: no such page")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {title}\n\n{block}\n")
        return
    text = path.read_text()
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        path.write_text(head + block + rest.split(end, 1)[1])
    elif placeholder is not None and placeholder in text:
        path.write_text(text.replace(placeholder, block, 1))
    else:
        raise SystemExit(f"{path}: no generated block ({begin}) to replace")
