"""The live dashboard: polls the scheduler's status and serves a timeline page (aiohttp).

Embed it in-process with :class:`~services.dashboard.app.DashboardApp`, or run it alone with
``python -m services.dashboard --scheduler HOST:PORT --port 8080``.
"""

from services.dashboard.app import DashboardApp
from services.dashboard.timeline import Timeline, normalize_status

__all__ = ["DashboardApp", "Timeline", "normalize_status"]
