"""Duplicate ranks: a second producer of a live (job, rank) is rejected, counted and reported."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from stepwatch.core import ConfigError, InfluxClient
from stepwatch.otel_bridge import Bridge, InfluxV1Writer, convert_request
from stepwatch.otel_bridge._identity import RankIdentityGuard, Verdict
from tests.otel_bridge.otlp_requests import (
    PROTO,
    SECOND,
    T1,
    FixedClock,
    RecordingWriter,
    gauge,
    post,
    rank_resource,
    request,
    window_request,
)


def producer(host: str, *, job: str = "j", rank: str = "0", **extra: str) -> dict[str, str]:
    return {"stepwatch.job.id": job, "stepwatch.rank": rank, "host.name": host, **extra}


def on_host(body: ExportMetricsServiceRequest, host: str) -> ExportMetricsServiceRequest:
    for item in body.resource_metrics[0].resource.attributes:
        if item.key == "host.name":
            item.value.string_value = host
    return body


# -- the guard -----------------------------------------------------------------------------------


def test_first_producer_keeps_the_rank_while_live() -> None:
    guard = RankIdentityGuard(takeover_after_s=30)
    assert guard.observe(producer("a"), now_unix_nano=0) is Verdict.NEW
    assert guard.observe(producer("a"), now_unix_nano=10 * SECOND) is Verdict.SAME
    assert guard.observe(producer("b"), now_unix_nano=20 * SECOND) is Verdict.CONFLICT
    assert guard.observe(producer("a"), now_unix_nano=35 * SECOND) is Verdict.SAME
    assert guard.observe(producer("b"), now_unix_nano=64 * SECOND) is Verdict.CONFLICT
    assert guard.owner("j", "0") == ("a", "", "")


def test_rank_restarted_elsewhere_takes_over_after_the_old_one_went_silent() -> None:
    guard = RankIdentityGuard(takeover_after_s=30)
    guard.observe(producer("a"), now_unix_nano=0)
    # The newcomer retrying does not keep the dead producer's lease alive.
    for second in range(1, 30):
        assert guard.observe(producer("b"), now_unix_nano=second * SECOND) is Verdict.CONFLICT
    assert guard.observe(producer("b"), now_unix_nano=30 * SECOND) is Verdict.TAKEOVER
    assert guard.observe(producer("b"), now_unix_nano=31 * SECOND) is Verdict.SAME
    assert guard.observe(producer("a"), now_unix_nano=32 * SECOND) is Verdict.CONFLICT  # a zombie
    assert guard.owner("j", "0") == ("b", "", "")


def test_identity_includes_instance_id_and_pid_when_sent() -> None:
    guard = RankIdentityGuard()
    first = producer("a", **{"service.instance.id": "uuid-1", "process.pid": "11"})
    second = producer("a", **{"service.instance.id": "uuid-2", "process.pid": "12"})
    assert guard.observe(first, now_unix_nano=0) is Verdict.NEW
    assert guard.observe(second, now_unix_nano=SECOND) is Verdict.CONFLICT  # same host, 2 procs


def test_ranks_and_jobs_are_independent_and_untracked_resources_pass() -> None:
    guard = RankIdentityGuard()
    assert guard.observe(producer("a", rank="0"), now_unix_nano=0) is Verdict.NEW
    assert guard.observe(producer("b", rank="1"), now_unix_nano=0) is Verdict.NEW
    assert guard.observe(producer("b", job="k", rank="0"), now_unix_nano=0) is Verdict.NEW
    anonymous = {"stepwatch.job.id": "j", "stepwatch.rank": "0"}
    assert guard.observe(anonymous, now_unix_nano=0) is Verdict.UNTRACKED
    assert guard.observe({"host.name": "c"}, now_unix_nano=0) is Verdict.UNTRACKED
    assert len(guard) == 3


def test_memory_is_bounded_least_recently_heard_forgotten() -> None:
    guard = RankIdentityGuard(max_ranks=2)
    guard.observe(producer("a", rank="0"), now_unix_nano=0)
    guard.observe(producer("a", rank="1"), now_unix_nano=1)
    guard.observe(producer("a", rank="0"), now_unix_nano=2)  # rank 0 is now the most recent
    guard.observe(producer("a", rank="2"), now_unix_nano=3)
    assert len(guard) == 2
    assert guard.owner("j", "1") is None and guard.owner("j", "0") == ("a", "", "")


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"takeover_after_s": 0.0}, "takeover_after_s"),
        ({"max_ranks": 0}, "max_ranks"),
        ({"identity_keys": ()}, "identity_keys"),
        ({"identity_keys": "host.name"}, "identity_keys"),
    ],
)
def test_config_mistakes_name_the_argument(options: dict[str, object], argument: str) -> None:
    with pytest.raises(ConfigError, match=argument):
        RankIdentityGuard(**options)  # type: ignore[arg-type]


@given(
    exports=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 40 * SECOND)), min_size=1, max_size=60
    )
)
def test_two_producers_never_interleave_within_the_takeover_window(
    exports: list[tuple[str, int]],
) -> None:
    """Accepted exports change producer only after the previous one was silent long enough."""
    guard = RankIdentityGuard(takeover_after_s=30)
    now = 0
    last_accepted: dict[str, int] = {}
    owner: str | None = None
    for host, step in exports:
        now += step
        verdict = guard.observe(producer(host), now_unix_nano=now)
        if verdict is Verdict.CONFLICT:
            assert owner is not None and owner != host
            assert now - last_accepted[owner] < 30 * SECOND
            continue
        if owner is not None and owner != host:
            assert verdict is Verdict.TAKEOVER
            assert now - last_accepted[owner] >= 30 * SECOND
        owner = host
        last_accepted[host] = now


# -- conversion and the bridge -------------------------------------------------------------------


def test_only_stepwatch_points_of_the_duplicate_are_refused() -> None:
    body = request(
        [gauge("stepwatch.step.last", 7, unit="{step}"), gauge("hw.power", 300.0)],
        rank_resource("j", 0, 4),
    )
    conversion = convert_request(body)  # the pure conversion has no guard
    assert conversion.accepted_points == 2
    from stepwatch.otel_bridge._convert import convert_to_points

    batch = convert_to_points(body, resource_check=lambda attributes: "duplicate_rank")
    assert dict(batch.rejected) == {"duplicate_rank": 1}
    assert [point.measurement for point in batch.points] == ["hw.power"]


def test_bridge_rejects_a_live_duplicate_and_accepts_a_restart(influx: InfluxClient) -> None:
    clock = FixedClock(T1)
    with Bridge(
        InfluxV1Writer(influx),
        grpc_port=None,
        flush_interval_s=0.01,
        duplicate_rank_takeover_s=30,
        clock_unix_nano=clock,
    ) as bridge:

        def send(host: str, window: int) -> ExportMetricsServiceResponse:
            body = on_host(window_request(job="dup", rank=1, world_size=2, window=window), host)
            status, _, answer = post(bridge.http_url, body.SerializeToString(), PROTO)
            assert status == 200
            return ExportMetricsServiceResponse.FromString(answer)

        assert send("node-a", 0).partial_success.rejected_data_points == 0
        clock.now_unix_nano += 5 * SECOND
        duplicate = send("node-b", 1)  # a misconfigured launcher: two rank 1s
        assert duplicate.partial_success.rejected_data_points == 3
        assert duplicate.partial_success.error_message == "rejected data points: duplicate_rank=3"
        clock.now_unix_nano += 5 * SECOND
        assert send("node-a", 2).partial_success.rejected_data_points == 0
        # node-a dies; node-b (the restarted rank) takes over once node-a has been silent 30 s
        clock.now_unix_nano += 30 * SECOND
        assert send("node-b", 3).partial_success.rejected_data_points == 0
        assert bridge.forwarder.wait_idle(10)
        rejected = bridge.metrics.rejected.labels(reason="duplicate_rank")._value.get()
        conflicts = bridge.metrics.rank_conflicts.labels(outcome="rejected")._value.get()
        takeovers = bridge.metrics.rank_conflicts.labels(outcome="taken_over")._value.get()
    assert (rejected, conflicts, takeovers) == (3, 1, 1)
    rows = influx.query('SELECT count("count") FROM "stepwatch.step.duration" GROUP BY "host.name"')
    stored = {row.tags["host.name"]: row.values[0][1] for row in rows}
    assert stored == {"node-a": 2, "node-b": 1}  # window 1 from node-b never stored


def test_guard_can_be_disabled() -> None:
    writer = RecordingWriter()
    with Bridge(
        writer, grpc_port=None, duplicate_rank_takeover_s=None, clock_unix_nano=FixedClock(T1)
    ) as bridge:
        assert bridge.identity is None
        for host in ("node-a", "node-b"):
            body = on_host(window_request(job="d", rank=0, world_size=1, window=0), host)
            answer = post(bridge.http_url, body.SerializeToString(), PROTO)[2]
            reply = ExportMetricsServiceResponse.FromString(answer)
            assert reply.partial_success.rejected_data_points == 0


def test_docstring_examples_run() -> None:
    import doctest

    import stepwatch.otel_bridge._identity as identity_module

    failures, tested = doctest.testmod(identity_module, raise_on_error=False)
    assert failures == 0 and tested > 0
