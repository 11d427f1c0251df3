"""Small networking helpers shared by managed servers and tests."""

from __future__ import annotations

import socket
import time

from stepwatch.core._http import HttpClient


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_http_ready(url: str, *, timeout_s: float, expect_status: int = 200) -> bool:
    """Poll ``url`` until it answers ``expect_status`` or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.02
    client = HttpClient(max_idle=0)
    while time.monotonic() < deadline:
        try:
            if client.request("GET", url, headers={}, timeout_s=1.0).status == expect_status:
                return True
        except (OSError, ValueError):  # not up yet; ValueError: a bad URL (ConfigError)
            pass
        time.sleep(delay_s)
        delay_s = min(delay_s * 1.5, 0.25)
    return False
