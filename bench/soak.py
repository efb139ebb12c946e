"""Soak: does anything grow without bound while Gyre runs for hours?

Runs the demo with mock engines and the real trainers (``python -m apps.demo --engine mock``,
the default policy) for ``--bursts`` bursts, or about ``--minutes`` minutes, and samples every
``--interval-s`` seconds:

- each service's resident memory, its anonymous part (``RssAnon``: heap and arenas, apart
  from mapped files such as etcd's database) and its open file descriptors (found in
  ``/proc`` by the run folder in its command line: every process the launcher starts names
  its config there);
- the run folder's disk: the packer's WAL, the checkpoints, the histories, the logs;
- etcd's database file (``member/snap/db``, the bbolt file whose size is etcd's ``dbSize``),
  and from etcd's ``/metrics`` (over mutual TLS with the run's operator certificate) its
  revision, its compacted revision, its keys, the database's size in use, and its Go heap,
  goroutines, watchers and leases.

With ``--chaos`` the demo's chaos schedule repeats while it soaks (``--chaos-repeat``: each
fault of apps/demo/chaos.py in turn, round after round, until the work is done).

It reports each series' slope per hour, fitted by least squares after the warm-up (the first
``--warmup`` share of the samples), with the executions, the versions and the history
checker's verdict of the run, into ``bench/results/soak.json`` and a plot per series.

    python bench/soak.py                              # the quick mode: about 10 minutes on 2 cores
    python bench/soak.py --minutes 120 --tag 2h        # about two hours
    python bench/soak.py --minutes 120 --chaos --tag 2h-chaos

The demo ends when its bursts are done (it cannot stop dispatching at a given time and end
clean), so ``--minutes`` asks for ``--bursts-per-minute`` x minutes bursts (15 a minute: what
2 loaded cores ran); the time measured is in the summary (``hours``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apps.docblock import checkout_commit, replace_block  # noqa: E402

DISK_PARTS = ("packer-wal", "checkpoints", "history", "logs")


def service_name(cmdline: Sequence[str]) -> str | None:
    """``router``, ``cell-0``, ``etcd``, ... for a process the launcher started; None for
    anything else (the demo itself, the harness)."""
    if cmdline and cmdline[0].endswith("etcd"):
        return "etcd"
    if "-m" not in cmdline:
        return None
    module = cmdline[cmdline.index("-m") + 1] if cmdline.index("-m") + 1 < len(cmdline) else ""
    if not module.startswith("services."):
        return None
    for arg in cmdline:
        if arg.startswith("cell_id="):
            return arg.split("=", 1)[1]
    return module.split(".", 1)[1]


def processes(run_dir: Path) -> dict[str, int]:
    """Service name -> pid, for the processes whose command line names ``run_dir``. A
    forked child keeps its parent's command line (until it execs): of the processes of one
    name, the one whose parent is not among them."""
    marker = str(run_dir.resolve())
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmd if a]
        if not any(marker in a for a in args):
            continue
        name = service_name(args)
        if name is not None:
            found.setdefault(name, []).append(int(entry.name))
    out: dict[str, int] = {}
    for name, pids in found.items():
        tops = [p for p in pids if _parent(p) not in pids]
        out[name] = min(tops or pids)
    return out


def proc_status(pid: int) -> dict[str, int]:
    """The numeric fields of ``/proc/<pid>/status`` (kB for the memory ones); {} when the
    process is gone. Among them ``VmRSS``, and ``RssAnon``: the anonymous part of the
    resident set (heap, stacks, arenas: what a leak grows), as against file-backed pages
    (mapped libraries, etcd's bbolt database file), which grow with the mapped file."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        first = rest.split()[:1]
        if first and first[0].isdigit():
            out[name] = int(first[0])
    return out


def _parent(pid: int) -> int | None:
    return proc_status(pid).get("PPid")


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def tree_mb(path: Path) -> float:
    total = 0
    for p in path.rglob("*") if path.exists() else ():
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total / 1e6


ETCD_METRICS = {
    "etcd_debugging_mvcc_current_revision": "revision",
    "etcd_debugging_mvcc_compact_revision": "compact_revision",
    "etcd_debugging_mvcc_keys_total": "keys",
    "etcd_mvcc_db_total_size_in_bytes": "db_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes": "db_in_use_bytes",
    # Where etcd's own memory goes (issue 36: its RSS grew 5.5 MB/h in the 2-hour soak).
    "go_memstats_heap_inuse_bytes": "go_heap_inuse_bytes",
    "go_memstats_heap_released_bytes": "go_heap_released_bytes",
    "go_goroutines": "goroutines",
    "etcd_debugging_mvcc_watcher_total": "watchers",
    "etcd_debugging_mvcc_watch_stream_total": "watch_streams",
    "etcd_debugging_lease_granted_total": "leases_granted",
    "etcd_debugging_lease_revoked_total": "leases_revoked",
}


def parse_etcd_metrics(text: str) -> dict[str, float]:
    """The gauges of :data:`ETCD_METRICS` from etcd's Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ETCD_METRICS:
            try:
                out[ETCD_METRICS[name]] = float(value)
            except ValueError:
                continue
    return out


def etcd_metrics(run_dir: Path, timeout_s: float = 5.0) -> dict[str, float]:
    """etcd's revision and database size from its ``/metrics`` (the client port: mutual TLS
    with the run's operator identity when the run has certificates); {} when unreachable."""
    try:
        import yaml

        config = yaml.safe_load((run_dir / "cluster.yaml").read_text())
        endpoint = str(config["cluster"]["etcd_endpoints"][0])
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return {}
    host_port = endpoint.split("://")[-1]
    ident = next(
        (run_dir / "certs" / n for n in ("operator", "root") if (run_dir / "certs" / n).is_dir()), None
    )
    context = None
    if ident is not None:
        context = ssl.create_default_context(cafile=str(ident / "ca.crt"))
        context.check_hostname = False  # loopback; the chain is still verified
        context.load_cert_chain(str(ident / "tls.crt"), str(ident / "tls.key"))
    url = f"{'https' if context else 'http'}://{host_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return parse_etcd_metrics(response.read().decode())
    except (OSError, ssl.SSLError, ValueError):
        return {}


def sample(run_dir: Path, t_s: float) -> dict[str, Any]:
    procs = processes(run_dir)
    status = {n: proc_status(pid) for n, pid in procs.items()}
    db = run_dir / "etcd" / "data" / "member" / "snap" / "db"
    return {
        "t_s": round(t_s, 1),
        "pids": procs,
        "rss_mb": {n: st["VmRSS"] / 1024 for n, st in status.items() if "VmRSS" in st},
        "rss_anon_mb": {n: st["RssAnon"] / 1024 for n, st in status.items() if "RssAnon" in st},
        "fds": {n: f for n, pid in procs.items() if (f := open_fds(pid)) is not None},
        "disk_mb": {part: round(tree_mb(run_dir / part), 3) for part in DISK_PARTS},
        "etcd_db_mb": round(db.stat().st_size / 1e6, 3) if db.exists() else None,
        "etcd": etcd_metrics(run_dir),
    }


def slope_per_hour(points: Iterable[tuple[float, float]], warmup: float) -> float | None:
    """Least-squares slope of (seconds, value) in units per hour, after dropping the first
    ``warmup`` share of the points; None with fewer than 3 left."""
    pts = sorted(points)
    pts = pts[int(len(pts) * warmup) :]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in pts) / var * 3600.0


def pooled_slope_per_hour(segments: Iterable[Sequence[tuple[float, float]]]) -> float | None:
    """One slope per hour shared by several segments, each with its own level (least squares
    with an intercept per segment): a process's growth within each of its lifetimes, so a
    restart (the chaos schedule's SIGKILL) neither hides nor fakes a trend. None without
    spread in time."""
    num = den = 0.0
    for seg in segments:
        if len(seg) < 2:
            continue
        mx = sum(x for x, _ in seg) / len(seg)
        my = sum(y for _, y in seg) / len(seg)
        num += sum((x - mx) * (y - my) for x, y in seg)
        den += sum((x - mx) ** 2 for x, _ in seg)
    return None if den == 0 else num / den * 3600.0


def floor_points(points: Sequence[tuple[float, float]], window_s: float) -> list[tuple[float, float]]:
    """The lowest value of each ``window_s`` window, at its time: the level a process comes
    back to between bursts of work (a trainer's RSS swings by 100-200 MB within a batch, so a
    trend of a few MB an hour shows in its floor, not in every sample)."""
    windows: dict[int, tuple[float, float]] = {}
    for x, y in points:
        k = int(x // window_s)
        if k not in windows or y < windows[k][1]:
            windows[k] = (x, y)
    return [windows[k] for k in sorted(windows)]


def rss_slopes(
    samples: list[dict[str, Any]],
    warmup: float,
    window_s: float | None = None,
    settle_s: float = 300.0,
    key: str = "rss_mb",
) -> dict[str, float | None]:
    """Per service, the RSS slope per hour within its lifetimes (a segment per pid) after the
    warm-up; with ``window_s``, of each lifetime's floor per window. The first ``settle_s`` of
    a lifetime are left out: a restarted process loads its model, replays its WAL or rejoins
    its batch before it runs as it will (its climb is a start, not a trend)."""
    born: dict[tuple[str, int], float] = {}
    first_pid: dict[str, int] = {}
    for s in samples:
        for name, pid in (s.get("pids") or {}).items():
            born.setdefault((name, int(pid)), s["t_s"])
            first_pid.setdefault(name, int(pid))
    kept = samples[int(len(samples) * warmup) :]
    segments: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for s in kept:
        pids = s.get("pids") or {}
        for name, value in (s.get(key) or {}).items():
            pid = int(pids.get(name, 0))
            restarted = pid != first_pid.get(name, pid)  # the first process has the warm-up
            if restarted and s["t_s"] - born.get((name, pid), s["t_s"]) < settle_s:
                continue  # a restart settling
            segments.setdefault(name, {}).setdefault(pid, []).append((s["t_s"], float(value)))
    out: dict[str, float | None] = {}
    for name, by_pid in sorted(segments.items()):
        segs = list(by_pid.values())
        if window_s is not None:
            segs = [floor_points(seg, window_s) for seg in segs]
        slope = pooled_slope_per_hour(segs)
        out[name] = None if slope is None else round(slope, 2)
    return out


def series(samples: list[dict[str, Any]], key: str) -> dict[str, list[tuple[float, float]]]:
    """Per-name (t, value) series of a per-service or per-part key."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, value in (s.get(key) or {}).items():
            out.setdefault(name, []).append((s["t_s"], float(value)))
    return out


def etcd_defrags(run_dir: Path | None) -> int:
    """Defragmentations the launcher's etcd upkeep recorded (``supervisor.jsonl``)."""
    journal = run_dir / "supervisor.jsonl" if run_dir is not None else None
    if journal is None or not journal.exists():
        return 0
    events = (json.loads(line) for line in journal.read_text().splitlines() if line.strip())
    return sum(1 for e in events if e.get("name") == "etcd" and e.get("kind") == "defragmented")


def summarize(
    samples: list[dict[str, Any]],
    demo: dict[str, Any],
    warmup: float,
    run_dir: Path | None = None,
    floor_window_s: float = 600.0,
) -> dict[str, Any]:
    def slopes(key: str) -> dict[str, float | None]:
        return {
            n: None if (v := slope_per_hour(p, warmup)) is None else round(v, 2)
            for n, p in sorted(series(samples, key).items())
        }

    disk = [(s["t_s"], sum(s["disk_mb"].values())) for s in samples]
    db = [(s["t_s"], s["etcd_db_mb"]) for s in samples if s["etcd_db_mb"] is not None]

    def etcd(key: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(s["t_s"], s["etcd"][key] * scale) for s in samples if key in (s.get("etcd") or {})]

    revision, in_use = etcd("revision"), etcd("db_in_use_bytes", 1e-6)
    last = next((s["etcd"] for s in reversed(samples) if s.get("etcd")), {})
    ex = demo.get("executions", {})
    hours = (samples[-1]["t_s"] - samples[0]["t_s"]) / 3600 if len(samples) > 1 else 0.0
    return {
        "hours": round(hours, 3),
        "samples": len(samples),
        "warmup_share": warmup,
        "rss_mb_per_hour": rss_slopes(samples, warmup),
        "rss_floor_mb_per_hour": rss_slopes(samples, warmup, floor_window_s),
        "rss_anon_mb_per_hour": rss_slopes(samples, warmup, key="rss_anon_mb"),
        "floor_window_s": floor_window_s,
        "fds_per_hour": slopes("fds"),
        "disk_mb_per_hour": slope_per_hour(disk, warmup),
        "disk_mb_per_hour_by_part": slopes("disk_mb"),
        "etcd_db_mb_per_hour": slope_per_hour(db, warmup),
        "etcd_revision_per_hour": slope_per_hour(revision, warmup),
        "etcd_db_in_use_mb_per_hour": slope_per_hour(in_use, warmup),
        "etcd_go_heap_mb_per_hour": slope_per_hour(etcd("go_heap_inuse_bytes", 2**-20), warmup),
        "etcd_last": last,
        "etcd_defrags": etcd_defrags(run_dir),
        "executions": ex.get("finished", 0),
        "lost": ex.get("lost"),
        "versions": demo.get("policy_versions_published"),
        "checker_ok": (demo.get("checker") or {}).get("ok"),
        "outcome": demo.get("outcome"),
        "faults_injected": (demo.get("chaos") or {}).get("injected", 0),
        "faults_survived": (demo.get("chaos") or {}).get("survived", 0),
    }


def plot(samples: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def etcd(key: str, scale: float = 1.0) -> list[tuple[float, float]]:
        return [(s["t_s"], s["etcd"][key] * scale) for s in samples if key in (s.get("etcd") or {})]

    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharex=True)
    panels = [
        (axes[0][0], series(samples, "rss_mb"), "resident memory, MB"),
        (axes[0][1], series(samples, "fds"), "open file descriptors"),
        (axes[0][2], series(samples, "disk_mb"), "run folder, MB"),
        (
            axes[1][0],
            {
                "db file": [(s["t_s"], s["etcd_db_mb"]) for s in samples if s["etcd_db_mb"] is not None],
                "db in use": etcd("db_in_use_bytes", 1e-6),
            },
            "etcd database, MB",
        ),
        (axes[1][1], {"revision": etcd("revision"), "compacted": etcd("compact_revision")}, "etcd revision"),
        (axes[1][2], {"keys": etcd("keys")}, "etcd keys"),
    ]
    for ax, data, title in panels:
        for name, pts in sorted(data.items()):
            if pts:
                ax.plot([t / 60 for t, _ in pts], [v for _, v in pts], label=name)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.suptitle("Gyre soak (mock engines, real trainers, default policy)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


BEGIN, END = "<!-- generated by bench/soak.py: begin -->", "<!-- generated by bench/soak.py: end -->"


def render(result: dict[str, Any]) -> str:
    """The opening figures of docs/benchmarks/soak.md, from a soak.json."""
    s, c = result["summary"], result["config"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1f}"

    lines = [
        BEGIN,
        f"Current figures ({result['date']}, commit `{result['commit']}`, `{result['tag']}`: "
        f"{c['bursts']} bursts, {c['engine']} engines, "
        f"chaos {'repeating' if c['chaos'] else 'off'}{_faults(s) if c['chaos'] else ''}, "
        f"{s['hours'] * 60:.0f} minutes measured, {s['samples']} samples, slopes after the first "
        f"{s['warmup_share']:.0%}): {s['executions']} executions, {s['lost']} lost, "
        f"{s['versions']} versions, history checker {'ok' if s['checker_ok'] else 'NOT ok'}, "
        f"outcome {s['outcome']}.",
        "",
        "| process | RSS slope, MB/hour | RSS floor slope, MB/hour | anonymous RSS slope, MB/hour "
        "| open fds slope, per hour |",
        "|---|---:|---:|---:|---:|",
    ]
    floor = s.get("rss_floor_mb_per_hour") or {}
    anon = s.get("rss_anon_mb_per_hour") or {}
    for name, v in s["rss_mb_per_hour"].items():
        lines.append(
            f"| {name} | {fmt(v)} | {fmt(floor.get(name))} | {fmt(anon.get(name))} "
            f"| {fmt(s['fds_per_hour'].get(name))} |"
        )
    parts = ", ".join(f"{k} {fmt(v)}" for k, v in s["disk_mb_per_hour_by_part"].items())
    lines += [
        "",
        f"Disk: {fmt(s['disk_mb_per_hour'])} MB/hour in all ({parts}); etcd's database file "
        f"{fmt(s['etcd_db_mb_per_hour'])} MB/hour ({fmt(s.get('etcd_db_in_use_mb_per_hour'))} in use); "
        f"etcd's revision {fmt(s.get('etcd_revision_per_hour'))} an hour"
        f"{_etcd_last(s.get('etcd_last') or {})}; {s.get('etcd_defrags', 0)} defragmentations; "
        f"etcd's Go heap in use {fmt(s.get('etcd_go_heap_mb_per_hour'))} MB/hour.",
        "",
        "![every series over time](../img/soak.png)",
        END,
    ]
    return "\n".join(lines)


def _faults(s: dict[str, Any]) -> str:
    return f" ({s.get('faults_survived', 0)} of {s.get('faults_injected', 0)} faults survived)"


def _etcd_last(last: dict[str, float]) -> str:
    if "revision" not in last:
        return ""
    return (
        f" (at the end: revision {last['revision']:,.0f}, compacted to "
        f"{last.get('compact_revision', -1):,.0f}, {last.get('keys', 0):,.0f} keys)"
    )


def bursts_for(minutes: float, per_minute: float) -> int:
    """Bursts that take about ``minutes`` at ``per_minute`` bursts a minute (at least 1)."""
    return max(1, math.ceil(minutes * per_minute))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--bursts", type=int, default=None, help="bursts of the demo (default: 150, about 10 minutes)"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="run for about this long (bursts = minutes x --bursts-per-minute)",
    )
    parser.add_argument(
        "--bursts-per-minute",
        type=float,
        default=15.0,
        help="the demo's pace with mock engines, for --minutes (15: 2 loaded cores)",
    )
    parser.add_argument(
        "--chaos", action="store_true", help="the demo's chaos schedule, repeating while it soaks"
    )
    parser.add_argument(
        "--chaos-gap-s",
        type=float,
        default=6.0,
        help="seconds from one fault survived to the next (spaced out, each service lives long "
        "enough between its kills for a slope)",
    )
    parser.add_argument("--interval-s", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=0.25, help="share of the samples before the fit")
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--tag", default="quick", help="names the result (quick, 2h, ...)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "soak.png")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks" / "soak.md")
    parser.add_argument(
        "--from-samples",
        type=Path,
        default=None,
        help="summarize a finished run again from its samples file (with --run-dir, the run's "
        "folder): no demo is started",
    )
    parser.add_argument(
        "--run-commit",
        default=None,
        help="with --from-samples: the commit the run ran at (default: this checkout's)",
    )
    args = parser.parse_args(argv)
    if args.bursts is None:
        args.bursts = 150 if args.minutes is None else bursts_for(args.minutes, args.bursts_per_minute)
    run_dir = args.run_dir or ROOT / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [
        sys.executable,
        "-m",
        "apps.demo",
        "--engine",
        "mock",
        "--bursts",
        str(args.bursts),
        "--no-live",
        "--no-warm-start",
        "--eval-tasks",
        "0",
        "--dashboard-port",
        "0",
        "--run-dir",
        str(run_dir),
        *(["--chaos-repeat", "--chaos-gap-s", str(args.chaos_gap_s)] if args.chaos else []),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = run_dir.parent / f"{run_dir.name}.log"  # the demo's output, beside its run folder
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    if args.from_samples is not None:
        samples = [json.loads(line) for line in args.from_samples.read_text().splitlines() if line]
        return write_result(args, run_dir, samples, returncode=0)
    # Every sample as it is taken, so that a run cut short still has its series.
    samples_log = run_dir.parent / f"{run_dir.name}.samples.jsonl"
    with log.open("w") as out, samples_log.open("w") as sample_out:
        demo = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while demo.poll() is None:
            time.sleep(args.interval_s)
            if run_dir.exists():
                s = sample(run_dir, time.monotonic() - started)
                if s["rss_mb"]:
                    samples.append(s)
                    sample_out.write(json.dumps(s) + "\n")
                    sample_out.flush()
                    total = sum(s["rss_mb"].values())
                    print(
                        f"[{s['t_s'] / 60:5.1f} min] {len(s['rss_mb'])} processes, RSS {total:,.0f} MB, "
                        f"disk {sum(s['disk_mb'].values()):.1f} MB, etcd db {s['etcd_db_mb']} MB, "
                        f"revision {s['etcd'].get('revision', '?')}",
                        flush=True,
                    )
    return write_result(args, run_dir, samples, demo.returncode)


def write_result(
    args: argparse.Namespace, run_dir: Path, samples: list[dict[str, Any]], returncode: int
) -> int:
    """Summarizes the samples with the run's summary.json into ``--out``, the plot and the
    doc block; returns the exit status (the demo's)."""
    summary_path = run_dir / "summary.json"
    demo_summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary = summarize(samples, demo_summary, args.warmup, run_dir)
    commit = checkout_commit()
    if getattr(args, "run_commit", None):
        commit = f"{args.run_commit} (summarized at {commit})"
    result = {
        "benchmark": "soak",
        "tag": args.tag,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "config": {
            "bursts": args.bursts,
            "minutes": args.minutes,
            "interval_s": args.interval_s,
            "engine": "mock",
            "chaos": args.chaos,
            "chaos_gap_s": args.chaos_gap_s if args.chaos else None,
            "warmup": args.warmup,
        },
        "summary": summary,
        "samples": samples,
        "run_dir": str(run_dir),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if samples:
        plot(samples, args.plot)
        replace_block(args.doc, BEGIN, END, render(result), title="Soak (`bench/soak.py`)")
    print(json.dumps(summary, indent=1))
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
