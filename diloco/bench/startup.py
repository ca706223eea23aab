"""`diloco bench startup`: where the main job's wall time goes — `diloco run` as `make run` starts it.

Contract: runs `diloco run --config <recipe> --no-live --json` (with Prefect unless --no-prefect) in a fresh
folder as a user would (its Prefect home prepared as `make setup` leaves it, unless prepared=False), stamps
each line of its output as it arrives, then reads the run's events and manifests back from the bucket and
prints one table of milestones (seconds from the command's start) and the spans between them; the
machine's load before and after is part of the result, since the figures depend on it. Import costs are
measured apart, each in a fresh interpreter. Writes JSON with --json.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark

IMPORTS = {"diloco --help": "import diloco.cli", "torch": "import torch", "prefect": "import prefect",
           "a learner's code": "import diloco.learner.learner, diloco.flows.learner"}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_server_start(home: Path) -> dict[str, float]:
    """Wall and CPU seconds of a local Prefect server's start in a fresh home, then again in the same home
    (the database exists: no migrations); CPU seconds are what an idle machine would pay."""
    from diloco.flows.server import start_server, stop_api

    out = {}
    for label in ("fresh home", "existing home"):
        cpu0, t0 = _children_cpu_s(), time.perf_counter()
        url, proc = start_server(home)
        wall = time.perf_counter() - t0
        stop_api(proc)
        out[f"{label} wall"] = round(wall, 2)
        out[f"{label} cpu (incl. its shutdown)"] = round(_children_cpu_s() - cpu0, 2)
    return out


def measure_imports() -> dict[str, float]:
    """Seconds each import takes in a fresh interpreter (the cost every exec'd process pays)."""
    out = {}
    for label, code in IMPORTS.items():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
        out[label] = round(time.perf_counter() - t0, 2)
    return out


def _cpu_of(pid: int) -> float | None:
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return times.user + times.system


def _watch_cpu(proc: subprocess.Popen, cwd: Path, cpu: dict[str, float]) -> None:
    """The last CPU seconds seen of the command itself (supervisor, train flow, summary) and of its local
    Prefect server (found through its record in .diloco/prefect/server.json)."""
    record = cwd / ".diloco" / "prefect" / "server.json"
    server_pid: int | None = None
    while proc.poll() is None:
        if server_pid is None and record.exists():
            try:
                server_pid = int(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                server_pid = None
        for label, pid in (("command (supervisor, train flow, summary)", proc.pid), ("Prefect server",
                                                                                     server_pid)):
            seconds = _cpu_of(pid) if pid else None
            if seconds is not None:
                cpu[label] = round(seconds, 1)
        time.sleep(0.5)


def _run_stamped(cmd: list[str], cwd: Path, env: dict[str, str],
                 cpu: dict[str, float]) -> tuple[float, list[tuple[float, str]], int, str]:
    """Run cmd; (start time, [(t, stderr line)], exit code, stdout); `cpu` filled by a watcher."""
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    watcher = threading.Thread(target=_watch_cpu, args=(proc, cwd, cpu), daemon=True)
    reader.start()
    watcher.start()
    stdout = proc.stdout.read()
    proc.wait()
    reader.join(timeout=10)
    watcher.join(timeout=10)
    return t0, lines, proc.returncode, stdout


def _first(lines: list[tuple[float, str]], needle: str) -> float | None:
    return next((t for t, line in lines if needle in line), None)


def milestones(ctx: Any, t0: float, lines: list[tuple[float, str]], t_exit: float) -> dict[str, float | None]:
    """Seconds from the command's start to each milestone, read from its output and the bucket."""
    from diloco.inspect.report import manifests
    from diloco.run.events import read_events

    events = read_events(ctx.store, ctx.keys)
    chain = manifests(ctx)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    starts = [e["t"] for e in events if e.get("source") == "supervisor" and e.get("kind") == "start"]
    joins = {}
    for e in events:
        if e.get("kind") == "join" and e.get("learner") in ctx.learners:
            joins.setdefault(e["learner"], e["t"])
    publishes = [e["t"] for e in events if e.get("kind") == "publish"]
    end = next((e["t"] for e in events if e.get("source") == "supervisor" and e.get("kind") == "end"), None)
    down = next((e["t"] for e in events if e.get("source") == "supervisor" and e.get("kind") == "shutdown"),
                None)
    return {
        "run created (CLI imports, config, version 0)": rel(_first(lines, "diloco run ")),
        "Prefect API up": rel(_first(lines, "Prefect API")),
        "first role start asked (train flow up)": rel(min(starts) if starts else None),
        "first learner joined": rel(min(joins.values()) if joins else None),
        "last learner joined": rel(max(joins.values()) if len(joins) == len(ctx.learners) else None),
        "first delta published": rel(min(publishes) if publishes else None),
        "version 1 committed": rel(chain[1].created_at if len(chain) > 1 else None),
        "target version committed": rel(chain[-1].created_at if chain else None),
        "supervisor ended the run": rel(end),
        "every role ended (shutdown)": rel(down),
        "train flow finished (final evals, artifact)": rel(_first(lines, "Finished in state")),
        "summary table printed": rel(_first(lines, "— summary")),
        "command exited (server stopped, sample)": rel(t_exit),
    }


def spans(m: dict[str, float | None]) -> dict[str, float | None]:
    """The time each milestone adds after the latest one before it: where the wall time goes."""
    out: dict[str, float | None] = {}
    latest = 0.0
    for key, value in m.items():
        out[key] = None if value is None else round(max(0.0, value - latest), 2)
        latest = max(latest, value) if value is not None else latest
    return out


def prepare_home(work: Path) -> None:
    """What `make setup` does for `make run`: the local Prefect server's database, created in its home."""
    home = work / ".diloco" / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    prefect = str(Path(sys.executable).with_name("prefect"))
    subprocess.run([prefect, "--no-prompt", "server", "database", "upgrade", "-y"], check=True,
                   capture_output=True, env={**os.environ, "PREFECT_HOME": str(home)}, timeout=300)


@benchmark(config="demo", config_help="Recipe name or YAML path (default: what make run trains).")
def bench_startup(
    config: str = "demo",
    prefect: Annotated[bool, Opt("--prefect/--no-prefect",
                                 help="With a local Prefect server, as make run.")] = True,
    imports: Annotated[bool, Opt("--imports/--no-imports", help="Also time each heavy import apart.")] = True,
    prepared: Annotated[bool, Opt("--prepared/--fresh-home", help=(
        "Prefect's home as make setup leaves it (its database created), or empty."))] = True,
) -> BenchResult:
    """Run the main job once and print where its wall time goes (server, flows, process starts, imports)."""
    from diloco.run.context import open_run

    work = Path(tempfile.mkdtemp(prefix="diloco-startup-"))
    if prefect and prepared:
        prepare_home(work)
    load_before = os.getloadavg()
    env = {k: v for k, v in os.environ.items() if not (prefect and k == "PREFECT_API_URL")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    run_id = f"startup-{time.strftime('%H%M%S')}"
    cmd = [sys.executable, "-m", "diloco.cli", "run", "--config", config, "--run-id", run_id, "--no-live",
           "--json", "--prefect" if prefect else "--no-prefect"]
    cpu0, cpu_parts = _children_cpu_s(), {}
    t0, lines, code, stdout = _run_stamped(cmd, work, env, cpu_parts)
    t_exit = time.time()
    cpu_s = _children_cpu_s() - cpu0  # every process of the run: each was waited for by its parent
    if code != 0:
        raise RuntimeError(f"diloco run exited {code}:\n" + "\n".join(line for _, line in lines[-30:]))
    summary = json.loads(stdout.strip().splitlines()[-1])
    ctx = open_run(f"file://{work}/runs", run_id)
    m = milestones(ctx, t0, lines, t_exit)
    result = {"config": config, "prefect": prefect, "prepared_home": prepared, "wall_s": round(t_exit - t0,
                                                                                               1),
              "cpu_s": round(cpu_s, 1), "cpu_parts_s": cpu_parts,
              "final_eval_loss": summary["final_eval_loss"], "num_versions": summary["num_versions"],
              "milestones_s": m, "spans_s": spans(m), "imports_s": measure_imports() if imports else {},
              "server_start_s": measure_server_start(work / "server-probe") if imports and prefect else {},
              "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              "workdir": str(work)}
    return BenchResult(result, _tables(result), _notes(result))


def _tables(r: dict[str, Any]) -> list[Table]:
    """The milestones (seconds from the start, and the span before each), then where the seconds went."""
    home = " home as make setup leaves it" if r.get("prepared_home") else " fresh home"
    milestones_table = Table(
        f"diloco run --config {r['config']} {f'(Prefect,{home})' if r['prefect'] else '--no-prefect'}: "
        f"{r['wall_s']:.1f} s wall, final held-out {r['final_eval_loss']:.3f} nats/byte, {r['num_versions']} "
        f"versions; load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f} on {r['cpus']} CPUs",
        ["milestone", "at s", "span s"], labels=1)
    for key, at in r["milestones_s"].items():
        span = r["spans_s"][key]
        milestones_table.rows.append([key, "—" if at is None else f"{at:.1f}",
                                      "—" if span is None else f"{span:.1f}"])
    costs = Table("where the seconds go", ["cost", "s"], labels=1)
    costs.rows.append(["CPU seconds, every process of the run", f"{r['cpu_s']:.1f}"])
    costs.rows += [["  of which " + label, f"{s:.1f}"] for label, s in r.get("cpu_parts_s", {}).items()]
    costs.rows += [["import: " + label, f"{s:.2f}"] for label, s in r["imports_s"].items()]
    costs.rows += [["Prefect server start, " + label, f"{s:.2f}"] for label, s in r.get("server_start_s",
                                                                                        {}).items()]
    return [milestones_table, costs]


def _notes(r: dict[str, Any]) -> list[str]:
    notes = [f"CPU seconds / {r['cpus']} CPUs = {r['cpu_s'] / r['cpus']:.1f} s: the wall time's floor on an "
             "idle machine"]
    if r["imports_s"]:
        notes.append(f"(imports: median {statistics.median(r['imports_s'].values()):.2f} s, each in a fresh "
                     "interpreter)")
    return notes
