"""What one request costs the bridge's servers themselves: OTLP/HTTP against OTLP/gRPC.

Run: ``.venv/bin/python bench/receiver_cost.py [--requests 16000] [--handler-us 80]
[--baseline-rev REV]``

``bench/bridge_e2e.py`` measures the whole bridge per stored point; this bench isolates the
part that does not depend on the points: the server around the handler. Each arm is a fresh
server process whose handler answers at once after burning ``--handler-us`` of CPU in Python
(the intake's share of a 28-point request is ~90 us; 0 gives the servers alone):

- ``http``: the bridge's own ``AsyncHttpServer`` (handled on the loop as the bridge does with
  a memory spool), 1.1 kB bodies over keep-alive connections; with ``--baseline-rev`` also
  ``http@before``, that revision's server (``git archive``) in the same rounds;
- ``grpc:N``: grpcio's synchronous server with N handler threads;
- ``grpc-aio``: grpcio's asyncio server, handler on its loop (what the bridge's OTLP/gRPC
  receiver runs on).

``--connections`` client threads in this process send the requests; the server process's CPU
(``/proc``, user + system) is read from the first request to the last answer. Every figure
is the median of ``--rounds`` interleaved rounds (min-max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


# the bridge's limits, handled on the loop as with a memory spool
_LOOP_LIMITS: dict[str, Any] = {
    "max_connections": 1024,
    "max_concurrent_requests": 64,
    "request_timeout_s": 30.0,
    "idle_timeout_s": 120.0,
    "inline": lambda: True,
}


def serve(arm: str, handler_s: float, tree: Path) -> None:
    """Child: one server on a free port; prints it, then its CPU when told (stdin lines)."""
    for part in ("core/src", "otel_bridge/src"):
        sys.path.insert(0, str(tree / part))
    if arm == "http":
        from stepwatch.otel_bridge._http_server import AsyncHttpServer, HttpResponse

        ok = HttpResponse(200, {"Content-Type": "application/x-protobuf"}, b"", False)

        def handle(_request: object) -> HttpResponse:
            _burn(handler_s)
            return ok

        server = AsyncHttpServer(
            handle,
            early=lambda _m, _p, _headers: 16 << 20,
            busy=lambda _request: ok,
            **_LOOP_LIMITS,
        )
        print(server.start("127.0.0.1", 0), flush=True)
        _report()
        server.stop(timeout_s=5.0)
        return
    import grpc

    if arm == "grpc-aio":
        import asyncio

        async def export_aio(_body: bytes, _context: object) -> bytes:
            _burn(handler_s)
            return b""

        async def main() -> None:
            handler = grpc.method_handlers_generic_handler(
                SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(export_aio)}
            )
            server = grpc.aio.server(handlers=[handler], maximum_concurrent_rpcs=256)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, _report)
            await server.stop(1.0)

        asyncio.run(main())
        return
    from concurrent import futures

    def export(_body: bytes, _context: object) -> bytes:
        _burn(handler_s)
        return b""

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(export)}
    )
    workers = int(arm.split(":", 1)[1])
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        handlers=[handler],
        maximum_concurrent_rpcs=256,
    )
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    _report()
    server.stop(1.0)


def _report() -> None:
    sys.stdin.readline()  # "go": the clients are about to send
    print(_cpu_seconds(os.getpid()), flush=True)
    sys.stdin.readline()  # "done"
    print(_cpu_seconds(os.getpid()), flush=True)
    sys.stdin.readline()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(arm: str, port: int, body: bytes, count: int) -> None:
    if arm == "http":
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Content-Type": "application/x-protobuf"}
        for _ in range(count):
            connection.request("POST", "/v1/metrics", body, headers)
            connection.getresponse().read()
        connection.close()
        return
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(f"/{SERVICE}/Export")
        for _ in range(count):
            export(body, timeout=60)


def one_run(
    arm: str, handler_us: float, requests: int, connections: int, tree: Path = REPO
) -> float:
    """Server CPU per request (us) for one fresh server process."""
    child = subprocess.Popen(
        [
            sys.executable, __file__, "--serve", arm, "--handler-us", str(handler_us),
            "--tree", str(tree),
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(child.stdout.readline())
        body = os.urandom(1100)
        _client(arm, port, body, 50)  # connections and code paths warm
        child.stdin.write("go\n")
        child.stdin.flush()
        before = float(child.stdout.readline())
        threads = [
            threading.Thread(target=_client, args=(arm, port, body, requests // connections))
            for _ in range(connections)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        child.stdin.write("done\n")
        child.stdin.flush()
        after = float(child.stdout.readline())
        child.stdin.write("stop\n")
        child.stdin.flush()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    return (after - before) / (requests // connections * connections) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="http,grpc:2,grpc:8,grpc-aio")
    parser.add_argument("--requests", type=int, default=16000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--handler-us", type=float, default=80.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-rev", default="", help="git rev whose HTTP server is 'before'")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(REPO), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.handler_us / 1e6, Path(args.tree))
        return 0
    import tempfile

    from bench.bridge_cpu import source_tree

    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory(prefix="receiver-cost-") as directory:
        trees = {arm: REPO for arm in arms}
        if args.baseline_rev and "http" in arms:
            trees["http@before"] = source_tree(args.baseline_rev, Path(directory))
        results: dict[str, list[float]] = {arm: [] for arm in trees}
        for _ in range(args.rounds):
            for arm, tree in trees.items():
                results[arm].append(
                    one_run(
                        arm.split("@")[0], args.handler_us, args.requests, args.connections, tree
                    )
                )
    print(
        f"{args.requests} requests over {args.connections} connections, handler "
        f"{args.handler_us:.0f} us of CPU; server process CPU per request, median of "
        f"{args.rounds} interleaved rounds (min-max), and the part around the handler"
    )
    for arm, values in results.items():
        median = statistics.median(values)
        print(
            f"  {arm:11} {median:6.0f} us ({min(values):.0f}-{max(values):.0f})   around the "
            f"handler {median - args.handler_us:6.0f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
