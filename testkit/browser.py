"""Headless Chromium for the dashboard's browser tests (scripts/install_browser.sh installs it)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


async def chromium_page(url: str, out_dir: Path) -> tuple[Path, str]:
    """Screenshot and DOM of ``url`` from headless Chromium (fresh profile each run)."""
    png = out_dir / "dashboard.png"
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1280,800",
        "--virtual-time-budget=5000",
    ]
    shot = await asyncio.create_subprocess_exec(
        *base,
        f"--user-data-dir={out_dir / 'profile-shot'}",
        f"--screenshot={png}",
        url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await asyncio.wait_for(shot.wait(), 90) == 0
    dom = await asyncio.create_subprocess_exec(
        *base,
        f"--user-data-dir={out_dir / 'profile-dom'}",
        "--dump-dom",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(dom.communicate(), 90)
    assert dom.returncode == 0
    return png, out.decode()
