"""Harness API keys, stored hashed: ``python -m gyre.apikeys``.

    python -m gyre.apikeys add KEYS_FILE NAME [--key-out FILE]   # a new key for harness NAME
    python -m gyre.apikeys list KEYS_FILE

The keys file holds one ``NAME SHA256HEX`` line per key (``#`` comments), never a key: the
scheduler reads it (a file or a mounted Secret) and compares ``sha256(presented key)`` in
constant time. ``add`` prints the new key once (or writes it to ``--key-out``, mode 0600,
for a harness to read from a file or a Secret); lose it and issue another. A harness sends
its key in the ``x-gyre-api-key`` metadata of every HarnessService call; the key's name is
the harness's identity (what its limits count against and what owns its executions).

A 256-bit random key makes a plain SHA-256 enough: there is nothing to guess that a slow
password hash would protect.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

METADATA_KEY = "x-gyre-api-key"
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,62})\s+([0-9a-f]{64})$")


def new_key() -> str:
    return "gyre_" + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyFile:
    """The names and hashes of a keys file."""

    def __init__(self, entries: dict[str, str]) -> None:
        self._by_hash = {h: name for name, h in entries.items()}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyFile:
        entries: dict[str, str] = {}
        for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _LINE.match(line)
            if m is None:
                raise ValueError(f"{path}:{n}: expected 'NAME SHA256HEX'")
            entries[m.group(1)] = m.group(2)
        return cls(entries)

    def __len__(self) -> int:
        return len(self._by_hash)

    def names(self) -> list[str]:
        return sorted(self._by_hash.values())

    def verify(self, key: str) -> str | None:
        """The name a key belongs to, or None. Compares digests in constant time."""
        digest = hash_key(key)
        found = None
        for h, name in self._by_hash.items():
            if hmac.compare_digest(h, digest):
                found = name
        return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.apikeys", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_add = sub.add_parser("add", help="issue a key for a harness; print it once")
    p_add.add_argument("file")
    p_add.add_argument("name")
    p_add.add_argument("--key-out", help="write the key to this file (0600) instead of printing it")
    p_list = sub.add_parser("list", help="the harness names of a keys file")
    p_list.add_argument("file")
    args = parser.parse_args(argv)
    if args.cmd == "add":
        if not _LINE.match(f"{args.name} {'0' * 64}"):
            parser.error(f"bad harness name {args.name!r}")
        key = new_key()
        path = Path(args.file)
        existing = path.read_text() if path.exists() else "# harness API keys: NAME SHA256(key)\n"
        path.write_text(
            existing + ("" if existing.endswith("\n") else "\n") + f"{args.name} {hash_key(key)}\n"
        )
        if args.key_out:
            fd = os.open(args.key_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key + "\n")
            print(f"key for {args.name} written to {args.key_out}")
        else:
            print(key)
    else:
        print("\n".join(KeyFile.load(args.file).names()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
