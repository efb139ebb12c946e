"""The committed generated code (gyre/v1) is exactly what scripts/gen_protos.sh produces
from protos/, and every proto enum starts with an _UNSPECIFIED = 0 value."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pool

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path):
    (tmp_path / "gyre" / "v1").mkdir(parents=True)
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        cwd=ROOT,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted(p.name for p in (tmp_path / "gyre" / "v1").iterdir() if p.suffix in (".py", ".pyi"))
    committed = sorted(p.name for p in (ROOT / "gyre" / "v1").iterdir() if p.suffix in (".py", ".pyi"))
    assert fresh == committed
    stale = [
        n
        for n in fresh
        if not filecmp.cmp(tmp_path / "gyre" / "v1" / n, ROOT / "gyre" / "v1" / n, shallow=False)
    ]
    assert not stale, f"regenerate with ./scripts/gen_protos.sh: {stale}"


def test_every_enum_starts_unspecified():
    import gyre.v1.cell_agent_pb2  # noqa: F401
    import gyre.v1.common_pb2  # noqa: F401
    import gyre.v1.packer_pb2  # noqa: F401
    import gyre.v1.router_pb2  # noqa: F401
    import gyre.v1.scheduler_pb2  # noqa: F401

    pool = descriptor_pool.Default()
    for name in ("common", "scheduler", "router", "packer", "cell_agent"):
        fd = pool.FindFileByName(f"gyre/v1/{name}.proto")
        enums = list(fd.enum_types_by_name.values())
        for msg in fd.message_types_by_name.values():
            enums.extend(msg.enum_types)
        for enum in enums:
            first = enum.values[0]
            assert first.number == 0 and first.name.endswith("_UNSPECIFIED"), (name, enum.name)
