"""infra/compose.yaml is wired right: the workers reach the Prefect server and MinIO, serve exactly the
work pools prefect.yaml deploys to, the bucket gets created, and no credential is written in the repo.

Run: .venv/bin/pytest tests/unit/test_infra.py   (parses YAML; no Docker needed)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "infra" / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _pools() -> set[str]:
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    return {d["work_pool"]["name"] for d in deployments}


def _workers(services: dict) -> dict[str, dict]:
    return {name: s for name, s in services.items()
            if "worker" in s.get("command", []) and "start" in s["command"]}


def _pool(service: dict) -> str:
    command = service["command"]
    return command[command.index("--pool") + 1]


def test_a_worker_per_pool_of_prefect_yaml(services: dict) -> None:
    workers = _workers(services)
    assert {_pool(w) for w in workers.values()} == _pools()
    assert len([p for p in _pools() if p.startswith("region-")]) >= 2
    assert all("--type" in w["command"] and "process" in w["command"] for w in workers.values())


def test_workers_report_to_the_prefect_server_service(services: dict) -> None:
    server = services["prefect-server"]
    port = server["command"][server["command"].index("--port") + 1]
    assert "0.0.0.0" in server["command"]
    for name, worker in {**_workers(services), "deploy": services["deploy"]}.items():
        assert worker["environment"]["PREFECT_API_URL"] == f"http://prefect-server:{port}/api", name
        assert worker["depends_on"]["prefect-server"]["condition"] == "service_healthy", name


def test_workers_reach_minio_and_the_bucket_is_created(services: dict) -> None:
    minio, mc = services["minio"], services["mc"]
    assert "server" in minio["command"]
    assert any(p.split(":")[-1] == "9000" for p in minio["ports"])
    for name, worker in _workers(services).items():
        env = worker["environment"]
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000", name
        assert worker["depends_on"]["mc"]["condition"] == "service_completed_successfully", name
    script = " ".join(mc["command"])
    assert "http://minio:9000" in script and re.search(r"mc mb (--ignore-existing )?local/diloco\b", script)
    assert mc["depends_on"]["minio"]["condition"] == "service_healthy"


def test_no_credentials_are_written_in_the_repo(services: dict) -> None:
    secret_names = re.compile(r"(SECRET|PASSWORD|ACCESS_KEY|TOKEN)")
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if secret_names.search(key):
                assert (str(value).startswith("${")
                        and ":?" in str(value)), f"{name}.{key} must come from infra/.env"
            if "@" in str(value):  # a URL with a password in it
                assert re.search(r":\$\{[A-Z_]+:\?[^}]*\}@",
                                 str(value)), f"{name}.{key}: password must be ${{VAR}}"
    assert "change-me" in (REPO / "infra" / ".env.example").read_text()  # placeholders only


def test_the_image_installs_cpu_torch_before_the_project() -> None:
    lines = [line for line in (REPO / "infra" / "Dockerfile").read_text().splitlines()
             if line.startswith("RUN")]
    torch = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project = next(i for i, line in enumerate(lines) if re.search(r"pip install '?\.(\[|'| |$)", line))
    assert torch < project
    assert "download.pytorch.org/whl/cpu" in lines[torch]


def test_the_deploy_service_creates_every_pool_and_deploys_all(services: dict) -> None:
    script = " ".join(services["deploy"]["command"])
    assert "deploy --all" in script and services["deploy"]["working_dir"] == "/opt/diloco"
    assert all(pool in script for pool in _pools())
