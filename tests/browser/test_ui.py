"""What a user sees in the Prefect UI: headless Chromium opens the server of the deployed run (see
tests/deployment), finds the run's flow runs and the merge table artifact, and screenshots them.

Run: .venv/bin/pytest -m browser tests/browser   (screenshots land in out/screenshots/)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect_stack import REPO, DeployedRun

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
SCREENSHOTS = REPO / "out" / "screenshots"


def _latest_merge_artifact(run: DeployedRun):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from diloco.tasks.common import artifact_key

    with run.client() as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key("merge", run.run_id)])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
    assert found, "no merge artifact"
    return found[0]


def _open(page, url: str, texts: list[str], shot: Path, timeout_s: float = 90) -> str:
    """Go to url, wait until every text is on the page, save a full-page screenshot; the page text."""
    page.goto(url)
    checks = " && ".join(f"document.body.innerText.includes({t!r})" for t in texts)
    try:
        page.wait_for_function(checks, timeout=timeout_s * 1000)
    finally:
        page.screenshot(path=str(shot), full_page=True)
    return page.inner_text("body")


def test_ui_shows_the_runs_flow_runs_and_merge_table(chromium: str, deployed_run: DeployedRun,
                                                     tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    ui = deployed_run.stack.ui_url
    artifact = _latest_merge_artifact(deployed_run)
    rows = artifact.data if isinstance(artifact.data, list) else []
    row = next((r for r in rows if r.get("learner") != "(merge)"), None)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith((ui, "data:"))
                       else route.abort())  # the UI calls an analytics host; stay on this machine
            _open(page, f"{ui}/v2/runs/flow-run/{deployed_run.train_flow_run_id}",
                  [f"train-{deployed_run.run_id}"], SCREENSHOTS / "train-flow-run.png")
            _open(page, f"{ui}/v2/runs", [f"train-{deployed_run.run_id}", "us-east-0", "eu-west-0"],
                  SCREENSHOTS / "runs.png")
            shot = SCREENSHOTS / "merge-artifact.png"
            text = _open(page, f"{ui}/v2/artifacts/artifact/{artifact.id}", ["(merge)", "committed"], shot)
        finally:
            browser.close()
    assert artifact.key in text and "staleness" in text
    if row is not None:
        assert row["learner"] in text
    assert shot.stat().st_size > 10_000
    (tmp_path / "screenshots.txt").write_text(str(SCREENSHOTS))
