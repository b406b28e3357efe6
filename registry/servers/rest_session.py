"""POSTs to one MLflow server over a kept HTTP session, with its headers worked out once.

MLflow's ``http_request`` re-resolves its request-header plugins (some try failing imports),
the workspace, the credentials and the proxies from the environment on every call: about
2.5 ms of CPU per request, four times what encoding a 1000-point batch costs. The metrics sink
posts a batch every few milliseconds of training while the training thread waits on the same
GIL, so it resolves all of that once per sink. Credentials a plain session cannot express
(AWS SigV4, auth plugins, the Databricks SDK) keep MLflow's own path.
"""

from __future__ import annotations

import base64
import os

import requests
from mlflow.tracking.request_header.registry import resolve_request_headers
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request
from mlflow.utils.workspace_context import get_request_workspace
from mlflow.utils.workspace_utils import WORKSPACE_HEADER_NAME

__all__ = ["AUTH_STATUS", "RETRYABLE_STATUS", "RestSession"]

# Worth sending again: what MLflow's own client retries (a timeout, too many requests) and
# any server-side error (overloaded, restarting, or a proxy in front that is). Any other
# 4xx but the credential ones below is the server refusing the request itself.
RETRYABLE_STATUS = frozenset({408, 429, *range(500, 600)})
# Credentials refused: read them again (a rotated token) and retry.
AUTH_STATUS = frozenset({401, 403, 407})


class RestSession:
    """``post(endpoint, body)`` to the MLflow server at ``tracking_uri``, no retries: the
    caller retries (the sink deduplicates before it does)."""

    def __init__(self, tracking_uri: str, timeout_s: float = 30.0) -> None:
        self._creds = get_default_host_creds(tracking_uri)
        self._host = self._creds.host.rstrip("/")
        self._timeout = timeout_s
        self._redirects = os.environ.get("MLFLOW_ALLOW_HTTP_REDIRECTS", "true").lower() in (
            "true",
            "1",
        )
        self._session: requests.Session | None = None
        if self._plain_credentials():
            self._session = self._build_session()

    def _plain_credentials(self) -> bool:
        creds = self._creds
        return not (
            creds.use_databricks_sdk
            or creds.aws_sigv4
            or creds.auth
            or getattr(creds, "client_secret", None)
        )

    def _build_session(self) -> requests.Session:
        creds = self._creds
        session = requests.Session()
        # The environment's proxy settings are read here, once, for this host (NO_PROXY
        # included); trust_env off stops requests from re-reading them per request.
        session.proxies.update(requests.utils.get_environ_proxies(self._host))
        session.trust_env = False
        # What trust_env would have read per request, read once: a CA bundle named in the
        # environment, and ~/.netrc credentials when MLflow's own settings give none.
        verify = creds.verify
        if verify is True:
            bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            verify = bundle or True
        session.verify = verify
        if creds.client_cert_path is not None:
            session.cert = creds.client_cert_path
        headers = dict(resolve_request_headers())
        if workspace := get_request_workspace():
            headers.setdefault(WORKSPACE_HEADER_NAME, workspace)
        if traffic_id := os.environ.get("MLFLOW_DATABRICKS_TRAFFIC_ID"):
            headers["x-databricks-traffic-id"] = traffic_id
        if creds.workspace_id:
            headers["x-databricks-org-id"] = creds.workspace_id
        if creds.username and creds.password:
            basic = base64.standard_b64encode(f"{creds.username}:{creds.password}".encode())
            headers["Authorization"] = "Basic " + basic.decode()
        elif creds.token:
            headers["Authorization"] = f"Bearer {creds.token}"
        elif netrc := requests.utils.get_netrc_auth(self._host):
            session.auth = netrc
        headers["Content-Type"] = "application/json"
        session.headers.update(headers)
        return session

    def post(self, endpoint: str, body: bytes) -> requests.Response:
        """The server's response; transport errors raise (``requests.RequestException`` or
        MLflow's wrapper of it)."""
        if self._session is None:
            return http_request(
                self._creds,
                endpoint,
                "POST",
                max_retries=0,
                timeout=self._timeout,
                raise_on_status=False,
                data=body,
                extra_headers={"Content-Type": "application/json"},
            )
        return self._session.post(
            self._host + endpoint,
            data=body,
            timeout=self._timeout,
            allow_redirects=self._redirects,
        )

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
