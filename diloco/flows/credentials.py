"""AWS credentials for a flow from a Prefect block (prefect-aws), into this process's environment only.

Contract: the standard AWS variables are set for this process (and the processes it starts); no secret
is ever logged or written to the bucket.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("diloco.flows")


def export_aws_credentials(block_name: str) -> None:
    """Load a prefect-aws AwsCredentials block into the standard AWS variables of this process only."""
    try:
        from prefect_aws import AwsCredentials
    except ImportError:
        raise ValueError("aws_credentials_block needs prefect-aws: pip install 'diloco[aws]'") from None
    creds = AwsCredentials.load(block_name)
    secret = creds.aws_secret_access_key.get_secret_value() if creds.aws_secret_access_key else None
    values = {
        "AWS_ACCESS_KEY_ID": creds.aws_access_key_id, "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_SESSION_TOKEN": creds.aws_session_token, "AWS_PROFILE": creds.profile_name,
        "AWS_DEFAULT_REGION": creds.region_name, "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url,
    }
    for name, value in values.items():
        if value:
            os.environ[name] = str(value)
    log.info("AWS credentials from block %r exported (%s)", block_name,
             ", ".join(n for n, v in values.items() if v))

