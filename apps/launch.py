"""The local launcher: a private etcd and every service as processes, from one config file.

    python -m apps.launch --config deploy/local/cluster.yaml [--free-ports] [--run-dir DIR]

The config file is the cluster config every service reads, plus a ``launch:`` section::

    launch:
      etcd: {}                      # a private etcd on cluster.etcd_endpoints[0] (upkeep:
                                    # apps/etcd_upkeep.py)
      processes:                    # started in order, each waits for its ready line
        - {service: packer}
        - {service: cell_agent, name: cell-0, set: {cell_id: cell-0, kind: elastic, index: 0, port: 50060}}

``--free-ports`` remaps every loopback port of the file to a free one (tests, parallel
runs). TLS is on by default: certificates are made on first start under ``--certs-dir``
(default ``<run-dir>/certs``; ``{certs_dir}`` in the file stands for it) and the private
etcd runs with TLS and a user per identity (see :mod:`apps.pki`). Logs go to ``<run-dir>/logs/<name>.log``.

The launcher supervises what it started like an orchestrator (:mod:`apps.supervise`): a
process that exits is restarted with back-off and jitter and rejoins (etcd too, on its
data); ``launch.restart`` tunes the policy (``enabled: false`` turns restarts off) and
``restart: false`` on a process exempts it. A first start that fails (exits or is not
ready in time) is tried again up to ``FIRST_START_RETRIES`` times after the same back-off,
except a configuration error (status 2). Events go to ``<run-dir>/supervisor.jsonl``.
Everything it started dies with it, however it dies (:mod:`gyre.lifeline`). It stops
everything in reverse order on Ctrl-C, SIGTERM, or when a process is given up on
(restarted too often: ``launch.restart.max_restarts`` within ``window_s``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from apps.etcd_upkeep import EtcdUpkeep
from apps.limits import check_sequence_limits, check_shared_settings
from apps.pki import LaunchPki
from apps.procs import ServiceProcess
from apps.supervise import RestartPolicy, Supervisor, SupervisorEvent
from gyre.etcd.server import EtcdServer
from gyre.ports import free_port

FIRST_START_RETRIES = 2
"""How many times the launcher tries a process's first start again before the launch fails."""

_PORT_RE = re.compile(r"(?P<pre>(?:127\.0\.0\.1|localhost):|port: )(?P<port>\d{2,5})\b")


def remap_ports(text: str) -> str:
    """Replaces every loopback port in a config text with a free one, consistently."""
    mapping: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        port = m.group("port")
        if port == "0":
            return m.group(0)
        if port not in mapping:
            mapping[port] = str(free_port())
        return m.group("pre") + mapping[port]

    return _PORT_RE.sub(sub, text)


class Cluster:
    """etcd + service processes described by one config file."""

    def __init__(
        self,
        config_path: str | Path,
        run_dir: str | Path,
        free_ports: bool = False,
        env: dict[str, str] | None = None,
        certs_dir: str | Path | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # "{run_dir}" in the file stands for this run's folder (WAL, checkpoints, ...).
        text = Path(config_path).read_text().replace("{run_dir}", str(self.run_dir.resolve()))
        certs_dir = Path(certs_dir or self.run_dir / "certs").resolve()
        text = text.replace("{certs_dir}", str(certs_dir))
        if free_ports:
            text = remap_ports(text)
        self.config_path = self.run_dir / "cluster.yaml"
        self.config: dict[str, Any] = yaml.safe_load(text)
        self.pki = LaunchPki(self.config, certs_dir)
        # Cell incarnation records (services/cell_agent/incarnation.py) per run, never shared
        # with another launcher's cells of the same name on this machine.
        changed = self.pki.changed
        if self._has_cells() and not (self.config.get("cell_agent") or {}).get("pid_dir"):
            self.config["cell_agent"] = {
                **(self.config.get("cell_agent") or {}),
                "pid_dir": str((self.run_dir / "pids").resolve()),
            }
            changed = True
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False) if changed else text)
        check_sequence_limits(self.config_path)  # before anything starts
        check_shared_settings(self.config_path)
        self.env = dict(env or {})
        self.etcd: EtcdServer | None = None
        self.etcd_upkeep: EtcdUpkeep | None = None
        self.procs: dict[str, ServiceProcess] = {}
        self.supervisor = Supervisor(
            RestartPolicy.from_config(self.launch.get("restart")), journal=self.run_dir / "supervisor.jsonl"
        )
        self._rng = random.Random()

    def _has_cells(self) -> bool:
        return any(p.get("service") == "cell_agent" for p in (self.launch.get("processes") or []))

    @property
    def launch(self) -> dict[str, Any]:
        return self.config.get("launch") or {}

    def start_etcd(self) -> None:
        if "etcd" not in self.launch:
            return
        endpoint = (self.config.get("cluster") or {}).get("etcd_endpoints", ["127.0.0.1:23790"])[0]
        port = int(endpoint.rpartition(":")[2])
        self.etcd = EtcdServer(
            data_dir=str(self.run_dir / "etcd"),
            client_port=port,
            log_path=str(self.run_dir / "logs" / "etcd.log"),
            tls_dir=self.pki.etcd_tls_dir,
        )
        self.etcd.start()
        self.pki.provision_etcd(self.etcd.endpoint)
        self.etcd_upkeep = EtcdUpkeep.from_config(
            dict(self.launch.get("etcd") or {}),
            self.etcd.endpoint,
            self.pki.tls("root"),
            self.supervisor.record,
        )

    def process_specs(self) -> list[dict[str, Any]]:
        return list(self.launch.get("processes") or [])

    def start_process(self, spec: dict[str, Any], timeout_s: float = 120.0) -> ServiceProcess:
        name = spec.get("name") or spec["service"]
        proc = ServiceProcess(
            spec["service"],
            self.config_path,
            overrides=spec.get("set") or {},
            env={
                **self.pki.child_env(),
                **self.env,
                **{k: str(v) for k, v in (spec.get("env") or {}).items()},
            },
            log_path=self.run_dir / "logs" / f"{name}.log",
            name=name,
        )
        self.procs[name] = proc
        # A first start that fails (a port taken meanwhile, etcd slow to answer, ...) is tried
        # again like a restart, after the policy's back-off: it would otherwise end the whole
        # launch. Not a configuration error (status 2), which fails the same way every time.
        policy = self.supervisor.policy
        retries = FIRST_START_RETRIES if policy.enabled and spec.get("restart") is not False else 0
        for attempt in range(1, retries + 2):
            try:
                proc.start(timeout_s=spec.get("ready_timeout_s", timeout_s))
                return proc
            except RuntimeError as exc:
                proc.after_exit()
                if attempt > retries or proc.returncode() == 2:
                    raise
                delay_s = policy.delay_s(attempt, self._rng)
                error = str(exc).splitlines()[0]
                self.supervisor.record(
                    name, "start_failed", error=error, attempt=attempt, delay_s=round(delay_s, 2)
                )
                time.sleep(delay_s)
        raise AssertionError("unreachable")

    def start(self, progress: Any = None) -> Cluster:
        issued = self.pki.prepare()
        if progress and issued:
            progress("certificates", f"{len(issued)} issued in {self.pki.root}")
        self.start_etcd()
        if progress:
            progress("etcd", self.etcd.endpoint if self.etcd else "external")
        try:
            # Consecutive processes of the same service (the cells) start together: each
            # engine start is mostly waiting on its own model load.
            for batch in _runs(self.process_specs(), lambda spec: spec["service"]):
                errors: list[BaseException] = []

                def start_one(spec: dict[str, Any], errors: list[BaseException] = errors) -> None:
                    try:
                        proc = self.start_process(spec)
                        if progress:
                            progress(proc.name, proc.target)
                    except BaseException as exc:  # re-raised below, after the batch
                        errors.append(exc)

                threads = [threading.Thread(target=start_one, args=(spec,)) for spec in batch]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
        except BaseException:
            self.stop()
            raise
        self.supervise()
        return self

    def supervise(self) -> None:
        """Puts etcd and every process whose spec does not say ``restart: false`` under the
        supervisor (restart with back-off when it exits) and starts it."""
        if self.etcd is not None:
            self.supervisor.add(_EtcdChild(self.etcd))
        if self.etcd_upkeep is not None:
            self.etcd_upkeep.start()
        exempt = {
            spec.get("name") or spec["service"]
            for spec in self.process_specs()
            if spec.get("restart") is False
        }
        for name, proc in self.procs.items():
            if name not in exempt:
                self.supervisor.add(proc)
        self.supervisor.start()

    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process name (``etcd`` included)."""
        return self.supervisor.restarts()

    def events(self) -> list[SupervisorEvent]:
        """The supervisor's events so far (exits, back-offs, restarts, give-ups)."""
        return self.supervisor.events()

    def dead(self) -> list[str]:
        """Processes the run cannot go on without: given up on by the supervisor, or exited
        where restarts are off (or the process is exempt)."""
        supervised = (
            {s["name"] for s in self.supervisor.status()} if self.supervisor.policy.enabled else set()
        )
        gone = [
            name
            for name, p in self.procs.items()
            if name not in supervised and p.proc is not None and not p.alive()
        ]
        return self.supervisor.failed() + gone

    def stop(self) -> None:
        """Stops every process, the last started first; the processes of one service (the
        cells) stop together, each with its own graceful drain."""
        if self.etcd_upkeep is not None:
            self.etcd_upkeep.stop()
        self.supervisor.stop()
        for _ in range(2):  # again for a restart that was still starting during the first pass
            for group in reversed(_runs(self.procs.values(), lambda proc: proc.service)):
                with concurrent.futures.ThreadPoolExecutor(len(group)) as pool:
                    list(pool.map(lambda p: p.stop(), group))
            self.supervisor.join_restarts(30.0)
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.config.get(name) or {})


class _EtcdChild:
    """The private etcd as a supervised child (restarted on its data and ports)."""

    name = "etcd"

    def __init__(self, server: EtcdServer) -> None:
        self.server = server

    @property
    def pid(self) -> int:
        return self.server.pid

    def alive(self) -> bool:
        return self.server.running()

    def start(self) -> None:
        self.server.start()

    def after_exit(self) -> None:
        """etcd starts nothing of its own."""

    def returncode(self) -> int | None:
        return self.server.returncode


T = TypeVar("T")


def _runs(items: Iterable[T], service: Callable[[T], str]) -> list[list[T]]:
    """Runs of consecutive items of one service, in order (the processes that start, or
    stop, together)."""
    return [list(run) for _, run in itertools.groupby(items, key=service)]


def _status_table(cluster: Cluster) -> Any:
    from rich.table import Table

    table = Table(title=f"gyre cluster ({cluster.run_dir})")
    for col in ("process", "pid", "target", "state", "restarts"):
        table.add_column(col)
    restarts = cluster.restarts()
    states = {s["name"]: s["state"] for s in cluster.supervisor.status()}
    if cluster.etcd is not None:
        up = cluster.etcd.running()
        table.add_row(
            "etcd",
            str(cluster.etcd.pid if up else "-"),
            cluster.etcd.endpoint,
            "[green]up" if up else f"[red]{states.get('etcd', 'down')}",
            str(restarts.get("etcd", 0)),
        )
    for name, p in cluster.procs.items():
        alive = p.alive()
        state = (
            "[green]up" if alive else f"[red]{states.get(name, 'exited')} {p.returncode() if p.proc else ''}"
        )
        table.add_row(name, str(p.pid if alive else "-"), p.target, state, str(restarts.get(name, 0)))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m apps.launch", description="Start etcd and every Gyre service locally."
    )
    parser.add_argument("--config", default="deploy/local/cluster.yaml")
    parser.add_argument("--run-dir", default=f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--free-ports", action="store_true", help="remap every loopback port to a free one")
    parser.add_argument(
        "--certs-dir",
        default=None,
        help="identity directories (made on first start; default <run-dir>/certs)",
    )
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.live import Live

    console = Console()
    cluster = Cluster(args.config, args.run_dir, free_ports=args.free_ports, certs_dir=args.certs_dir)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start(progress=lambda name, target: console.print(f"[bold green]started[/] {name} {target}"))
        cluster.supervisor.subscribe(
            lambda e: console.print(f"[yellow]supervisor[/] {e.name} {e.kind} {e.detail}")
        )
        console.print(
            f"config: {cluster.config_path}; logs: {cluster.run_dir / 'logs'}; Ctrl-C stops everything"
        )
        with Live(_status_table(cluster), console=console, refresh_per_second=1) as live:
            while not stop.wait(1.0):
                live.update(_status_table(cluster))
                if cluster.dead():
                    console.print(
                        f"[red]given up on: {', '.join(cluster.dead())} "
                        f"(see {cluster.run_dir / 'supervisor.jsonl'}); stopping"
                    )
                    return 1
        return 0
    finally:
        console.print("stopping ...")
        cluster.stop()
        console.print("stopped")


if __name__ == "__main__":
    sys.exit(main())
