"""GrafanaAnnotationSink against a contract server.

No Grafana can be installed here, so :class:`GrafanaContract` is a small real HTTP server that
implements the part of Grafana's documented annotations API the sink uses
(https://grafana.com/docs/grafana/latest/developers/http_api/annotations/):
``POST /api/annotations`` (body ``dashboardUID?, time, timeEnd, tags, text`` → ``{"message":
"Annotation added", "id": n}``), ``PATCH /api/annotations/:id`` (only the given fields change →
``{"message": "Annotation patched"}``), ``GET /api/annotations?tags=..&tags=..&type=&limit=``
(annotations carrying *all* given tags, newest first), Bearer service-account auth (401
otherwise), 404 for an unknown id.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core import ConfigError, Diagnosis, InfluxClient
from stepwatch.core._errors import DeliveryError
from stepwatch.core._http import HttpResponse
from stepwatch.detectors.sinks._grafana import GrafanaAnnotationSink

TOKEN = "glsa_test_token"


class AnnotationsContract:
    """Grafana's documented annotations API, as a function of (method, path, headers, body)."""

    def __init__(self) -> None:
        self.annotations: dict[int, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self._next_id = 1
        self._lock = threading.Lock()

    def handle(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[int, Any]:
        with self._lock:
            self.requests.append((method, path))
            if headers.get("Authorization") != f"Bearer {TOKEN}":
                return 401, {"message": "Unauthorized"}
            parsed = urllib.parse.urlparse(path)
            payload: Any = json.loads(body) if body else {}
            if method == "POST" and parsed.path == "/api/annotations":
                if not isinstance(payload.get("text"), str) or "time" not in payload:
                    return 400, {"message": "bad request data"}
                new_id, self._next_id = self._next_id, self._next_id + 1
                self.annotations[new_id] = {
                    "id": new_id,
                    "dashboardUID": payload.get("dashboardUID", ""),
                    "panelId": payload.get("panelId", 0),
                    "time": int(payload["time"]),
                    "timeEnd": int(payload.get("timeEnd", payload["time"])),
                    "tags": list(payload.get("tags", [])),
                    "text": payload["text"],
                }
                return 200, {"message": "Annotation added", "id": new_id}
            match = re.fullmatch(r"/api/annotations/(\d+)", parsed.path)
            if method == "PATCH" and match:
                annotation = self.annotations.get(int(match.group(1)))
                if annotation is None:
                    return 404, {"message": "Annotation not found"}
                for key in ("time", "timeEnd", "tags", "text"):
                    if key in payload:
                        annotation[key] = payload[key]
                return 200, {"message": "Annotation patched"}
            if method == "GET" and parsed.path == "/api/annotations":
                query = urllib.parse.parse_qs(parsed.query)
                wanted = set(query.get("tags", []))
                limit = int(query.get("limit", ["100"])[0])
                found = [a for a in self.annotations.values() if wanted <= set(a["tags"])]
                found.sort(key=lambda a: -a["time"])
                return 200, found[:limit]
            return 404, {"message": "Not found"}


class ContractTransport:
    """An HttpTransport answering from an :class:`AnnotationsContract` in process."""

    def __init__(self, contract: AnnotationsContract) -> None:
        self.contract = contract

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse:
        del timeout_s
        parsed = urllib.parse.urlparse(url)
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        status, payload = self.contract.handle(method, path, headers, body)
        return HttpResponse(status, json.dumps(payload).encode())


class GrafanaContract(AnnotationsContract):
    """The contract served over real HTTP on a free loopback port."""

    def __init__(self) -> None:
        super().__init__()
        contract = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {key: value for key, value in self.headers.items()}
                status, payload = contract.handle(self.command, self.path, headers, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _serve

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def grafana() -> Iterator[GrafanaContract]:
    server = GrafanaContract()
    try:
        yield server
    finally:
        server.stop()


class Clocks:
    def __init__(self) -> None:
        self.wall_ns = 1_800_000_000 * 10**9
        self.mono_s = 0.0

    def advance(self, seconds: float) -> None:
        self.wall_ns += int(seconds * 1e9)
        self.mono_s += seconds


START_NS = 1_800_000_000 * 10**9 - 600 * 10**9


def straggler(rank: int = 17, *, end_ns: int | None = None) -> Diagnosis:
    return Diagnosis(
        job="run-42",
        kind="compute_straggler",
        start_unix_nano=START_NS,
        end_unix_nano=end_ns,
        severity="critical",
        score=3.4,
        summary=f"rank {rank} backward compute 1.31x peers (gemm 1.42x)",
        ranks=(rank,),
        hosts=("node-3",),
        phase="backward",
        kernel_class="gemm",
    )


def make_sink(
    grafana: GrafanaContract, clocks: Clocks, state: InfluxClient | None = None
) -> GrafanaAnnotationSink:
    return GrafanaAnnotationSink(
        grafana.url,
        token=TOKEN,
        state_client=state,
        dashboard_uid="stepwatch-job",
        update_interval_s=30,
        clock=lambda: clocks.wall_ns,
        monotonic=lambda: clocks.mono_s,
    )


def test_region_created_extended_closed_never_duplicated(
    grafana: GrafanaContract, influx: InfluxClient
) -> None:
    clocks = Clocks()
    sink = make_sink(grafana, clocks, influx)
    sink.publish([straggler()])
    sink.publish([straggler()])
    assert len(grafana.annotations) == 1
    annotation = grafana.annotations[1]
    assert annotation["time"] == START_NS // 10**6
    assert annotation["timeEnd"] == clocks.wall_ns // 10**6
    assert annotation["dashboardUID"] == "stepwatch-job"
    assert {"kind:compute_straggler", "job:run-42", "rank:17"} <= set(annotation["tags"])
    assert "rank 17 backward" in annotation["text"]

    clocks.advance(45)
    sink.publish([straggler()])
    assert grafana.annotations[1]["timeEnd"] == clocks.wall_ns // 10**6, "region extended"

    end_ns = clocks.wall_ns - 5 * 10**9
    sink.publish([straggler(end_ns=end_ns)])
    assert grafana.annotations[1]["timeEnd"] == end_ns // 10**6
    assert "(ended)" in grafana.annotations[1]["text"]
    patches = sum(1 for method, _ in grafana.requests if method == "PATCH")
    sink.publish([straggler(end_ns=end_ns)])
    assert sum(1 for method, _ in grafana.requests if method == "PATCH") == patches

    # A restarted detector (new sink, same state database) re-publishing: no duplicate, and
    # it does not even have to ask Grafana.
    gets = sum(1 for method, _ in grafana.requests if method == "GET")
    restarted = make_sink(grafana, clocks, influx)
    restarted.publish([straggler(end_ns=end_ns), straggler(rank=5)])
    assert len(grafana.annotations) == 2
    assert sum(1 for method, _ in grafana.requests if method == "GET") == gets + 1  # rank 5


def test_restart_without_state_finds_the_annotation_by_tag(grafana: GrafanaContract) -> None:
    clocks = Clocks()
    make_sink(grafana, clocks).publish([straggler()])
    clocks.advance(5)
    restarted = make_sink(grafana, clocks)
    restarted.publish([straggler()])
    assert len(grafana.annotations) == 1
    assert grafana.annotations[1]["timeEnd"] == clocks.wall_ns // 10**6


def test_bad_token_is_a_delivery_error(grafana: GrafanaContract) -> None:
    sink = GrafanaAnnotationSink(grafana.url, token="wrong")
    with pytest.raises(DeliveryError, match="401"):
        sink.publish([straggler()])
    assert not grafana.annotations
    assert "wrong" not in repr(sink)


def test_annotation_deleted_in_grafana_is_posted_again(grafana: GrafanaContract) -> None:
    clocks = Clocks()
    sink = make_sink(grafana, clocks)
    sink.publish([straggler()])
    grafana.annotations.clear()
    sink.publish([dataclasses.replace(straggler(), end_unix_nano=clocks.wall_ns)])
    assert [a["timeEnd"] for a in grafana.annotations.values()] == [clocks.wall_ns // 10**6]


@pytest.mark.parametrize(
    ("url", "token", "argument"),
    [("grafana:3000", "t", "url"), ("http://grafana:3000", "", "token")],
)
def test_config_errors_name_the_argument(url: str, token: str, argument: str) -> None:
    with pytest.raises(ConfigError, match=argument):
        GrafanaAnnotationSink(url, token=token)


def test_from_environment(grafana: GrafanaContract) -> None:
    assert GrafanaAnnotationSink.from_environment({}) is None
    with pytest.raises(ConfigError, match="GRAFANA_TOKEN"):
        GrafanaAnnotationSink.from_environment({"GRAFANA_URL": grafana.url})
    sink = GrafanaAnnotationSink.from_environment(
        {
            "GRAFANA_URL": "http://elsewhere:3000",
            "STEPWATCH_GRAFANA_URL": grafana.url,
            "GRAFANA_TOKEN": TOKEN,
        }
    )
    assert sink is not None
    sink.publish([straggler()])
    assert len(grafana.annotations) == 1


# One step of a detector's life: publish findings (some closed), advance time, or restart.
Step = tuple[str, tuple[int, ...], tuple[int, ...]]
steps = st.lists(
    st.tuples(
        st.sampled_from(["publish", "publish", "restart", "wait"]),
        st.lists(st.integers(0, 4), max_size=5).map(tuple),  # ranks of findings published
        st.lists(st.integers(0, 4), max_size=3).map(tuple),  # of those, which are closed
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_never_more_than_one_annotation_per_finding(history: list[Step]) -> None:
    """Whatever the order of publishes, closes and restarts: one annotation per finding,
    and a closed finding's region ends at its end."""
    contract = AnnotationsContract()
    clocks = Clocks()

    def new_sink() -> GrafanaAnnotationSink:
        return GrafanaAnnotationSink(
            "http://grafana:3000",
            token=TOKEN,
            transport=ContractTransport(contract),
            update_interval_s=30,
            clock=lambda: clocks.wall_ns,
            monotonic=lambda: clocks.mono_s,
        )

    sink = new_sink()
    closed_at: dict[int, int] = {}
    published: set[int] = set()
    for action, ranks, closing in history:
        if action == "restart":
            sink = new_sink()
        elif action == "wait":
            clocks.advance(40)
        else:
            batch = []
            for rank in set(ranks):
                if rank in closing or rank in closed_at:
                    closed_at.setdefault(rank, clocks.wall_ns)
                    batch.append(straggler(rank, end_ns=closed_at[rank]))
                else:
                    batch.append(straggler(rank))
                published.add(rank)
            sink.publish(batch)
    by_finding: dict[str, list[dict[str, Any]]] = {}
    for annotation in contract.annotations.values():
        key = next(t for t in annotation["tags"] if t.startswith("finding:"))
        by_finding.setdefault(key, []).append(annotation)
    assert len(by_finding) == len(published)
    assert all(len(items) == 1 for items in by_finding.values())
    for rank, end_ns in closed_at.items():
        (annotation,) = by_finding[f"finding:{straggler(rank).finding_id}"]
        assert annotation["timeEnd"] == end_ns // 10**6
