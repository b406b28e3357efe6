"""One JSON request to a server's REST API with the standard library, retried the way the
servers' own clients retry: what ``det``'s REST readers of MLflow (registry.runs.mlflow_rest) and
Prefect (flows.prefect_rest) send instead of importing those clients (1-4 s a command)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["HttpRefused", "Retries", "Unreachable", "request_json"]


class HttpRefused(Exception):
    """The server answered with an error status (after any retries)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status} {text[:300]}")
        self.status, self.text = status, text


class Unreachable(Exception):
    """No answer: refused, reset, timed out (after any retries)."""

    def __init__(self, err: Exception) -> None:
        reason = getattr(err, "reason", err)
        super().__init__(f"{type(err).__name__}: {reason}")


@dataclasses.dataclass(frozen=True)
class Retries:
    """Send again on these statuses and on timeouts or cut connections, up to ``count``
    times, after ``Retry-After`` or ``first_s``, then twice as long each time (+ up to
    20%)."""

    count: int
    statuses: frozenset[int]
    first_s: float = 2.0


def request_json(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
    retries: Retries | None = None,
    timeout_s: float = 30.0,
) -> Any:
    """The decoded JSON answer (None for an empty one); ``HttpRefused`` or ``Unreachable``."""
    policy = retries or Retries(0, frozenset())
    data = None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    for attempt in range(policy.count + 1):
        request = urllib.request.Request(url, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
                text = response.read()
            return json.loads(text) if text else None
        except urllib.error.HTTPError as err:
            answer = err.read().decode(errors="replace")
            if err.code not in policy.statuses or attempt == policy.count:
                raise HttpRefused(err.code, answer) from None
            wait = _after(err.headers.get("Retry-After"), policy.first_s * 2**attempt)
        except (TimeoutError, http.client.RemoteDisconnected, ConnectionResetError) as err:
            if attempt == policy.count:
                raise Unreachable(err) from None
            wait = _after(None, policy.first_s * 2**attempt)
        except (OSError, ValueError) as err:  # refused, unknown host, a bad URL: at once
            raise Unreachable(err) from None
        time.sleep(wait)
    raise AssertionError("the loop returns or raises")


def _after(header: str | None, backoff_s: float) -> float:
    try:
        base = float(header) if header else backoff_s
    except ValueError:
        base = backoff_s
    return base * random.uniform(1.0, 1.2)
