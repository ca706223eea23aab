"""The learner process of test_learner_memory: join, one step (the optimizer's state exists), then phases with
ships, prefetched installs, local-state saves and bucket checkpoints (moments every phase); prints JSON of its
resident memory: the floor after the first step and the high-water mark over the phases. Not a test by itself.
Run: python tests/integration/memory_child.py <storage> <run_id> <phases>
"""

from __future__ import annotations

import json
import sys
import time

from diloco.launch import warm_up
from diloco.learner.learner import Learner
from diloco.run.context import open_run
from diloco.run.heap import status_bytes
from diloco.storage import manifest_exists


def main(storage: str, run_id: str, phases: int) -> None:
    warm_up()  # what a learner process pays before its model (imports, zstd's libraries): its baseline
    ctx = open_run(storage, run_id)
    learner = Learner(ctx, "local-0")
    learner.join()
    learner.run_phase(num_steps=1)  # theta, the optimizer's moments: the floor
    floor = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for phase in range(phases):
        stats = learner.run_phase()
        learner.publish(stats)
        deadline = time.time() + 60
        while not manifest_exists(ctx.store, ctx.keys, phase + 1) and time.time() < deadline:
            time.sleep(0.05)
        for _ in range(100):  # the prefetcher fetches it; the next probe installs it
            if learner.maybe_install() is not None or learner.state.base > phase:
                break
            time.sleep(0.05)
    learner.drain()
    peak = status_bytes("VmHWM")
    params = sum(4 * p.numel() for p in learner.model.parameters())
    learner.close()
    print(json.dumps({"floor": floor, "peak": peak, "param_bytes": params, "base": learner.state.base}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
