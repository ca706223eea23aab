"""The operator's controls as the `operate` deployment (control pool) on the real Prefect stack: a control
run from `prefect deployment run 'operate/operate'` is recorded as made by that flow run; a bad one fails
the flow run with its reason and writes nothing; signing keys and keyrings come from Prefect Secret blocks.

Run: .venv/bin/pytest -m deployment tests/deployment/test_operate_flow.py   (with the session's stack)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from prefect_stack import DeployedRun, wait_for

from diloco.configs import load_config
from diloco.run.controls import read_ops
from diloco.run.create import create_run
from diloco.storage import open_store
from diloco.trust.signing import new_key

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(600)]


def _run_operate(run: DeployedRun, *params: str) -> str:
    """`prefect deployment run 'operate/operate' -p ...`; waits for the flow run's final state."""
    args = [a for p in params for a in ("-p", p)]
    done = run.stack.cli("deployment", "run", "operate/operate", *args)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout).group(1)

    def final() -> str | None:
        with run.client() as client:
            state = client.read_flow_run(flow_run_id).state
        return state.type.value if state and state.is_final() else None

    return wait_for(final, 300, f"the operate flow run {flow_run_id}", every_s=2)


def test_the_operate_deployment_records_who_and_refuses_bad_input(
        deployed_run: DeployedRun, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket"
    ctx = create_run(open_store(url), "operated", load_config("tiny").with_overrides({"run.num_learners": 2}))
    assert _run_operate(deployed_run, f"storage={url}", "run_id=operated", "action=admit-learner",
                        "learner=extra-0", "reason=from the UI") == "COMPLETED"
    assert _run_operate(deployed_run, f"storage={url}", "run_id=operated", "action=set",
                        'settings={"merger.quorum": 2}') == "COMPLETED"
    ops = [op for _, op in read_ops(ctx.store, ctx.keys)]
    assert [(op.kind, op.learner, op.values) for op in ops] == [("admit", "extra-0", {"start": True}),
                                                                ("set", None, {"merger.quorum": 2})]
    assert all(op.by.startswith("prefect flow run ") for op in ops) and ops[0].reason == "from the UI"
    assert _run_operate(deployed_run, f"storage={url}", "run_id=operated", "action=readmit",
                        "learner=local-0") == "FAILED"  # not quarantined: refused, nothing written
    assert len(read_ops(ctx.store, ctx.keys)) == 2


def test_signing_keys_come_from_prefect_secret_blocks(
        deployed_run: DeployedRun, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # this process's settings are loaded
    with temporary_settings({PREFECT_API_URL: deployed_run.stack.api_url}):
        _keys_from_blocks(Secret, monkeypatch)


def _keys_from_blocks(Secret, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.launch import keyring_of_env, signing_key
    from diloco.trust.signing import SigningError

    key = new_key()
    Secret(value=key).save("diloco-key-us-east-0", overwrite=True)
    Secret(value=json.dumps({"us-east-0": key})).save("diloco-keyring", overwrite=True)
    monkeypatch.delenv("DILOCO_SIGNING_KEY", raising=False)
    monkeypatch.delenv("DILOCO_KEYRING", raising=False)
    monkeypatch.setenv("DILOCO_SIGNING_KEY_BLOCK", "diloco-key-us-east-0")
    monkeypatch.setenv("DILOCO_KEYRING_BLOCK", "diloco-keyring")
    assert signing_key() == key.encode()
    assert keyring_of_env() == {"us-east-0": [key.encode()]}
    monkeypatch.setenv("DILOCO_SIGNING_KEY_BLOCK", "no-such-block")
    with pytest.raises(SigningError, match="no-such-block"):
        signing_key()
    assert "DILOCO_SIGNING_KEY" not in os.environ
