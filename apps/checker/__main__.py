"""``python -m apps.checker [--complete] HISTORY...``: verifies merged operation histories
(prints the verdict as JSON; exit status 1 when a promise was broken)."""

from __future__ import annotations

import argparse
import json
import sys

from apps.checker import check_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.checker", description=__doc__)
    parser.add_argument("histories", nargs="+", help="JSONL history files (history_file of each service)")
    parser.add_argument(
        "--complete",
        action="store_true",
        help="the run ended quiet: every dispatched execution must be closed and reported",
    )
    args = parser.parse_args(argv)
    verdict = check_files(args.histories, complete=args.complete)
    print(json.dumps(verdict.to_json(), indent=2))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
