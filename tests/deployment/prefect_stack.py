"""A real Prefect stack for tests: server, a process worker per pool of prefect.yaml, deployments.

Contract: one stack per pytest session (kept in config.stash, shared by tests/deployment and
tests/browser); everything it starts runs in its own process group and is killed at session end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def pools() -> list[str]:
    """The work pools prefect.yaml deploys to, in order of first use."""
    return list(dict.fromkeys(d["work_pool"]["name"] for d in prefect_yaml()["deployments"]))


def wait_for(check: Callable[[], object], timeout_s: float, what: str, every_s: float = 1.0) -> object:
    """Poll `check` until it returns something truthy; fail naming `what` after timeout_s."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def kill_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Stack:
    home: Path
    api_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")

    def log(self, name: str):
        return open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child

    def cli(self, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
        """Run the prefect CLI as a user would, in the repository root, against this server."""
        done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed "
                               f"({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start_worker(self, pool: str) -> subprocess.Popen:
        proc = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--type", "process"],
                                cwd=REPO, env=self.env, stdout=self.log(f"worker-{pool}"),
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            kill_group(proc)


SERVER_SETTINGS = {  # SQLite on 2 busy cores: wait longer for the lock, skip services no test needs
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60", "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
}


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_stack(home: Path) -> Stack:
    """Server on a free port, one process worker per pool, `prefect deploy --all` from prefect.yaml."""
    from diloco.flows.server import start_server

    stack = Stack(home)
    with _environ(SERVER_SETTINGS):
        api_url, server = start_server(home / "prefect", lean=False)  # workers: every service
    stack.procs.append(server)
    stack.api_url = api_url
    stack.env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(home / "prefect"),
                 "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1",
                 "PREFECT_WORKER_HEARTBEAT_SECONDS": "10", "PREFECT_RUNNER_POLL_FREQUENCY": "1",
                 "PYTHONUNBUFFERED": "1"}
    for pool in pools():
        stack.start_worker(pool)
    try:
        wait_for(lambda: _pools_exist(stack), 180, "the workers to create their work pools", every_s=2)
        stack.cli("deploy", "--all")
    except BaseException:
        stack.close()
        raise
    return stack


def _pools_exist(stack: Stack) -> bool:
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(stack.api_url) as client:
        names = {p.name for p in client.read_work_pools()}
    return set(pools()) <= names


# ---- one deployed training run per session ------------------------------------------------------
OVERRIDES = {  # two learners (one per region), a target far away: the tests stop the run themselves
    "run.num_learners": 2, "run.num_versions": 100000, "run.time_limit_s": 900,
    "run.heartbeat_timeout_s": 180, "run.restart_backoff_s": 0.5,
    # Fewer, longer phases and merges of both learners: the SQLite-backed test server answers 503
    # when task runs and merge artifacts arrive several times a second (seen with 40-step phases).
    "inner.steps_per_phase": 200, "merger.quorum": 2, "merger.quorum_timeout_s": 30,
}


@dataclass
class DeployedRun:
    stack: Stack
    storage: str
    run_id: str
    train_flow_run_id: str

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.stack.api_url)

    def context(self):
        from diloco.run.context import open_run

        return open_run(self.storage, self.run_id)


def launch_train(stack: Stack, storage: str, run_id: str) -> DeployedRun:
    """`prefect deployment run 'train/train' -p ...`, as a user would type it."""
    import json
    import re

    done = stack.cli("deployment", "run", "train/train", "-p", f"storage={storage}", "-p", f"run_id={run_id}",
                     "-p", "config=tiny", "-p", f"overrides={json.dumps(OVERRIDES)}")
    match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert match, f"no flow run id in:\n{done.stdout}"
    return DeployedRun(stack, storage, run_id, match.group(1))


def latest_version(run: DeployedRun) -> int:
    from diloco.run.context import RunError
    from diloco.storage import StorageError

    try:
        ctx = run.context()
        from diloco.storage import latest_version as latest

        return latest(ctx.store, ctx.keys) or 0
    except (RunError, StorageError):
        return 0


def _heartbeats(run: DeployedRun) -> int:
    ctx = run.context()
    return sum(1 for name in ctx.learners if ctx.store.exists(ctx.keys.status(name)))


def stop_run(run: DeployedRun, timeout_s: float = 120.0) -> str:
    """Request a stop through the bucket and wait for the train flow run to end; its final state type."""
    from diloco.run.signals import request_stop

    request_stop(run.context(), "test over")
    return wait_for(lambda: _final_state(run), timeout_s, "the train flow run to end", every_s=2)


def _final_state(run: DeployedRun) -> str | None:
    with run.client() as client:
        state = client.read_flow_run(run.train_flow_run_id).state
    return state.type.value if state and state.is_final() else None


def kill_leftovers(api_url: str) -> None:
    """Flow-run processes live in their own sessions; kill those that report to this stack's API."""
    import psutil

    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get("PREFECT_API_URL") == api_url:
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


_RUN = pytest.StashKey[object]()
_CLOSE = pytest.StashKey[object]()  # the running stack's close, until it has run
# the tests that share it (tests/conftest.py schedules them together)
STACK_TESTS = ("tests/browser/", "tests/deployment/")


@pytest.hookimpl(trylast=True)  # after the test's own teardown
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test that shares the stack (the next one is none or another's), the stack stops: under
    `make test`'s two workers it runs first on its worker (the largest unit), which then goes on with other
    tests, beside an idle Prefect server and its workers, and whose end could cut the session's cleanup short
    (a run left the three running). A later request starts a new one."""
    if nextitem is not None and nextitem.nodeid.startswith(STACK_TESTS):
        return
    close = item.config.stash.get(_CLOSE, None)
    if close is not None:
        close()


@pytest.fixture(scope="session")
def deployed_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DeployedRun:
    """A training run started with `prefect deployment run 'train/train'`, at version >= 3.

    Shared by every test of the session (config.stash); a failure to start is remembered, not retried.
    """
    cached = request.config.stash.get(_RUN, None)
    if isinstance(cached, BaseException):
        pytest.fail(f"the deployed run did not start: {cached}")
    if cached is not None:
        return cached
    try:
        run = _start_deployed_run(request.config, tmp_path_factory.mktemp("deployed"))
    except Exception as err:
        request.config.stash[_RUN] = err
        raise
    request.config.stash[_RUN] = run
    return run


def _start_deployed_run(config: pytest.Config, root: Path) -> DeployedRun:
    stack = start_stack(root)
    run = DeployedRun(stack, f"file://{root}/bucket", "deployed-1", "")

    def close() -> None:
        if config.stash.get(_CLOSE, None) is not close:
            return  # closed already
        del config.stash[_CLOSE]
        config.stash.setdefault(_RUN, None)
        del config.stash[_RUN]  # the next request starts another
        if run.train_flow_run_id:
            with contextlib.suppress(Exception):  # best effort: the stack is killed below regardless
                stop_run(run, timeout_s=60)
        stack.close()
        kill_leftovers(stack.api_url)

    config.stash[_CLOSE] = close
    config.add_cleanup(close)  # if the session ends first (an interrupt)
    run.train_flow_run_id = launch_train(stack, run.storage, run.run_id).train_flow_run_id
    wait_for(lambda: latest_version(run) >= 3 and _heartbeats(run) >= 2, 300,
             "version 3 of the deployed run and a heartbeat of both learners", every_s=2)
    return run
