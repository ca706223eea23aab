"""The Python facade: a supervised run (diloco.api.run: what `diloco run` does), the operator's controls
(diloco.api.operate) and the summary a run returns (diloco.api.summary.RunSummary).

Contract: `diloco.api.<name>` is the one way in — the CLI and diloco.api.operate.resume call `api.supervise`
through this package, so a test that replaces it here replaces it for them; the engine never imports it (the
CLI and `diloco.train` do).
"""

from diloco.api.run import (
           STATE_DIR,
           check_local_device,
           create,
           prefect_api,
           resolve_config,
           supervise,
           train,
)
from diloco.api.summary import RunSummary

__all__ = ["STATE_DIR", "RunSummary", "check_local_device", "create", "prefect_api", "resolve_config",
           "supervise", "train"]
