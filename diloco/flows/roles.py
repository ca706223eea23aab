"""Run one role of a run as a Prefect flow run in this process, tagged for the UI (`python -m diloco.flows`),
under the `train` flow run that started it when there is one (diloco.flows.subflow).

Contract: the arguments are the launch protocol's (diloco.launch.parse_args); user errors are one line,
exit 2.
"""

from __future__ import annotations

import logging
import sys

from diloco.launch import parse_args, wait_as_standby, warm_up


def run_flow_role(role: str, storage: str, run_id: str, name: str | None = None, *,
                  phases: int | None = None, merges: int | None = None) -> int:
    """The role's flow (learner, outer-merge, evaluate) in a flow run tagged with the run (its task runs are
    not: diloco.flows.subflow.call_flow says why)."""
    from diloco.flows.subflow import call_flow

    base = {"storage": storage, "run_id": run_id}
    if role == "learner":
        from diloco.flows.learner import learner_flow

        return call_flow(learner_flow, {**base, "learner": name, "phases": phases},
                         [f"run:{run_id}", f"learner:{name}", "role:learner"])
    if role == "merger":
        from diloco.flows.outer_merge import outer_merge_flow

        return call_flow(outer_merge_flow, {**base, "merges": merges, "merger_id": name or "merger"},
                         [f"run:{run_id}", "role:merger"])
    from diloco.flows.evaluate import evaluate_flow

    return call_flow(evaluate_flow, base, [f"run:{run_id}", "role:evaluate"])


def warm_up_flows() -> None:
    """Everything a flow-run process imports before it can work: torch (warm_up), prefect, the flows."""
    warm_up()
    import prefect  # noqa: F401

    import diloco.flows.evaluate  # noqa: F401
    import diloco.flows.learner  # noqa: F401
    import diloco.flows.outer_merge  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, prog="diloco.flows")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.standby:
        warm_up_flows()
        if not wait_as_standby():
            return 0
    from diloco.supervise.user_errors import USER_ERRORS, describe

    try:
        run_flow_role(args.role, args.storage, args.run_id, args.name, phases=args.phases, merges=args.merges)
    except USER_ERRORS as err:
        print(f"error: {describe(err)}", file=sys.stderr)
        return 2
    return 0
