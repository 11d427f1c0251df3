"""Clock skew and implausible durations: rejected, counted and reported, never stored."""

from __future__ import annotations

import argparse
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from stepwatch.app._bridge_command import register, resolve
from stepwatch.core import ConfigError, InfluxClient, settings
from stepwatch.core._influx import count_points, wait_until
from stepwatch.otel_bridge import Bridge, InfluxV1Writer, convert_request
from tests.otel_bridge.otlp_requests import (
    PROTO,
    SECOND,
    T0,
    T1,
    FixedClock,
    RecordingWriter,
    counter,
    explicit_histogram,
    exponential_histogram,
    gauge,
    post,
    request,
)


def summary(name: str, *, count: int, total: float, unit: str = "s") -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name, unit=unit)
    point = metric.summary.data_points.add(time_unix_nano=T1, count=count, sum=total)
    point.quantile_values.add(quantile=0.5, value=total / max(count, 1))
    return metric


def step_histogram(*, maximum: float, total: float, time_unix_nano: int = T1) -> metrics_pb2.Metric:
    return explicit_histogram(
        "stepwatch.step.duration",
        bounds=[1.0],
        counts=[1, 1],
        total=total,
        minimum=0.5,
        maximum=maximum,
        time_unix_nano=time_unix_nano,
    )


# -- clock skew ----------------------------------------------------------------------------------


def test_points_outside_the_time_bounds_are_rejected_inside_stored_as_sent() -> None:
    bounds = (T1 - 60 * SECOND, T1 + 60 * SECOND)
    conversion = convert_request(
        request(
            [
                gauge("hw.power", 1.0, time_unix_nano=T1 - 61 * SECOND),  # too old
                gauge("hw.power", 2.0, time_unix_nano=T1 - 59 * SECOND),  # small skew: kept
                gauge("hw.power", 3.0, time_unix_nano=T1 + 60 * SECOND),  # on the bound: kept
                gauge("hw.power", 4.0, time_unix_nano=T1 + 61 * SECOND),  # too far ahead
            ]
        ),
        time_bounds_unix_nano=bounds,
    )
    assert conversion.rejected == {"clock_skew": 2}
    stamps = [int(line.rsplit(" ", 1)[1]) for line in conversion.lines]
    assert stamps == [T1 - 59 * SECOND, T1 + 60 * SECOND]


def test_without_bounds_any_valid_time_is_accepted() -> None:
    conversion = convert_request(request([gauge("hw.power", 1.0, time_unix_nano=1)]))
    assert conversion.accepted_points == 1 and conversion.rejected == {}


@given(
    offset_s=st.integers(-10_000, 10_000),
    past_s=st.integers(1, 5_000),
    future_s=st.integers(1, 5_000),
)
def test_skew_verdict_is_exactly_the_interval(offset_s: int, past_s: int, future_s: int) -> None:
    stamp = T1 + offset_s * SECOND
    conversion = convert_request(
        request([gauge("hw.power", 1.0, time_unix_nano=stamp)]),
        time_bounds_unix_nano=(T1 - past_s * SECOND, T1 + future_s * SECOND),
    )
    kept = -past_s <= offset_s <= future_s
    assert conversion.accepted_points == (1 if kept else 0)
    assert conversion.rejected == ({} if kept else {"clock_skew": 1})


def test_bridge_rejects_skewed_points_and_says_so_in_partial_success() -> None:
    clock = FixedClock(T1)
    writer = RecordingWriter()
    with Bridge(
        writer,
        grpc_port=None,
        flush_interval_s=0.01,
        max_future_skew_s=600,
        max_past_skew_s=7 * 86_400,
        clock_unix_nano=clock,
    ) as bridge:
        body = request(
            [
                gauge("hw.power", 1.0, time_unix_nano=T1 + 3_600 * SECOND),  # an hour ahead
                gauge("hw.power", 2.0, time_unix_nano=T1 + 300 * SECOND),  # 5 min: kept
                gauge("hw.power", 3.0, time_unix_nano=T1 - 8 * 86_400 * SECOND),  # 8 days old
                gauge("hw.power", 4.0, time_unix_nano=T1 - 86_400 * SECOND),  # a day old: kept
            ]
        ).SerializeToString()
        status, _, answer = post(bridge.http_url, body, PROTO)
        assert status == 200
        reply = ExportMetricsServiceResponse.FromString(answer)
        assert reply.partial_success.rejected_data_points == 2
        assert reply.partial_success.error_message == "rejected data points: clock_skew=2"
        assert bridge.forwarder.wait_idle(10)
        assert wait_until(lambda: len(writer.lines) == 2, timeout_s=10)
        assert bridge.metrics.rejected.labels(reason="clock_skew")._value.get() == 2
        # The same point is fine once the receive clock has caught up.
        clock.now_unix_nano = T1 + 3_500 * SECOND
        status, _, answer = post(bridge.http_url, body, PROTO)
        assert ExportMetricsServiceResponse.FromString(answer).partial_success.error_message == (
            "rejected data points: clock_skew=1"
        )


def test_past_skew_is_unlimited_by_default() -> None:
    with Bridge(RecordingWriter(), grpc_port=None, clock_unix_nano=FixedClock(T1)) as bridge:
        old = request([gauge("hw.power", 1.0, time_unix_nano=T0 - 365 * 86_400 * SECOND)])
        status, _, answer = post(bridge.http_url, old.SerializeToString(), PROTO)
        assert status == 200
        assert (
            ExportMetricsServiceResponse.FromString(answer).partial_success.rejected_data_points
            == 0
        )


def test_skewed_rank_never_reaches_influxdb(influx: InfluxClient) -> None:
    now = time.time_ns()
    with Bridge(InfluxV1Writer(influx), http_port=None, flush_interval_s=0.01) as bridge:
        import grpc

        body = request(
            [
                step_histogram(maximum=1.5, total=2.0, time_unix_nano=now - 2 * SECOND),
                step_histogram(maximum=1.5, total=2.0, time_unix_nano=now + 7_200 * SECOND),
            ]
        ).SerializeToString()
        with grpc.insecure_channel(bridge.grpc_endpoint) as channel:
            answer = channel.unary_unary(
                "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
            )(body, timeout=10)
        reply = ExportMetricsServiceResponse.FromString(answer)
        assert reply.partial_success.rejected_data_points == 1
        assert "clock_skew=1" in reply.partial_success.error_message
        assert bridge.forwarder.wait_idle(10)
    assert count_points(influx, "stepwatch.step.duration") == 1


# -- implausible durations -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "reason"),
    [
        (step_histogram(maximum=2 * 86_400.0, total=2 * 86_400.0 + 0.5), "implausible_duration"),
        # no max sent: the mean (sum / count) gives it away
        (
            explicit_histogram(
                "stepwatch.step.duration", bounds=[1.0], counts=[0, 2], total=3 * 86_400.0
            ),
            "implausible_duration",
        ),
        (
            exponential_histogram(
                "stepwatch.kernel.duration",
                scale=0,
                offset=17,
                counts=[1],
                total=200_000.0,
                maximum=200_000.0,
            ),
            "implausible_duration",
        ),
        (summary("rpc.server.duration", count=2, total=5 * 86_400.0), "implausible_duration"),
        (step_histogram(maximum=float("nan"), total=1.0), "non_finite"),  # unchanged
        (step_histogram(maximum=-1.0, total=1.0), "negative_duration"),  # unchanged
    ],
)
def test_implausible_durations_are_rejected(metric: metrics_pb2.Metric, reason: str) -> None:
    conversion = convert_request(request([metric]))
    assert conversion.rejected == {reason: 1}
    assert conversion.lines == []


def test_plausible_and_non_duration_values_are_kept() -> None:
    metrics = [
        step_histogram(maximum=86_400.0, total=86_400.5),  # a whole day: still plausible
        # a cumulative histogram's sum grows with the run; only max and mean are bounded
        explicit_histogram(
            "stepwatch.step.duration",
            bounds=[1.0],
            counts=[1_000_000, 0],
            total=900_000.0,
            maximum=1.0,
        ),
        counter("stepwatch.idle.seconds", 10_000_000.0),  # a counter, not a duration histogram
        explicit_histogram(
            "hw.bytes", bounds=[1.0], counts=[0, 1], total=1e12, maximum=1e12, unit="By"
        ),
    ]
    conversion = convert_request(request(metrics))
    assert conversion.rejected == {} and conversion.accepted_points == 4


def test_the_duration_bound_is_configurable() -> None:
    metric = step_histogram(maximum=120.0, total=121.0)
    assert convert_request(request([metric]), max_duration_s=60.0).rejected == {
        "implausible_duration": 1
    }
    huge = step_histogram(maximum=1e9, total=1e9)
    assert convert_request(request([huge]), max_duration_s=None).accepted_points == 1


def test_bridge_counts_implausible_durations() -> None:
    writer = RecordingWriter()
    with Bridge(writer, grpc_port=None, max_duration_s=3_600.0, clock_unix_nano=FixedClock(T1)) as (
        bridge
    ):
        body = request(
            [step_histogram(maximum=7_200.0, total=7_201.0), step_histogram(maximum=2.0, total=2.5)]
        )
        status, _, answer = post(bridge.http_url, body.SerializeToString(), PROTO)
        assert status == 200
        reply = ExportMetricsServiceResponse.FromString(answer)
        assert reply.partial_success.error_message == "rejected data points: implausible_duration=1"
        assert bridge.metrics.rejected.labels(reason="implausible_duration")._value.get() == 1


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["max_future_skew_s", "max_past_skew_s", "max_duration_s"])
def test_bounds_must_be_positive(option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        Bridge(RecordingWriter(), **{option: 0.0})  # type: ignore[arg-type]


def cli_options(argv: list[str], environ: dict[str, str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return resolve(parser.parse_args(["bridge", *argv]), environ)


def test_cli_seconds_zero_means_no_limit() -> None:
    from stepwatch.app._bridge_command import _limit

    option = settings.BRIDGE_MAX_PAST_SKEW_S
    assert _limit(cli_options(["--max-past-skew-s", "604800"], {}), option) == 604_800.0
    assert _limit(cli_options(["--max-past-skew-s", "0"], {}), option) is None
    assert _limit(cli_options([], {}), option) is None  # the default: no limit
    with pytest.raises(ConfigError, match="--max-past-skew-s"):
        _limit(cli_options(["--max-past-skew-s", "-1"], {}), option)
    with pytest.raises(ConfigError, match="--max-duration-s"):
        cli_options(["--max-duration-s", "a day"], {})
    with pytest.raises(ConfigError, match=option.variable):
        cli_options([], {option.variable: "a week"})


def test_cli_options_reach_the_bridge() -> None:
    from stepwatch.app._bridge_command import _limit

    options = cli_options(
        ["--max-past-skew-s", "604800", "--max-duration-s", "0"],
        {settings.BRIDGE_MAX_FUTURE_SKEW_S.variable: "60"},
    )
    assert options["max_past_skew_s"] == 604_800.0
    assert options["max_future_skew_s"] == 60.0
    assert _limit(options, settings.BRIDGE_MAX_DURATION_S) is None


def test_cli_precedence_argument_then_variable_then_alias_then_default() -> None:
    database = settings.INFLUX_DATABASE
    both = {database.variables[0]: "primary", database.variables[1]: "alias"}
    assert cli_options(["--database", "argument"], both)["database"] == "argument"
    assert cli_options([], both)["database"] == "primary"
    assert cli_options([], {database.variables[1]: "alias"})["database"] == "alias"
    assert cli_options([], {})["database"] == database.default
    assert cli_options([], {})["grpc_port"] == 4317


def test_cli_help_shows_each_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    from stepwatch.app._bridge_command import OPTIONS

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["bridge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for setting, _ in OPTIONS:
        default = "unset" if setting.default is None else str(setting.default)
        assert f"{' or '.join(setting.variables)}; {default}]" in text, setting.name
