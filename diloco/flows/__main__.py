"""`python -m diloco.flows <role> ...`: run one role of a run as a Prefect flow run (what the local
supervisor starts on the Prefect path); the same internal arguments as `python -m diloco.launch`.

Contract: the flow run reports to PREFECT_API_URL, tagged with the run, the role and the learner; a warm
standby (`--standby`) imports prefect and the flows first and waits for a line on stdin.
"""

from __future__ import annotations

import sys

from diloco.flows.roles import main

sys.exit(main())
