"""The dashboard's aiohttp application: the status poller and the HTTP routes.

``DashboardApp(status_source).make_app()`` gives an :class:`aiohttp.web.Application` whose
start-up launches a poller task (one ``status_source()`` call every ``poll_interval_s``,
folded into a :class:`~services.dashboard.timeline.Timeline`) and whose clean-up cancels it.
Routes:

- ``GET /``: one self-contained HTML page (inline JS drawing on a canvas, no external
  resources) that fetches ``/api/timeline`` every second;
- ``GET /api/timeline[?window_s=S]``: the timeline as JSON (the last S seconds of it);
- ``GET /healthz``: liveness, with the poller's counters;
- ``GET /metrics``: the scheduler's status as Prometheus gauges (``gyre_status_*``).

The demo runner embeds it in-process with :meth:`DashboardApp.start`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from services.dashboard import metrics
from services.dashboard.source import EventSource, StatusSource
from services.dashboard.timeline import Timeline

log = logging.getLogger(__name__)

PAGE_PATH = Path(__file__).with_name("static") / "index.html"
TIMELINE_KEY = web.AppKey("timeline", Timeline)


class DashboardApp:
    """Polls ``status_source`` and serves the timeline.

    ``status_source`` is an async callable returning a SchedulerStatus-like dict;
    ``events_source`` (optional) streams SchedulerEvent-like dicts after a sequence number;
    ``clock`` (monotonic seconds) is injectable so tests can drive time.
    """

    def __init__(
        self,
        status_source: StatusSource,
        *,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 2.0,
        max_samples: int = 7200,
        clock: Callable[[], float] = time.monotonic,
        title: str = "Gyre",
        events_source: EventSource | None = None,
        events_retry_s: float = 1.0,
    ) -> None:
        if poll_interval_s <= 0 or poll_timeout_s <= 0:
            raise ValueError("poll_interval_s and poll_timeout_s must be > 0")
        self._source = status_source
        self._events_source = events_source
        self.events_retry_s = events_retry_s
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._clock = clock
        self._t0 = clock()
        self.timeline = Timeline(max_samples)
        self._registry = metrics.make_registry(self.timeline)
        self.title = title
        self._page = PAGE_PATH.read_text(encoding="utf-8").replace("{{TITLE}}", _html_escape(title))
        self._last_logged_error = ""

    def now_s(self) -> float:
        """Seconds since this dashboard started (the timeline's time axis)."""
        return self._clock() - self._t0

    async def poll_once(self) -> bool:
        """One poll; True when a status was added. Errors are recorded, never raised."""
        t_s = self.now_s()
        try:
            status = await asyncio.wait_for(self._source(), self.poll_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any source failure is a failed poll, shown on the page
            message = f"{type(exc).__name__}: {exc}"
            self.timeline.record_error(t_s, message)
            self._log_error(message)
            return False
        try:
            added = self.timeline.add(max(t_s, self.timeline.last_t_s), status)
        except ValueError as exc:  # malformed status: already counted by the timeline
            self._log_error(str(exc))
            return False
        if self._last_logged_error:
            log.info("status polls recovered")
            self._last_logged_error = ""
        return added

    def _log_error(self, message: str) -> None:
        if message != self._last_logged_error:  # log each distinct failure once in a row
            log.warning("dashboard source failed", extra={"error": message})
            self._last_logged_error = message

    async def run_poller(self) -> None:
        """Polls until cancelled, one call every ``poll_interval_s`` (no overlap)."""
        while True:
            started = self._clock()
            await self.poll_once()
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self.poll_interval_s - elapsed))

    async def run_events(self) -> None:
        """Follows the event source until cancelled; failures are counted and retried."""
        assert self._events_source is not None
        after = 0
        while True:
            got = False
            try:
                async for raw in self._events_source(after):
                    try:
                        self.timeline.add_event(raw)
                    except ValueError as exc:
                        self.timeline.stats.event_errors += 1
                        self._log_error(f"malformed event: {exc}")
                        continue
                    after = max(after, int(raw.get("seq", 0)))
                    got = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the scheduler went away: retry; duplicates are dropped
                self.timeline.stats.event_errors += 1
                self._log_error(f"event stream: {type(exc).__name__}: {exc}")
                after = 0  # a new leader numbers its events afresh
                await asyncio.sleep(self.events_retry_s)
                continue
            if not got:  # an empty bounded stream: do not spin
                await asyncio.sleep(self.events_retry_s)

    def make_app(self) -> web.Application:
        """The aiohttp application; its start-up starts the poller, its clean-up stops it."""
        app = web.Application(client_max_size=64 * 1024)
        app[TIMELINE_KEY] = self.timeline
        app.router.add_get("/", self._index)
        app.router.add_get("/api/timeline", self._timeline)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.cleanup_ctx.append(self._poller_ctx)
        return app

    async def _poller_ctx(self, _app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.run_poller(), name="dashboard.poller")]
        if self._events_source is not None:
            tasks.append(asyncio.create_task(self.run_events(), name="dashboard.events"))
        yield
        for task in tasks:
            task.cancel()
        # The tasks' own CancelledErrors come back as results; a cancellation of this
        # clean-up itself still propagates out of gather.
        await asyncio.gather(*tasks, return_exceptions=True)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
        """Serves the dashboard on ``host:port`` in the running loop; returns the runner (call
        ``await runner.cleanup()`` to stop) and the bound port."""
        runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        return runner, int(bound)

    async def _index(self, _request: web.Request) -> web.Response:
        return web.Response(text=self._page, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def _timeline(self, request: web.Request | None) -> web.Response:
        window_s = None
        raw = request.query.get("window_s") if request is not None else None
        if raw is not None:
            try:
                window_s = float(raw)
            except ValueError:
                raise web.HTTPBadRequest(text="window_s must be a number of seconds") from None
            if not 0 < window_s < 1e9:
                raise web.HTTPBadRequest(text="window_s must be > 0")
        body: dict[str, Any] = self.timeline.to_json(self.now_s(), window_s)
        body["poll_interval_s"] = self.poll_interval_s
        body["title"] = self.title
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.render(self._registry), headers={"Content-Type": metrics.CONTENT_TYPE}
        )

    async def _healthz(self, _request: web.Request) -> web.Response:
        stats = self.timeline.stats
        last_ok_age = None if stats.last_ok_s is None else round(self.now_s() - stats.last_ok_s, 3)
        return web.json_response(
            {
                "ok": True,
                "polls": stats.polls,
                "polls_ok": stats.ok,
                "poll_errors": stats.errors,
                "last_ok_age_s": last_ok_age,
                "last_error": stats.last_error,
            }
        )


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
