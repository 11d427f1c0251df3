"""Every environment variable stepwatch reads, its default and how it is parsed: one place.

Precedence everywhere is the OpenTelemetry SDK's: an explicit argument (or command-line
option) > the environment variable (then its aliases, in order) > the default. A value is
read when the object or command that needs it is built, never at import.

Example:
    >>> from stepwatch.core import settings
    >>> settings.INFLUX_DATABASE.resolve(None, {"STEPWATCH_DATABASE": "runs"})
    'runs'
    >>> settings.BRIDGE_HTTP_PORT.resolve(None, {})
    4318
    >>> settings.BRIDGE_HTTP_PORT.resolve(9000, {"STEPWATCH_BRIDGE_HTTP_PORT": "1"})
    9000
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from stepwatch.core._errors import ConfigError

T = TypeVar("T")


def _text(raw: str) -> str:
    return raw


def _int(raw: str) -> int:
    return int(raw)


def _float(raw: str) -> float:
    return float(raw)


def _switch(raw: str) -> bool:
    """An on/off variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``."""
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/true/yes/on or 0/false/no/off")


def _backward_mark(raw: str) -> str:
    """``engine`` or ``tensor-hook`` (``tensor_hook`` read as ``tensor-hook``)."""
    value = raw.lower().replace("_", "-")
    if value not in ("engine", "tensor-hook"):
        raise ValueError("expected engine or tensor-hook")
    return value


def _milliseconds_as_s(raw: str) -> float:
    """OTel's ``*_TIMEOUT`` and ``*_INTERVAL`` variables are milliseconds."""
    value = float(raw) / 1000.0
    if not value > 0:
        raise ValueError("must be positive")
    return value


@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    """One configurable value: its variable, aliases, default and parser.

    Attributes:
        name: the option's name in code and on the command line (``influx_url`` →
            ``--influx-url``).
        variable: the environment variable read first.
        default: the value when neither an argument nor a variable is set.
        parse: turns the variable's text into the value; raises ``ValueError`` on bad text.
        help: one line for ``--help`` and docs/settings.md.
        aliases: further variables read, in order, after ``variable`` (older or standard
            names, e.g. ``ALERTMANAGER_URL`` after ``STEPWATCH_ALERTMANAGER_URL``).
        unit: how the variable is written when it differs from the value (``ms``).
    """

    name: str
    variable: str
    default: T | None
    parse: Callable[[str], T]
    help: str
    aliases: tuple[str, ...] = ()
    unit: str = ""

    @property
    def variables(self) -> tuple[str, ...]:
        """``variable`` then the aliases: every name this setting is read from."""
        return (self.variable, *self.aliases)

    def lookup(self, environ: Mapping[str, str]) -> tuple[T | None, str | None]:
        """The value from the environment and the variable it came from (``None``: unset).

        Raises:
            ConfigError: the variable is set but does not parse (names the variable).
        """
        for variable in self.variables:
            raw = environ.get(variable, "").strip()
            if not raw:
                continue
            try:
                return self.parse(raw), variable
            except ValueError as exc:
                raise ConfigError(f"{variable}: {raw!r} is not valid ({exc})") from exc
        return None, None

    def resolve(self, argument: T | None, environ: Mapping[str, str]) -> T | None:
        """Argument > environment > default."""
        if argument is not None:
            return argument
        value, _ = self.lookup(environ)
        return self.default if value is None else value


# ---- InfluxDB (bridge, detectors, report, up) ----------------------------------------------
INFLUX_URL = Setting[str](
    "influx_url", "STEPWATCH_INFLUX_URL", "http://127.0.0.1:8086", _text, "InfluxDB base URL"
)
INFLUX_DATABASE = Setting[str](
    "database",
    "STEPWATCH_INFLUX_DATABASE",
    "stepwatch",
    _text,
    "database (v1 API) to write and read",
    aliases=("STEPWATCH_DATABASE",),
)
INFLUX_TOKEN = Setting[str](
    "token",
    "STEPWATCH_INFLUX_TOKEN",
    None,
    _text,
    "InfluxDB token (2.x/3.x)",
    aliases=("INFLUX_TOKEN",),
)
INFLUX_ORG = Setting[str]("org", "STEPWATCH_INFLUX_ORG", None, _text, "InfluxDB v2 organisation")
INFLUX_BUCKET = Setting[str]("bucket", "STEPWATCH_INFLUX_BUCKET", None, _text, "InfluxDB v2 bucket")

# ---- the bridge ----------------------------------------------------------------------------
BRIDGE_HOST = Setting[str](
    "host", "STEPWATCH_BRIDGE_HOST", "127.0.0.1", _text, "listen address (loopback by default)"
)
BRIDGE_GRPC_PORT = Setting[int](
    "grpc_port", "STEPWATCH_BRIDGE_GRPC_PORT", 4317, _int, "OTLP/gRPC port (0: any free port)"
)
BRIDGE_HTTP_PORT = Setting[int](
    "http_port",
    "STEPWATCH_BRIDGE_HTTP_PORT",
    4318,
    _int,
    "OTLP/HTTP port, also /metrics and /healthz",
)
BRIDGE_SPOOL_DIR = Setting[str](
    "spool_dir", "STEPWATCH_BRIDGE_SPOOL_DIR", None, _text, "disk spool directory"
)
BRIDGE_SPOOL_MAX_BYTES = Setting[int](
    "spool_max_bytes",
    "STEPWATCH_BRIDGE_SPOOL_MAX_BYTES",
    256 * 1024 * 1024,
    _int,
    "spool bound in bytes",
)
BRIDGE_TOKEN = Setting[str](
    "auth_token", "STEPWATCH_BRIDGE_TOKEN", None, _text, "bearer token clients must send"
)
BRIDGE_TOKEN_FILE = Setting[str](
    "auth_token_file",
    "STEPWATCH_BRIDGE_TOKEN_FILE",
    None,
    _text,
    "file holding the bearer token clients must send",
)
BRIDGE_TLS_CERT = Setting[str](
    "tls_cert", "STEPWATCH_BRIDGE_TLS_CERT", None, _text, "PEM certificate for TLS"
)
BRIDGE_TLS_KEY = Setting[str](
    "tls_key", "STEPWATCH_BRIDGE_TLS_KEY", None, _text, "PEM private key for TLS"
)
BRIDGE_MAX_SERIES = Setting[int](
    "max_series",
    "STEPWATCH_BRIDGE_MAX_SERIES",
    2_000_000,
    _int,
    "series per measurement per job (0: no guard)",
)
BRIDGE_MAX_QUEUE_LINES = Setting[int](
    "max_queue_lines",
    "STEPWATCH_BRIDGE_MAX_QUEUE_LINES",
    200_000,
    _int,
    "points queued in memory before 429s",
)
BRIDGE_MAX_FUTURE_SKEW_S = Setting[float](
    "max_future_skew_s",
    "STEPWATCH_BRIDGE_MAX_FUTURE_SKEW_S",
    600.0,
    _float,
    "reject points stamped this far ahead of receive time (0: no limit)",
)
BRIDGE_MAX_PAST_SKEW_S = Setting[float](
    "max_past_skew_s",
    "STEPWATCH_BRIDGE_MAX_PAST_SKEW_S",
    0.0,
    _float,
    "reject points stamped this far behind receive time (0: no limit)",
)
BRIDGE_MAX_DURATION_S = Setting[float](
    "max_duration_s",
    "STEPWATCH_BRIDGE_MAX_DURATION_S",
    86400.0,
    _float,
    "reject duration histograms whose max or mean exceed this (0: no limit)",
)
BRIDGE_DUPLICATE_RANK_TAKEOVER_S = Setting[float](
    "duplicate_rank_takeover_s",
    "STEPWATCH_BRIDGE_DUPLICATE_RANK_TAKEOVER_S",
    30.0,
    _float,
    "reject a second producer of a live (job, rank) until the first is silent this long "
    "(0: no guard)",
)

BRIDGE_SPOOL_OVERFLOW = Setting[str](
    "spool_overflow",
    "STEPWATCH_BRIDGE_SPOOL_OVERFLOW",
    "drop_oldest",
    _text,
    "spool full: drop_oldest (drop the oldest accepted points, counted) or drop_newest "
    "(refuse new requests with 429: nothing accepted is dropped)",
)
BRIDGE_MAX_SERIES_TOTAL = Setting[int](
    "max_series_total",
    "STEPWATCH_BRIDGE_MAX_SERIES_TOTAL",
    1_000_000,
    _int,
    "series one bridge process remembers, all jobs together (0: no total)",
)
BRIDGE_MAX_NEW_SERIES_PER_S = Setting[float](
    "max_new_series_per_s",
    "STEPWATCH_BRIDGE_MAX_NEW_SERIES_PER_S",
    2000.0,
    _float,
    "new series per second per bridge process, bursts of 10 s; faster is 429 (0: no limit)",
)
BRIDGE_REQUEST_TIMEOUT_S = Setting[float](
    "request_timeout_s",
    "STEPWATCH_BRIDGE_REQUEST_TIMEOUT_S",
    30.0,
    _float,
    "deadline for one request's headers and body (HTTP 408) or one call's message (gRPC "
    "DEADLINE_EXCEEDED), from its first byte",
)
BRIDGE_MAX_CONNECTIONS = Setting[int](
    "max_connections",
    "STEPWATCH_BRIDGE_MAX_CONNECTIONS",
    4096,
    _int,
    "connections open at once per receiver (HTTP: a new one replaces the one idle longest; "
    "gRPC: beyond it closed)",
)
BRIDGE_IDLE_TIMEOUT_S = Setting[float](
    "idle_timeout_s",
    "STEPWATCH_BRIDGE_IDLE_TIMEOUT_S",
    120.0,
    _float,
    "a connection with no request or call in progress is closed after this (PINGs do not count)",
)
BRIDGE_HANDSHAKE_TIMEOUT_S = Setting[float](
    "handshake_timeout_s",
    "STEPWATCH_BRIDGE_HANDSHAKE_TIMEOUT_S",
    5.0,
    _float,
    "a new gRPC connection must finish TLS, its HTTP/2 preface and SETTINGS within this",
)
BRIDGE_MAX_CONNECTION_AGE_S = Setting[float](
    "max_connection_age_s",
    "STEPWATCH_BRIDGE_MAX_CONNECTION_AGE_S",
    300.0,
    _float,
    "a gRPC connection gets GOAWAY after this and is closed 30 s later with what it holds",
)
BRIDGE_MAX_HEADER_BYTES = Setting[int](
    "max_header_bytes",
    "STEPWATCH_BRIDGE_MAX_HEADER_BYTES",
    16384,
    _int,
    "request line and header fields (HTTP, 431 beyond) or a call's header list (gRPC)",
)
BRIDGE_GRPC_MAX_CONCURRENT_STREAMS = Setting[int](
    "grpc_max_concurrent_streams",
    "STEPWATCH_BRIDGE_GRPC_MAX_CONCURRENT_STREAMS",
    32,
    _int,
    "HTTP/2 streams per gRPC connection (advertised); a stream holding an answer the client's "
    "flow-control window keeps back still counts",
)

# ---- the bridge: stored histogram layout (issue 15; docs/storage.md, "Histogram layouts") ----
BRIDGE_HISTOGRAM_LAYOUT = Setting[str](
    "histogram_layout",
    "STEPWATCH_BRIDGE_HISTOGRAM_LAYOUT",
    "compact",
    _text,
    "compact (buckets in one string field: a fixed set of columns) or per_bound (one field per "
    "bucket bound, as a Collector's influxdb exporter writes)",
)

# ---- detectors' sinks ----------------------------------------------------------------------
ALERTMANAGER_URL = Setting[str](
    "alertmanager_url",
    "STEPWATCH_ALERTMANAGER_URL",
    None,
    _text,
    "Alertmanager base URL: findings become alerts",
    aliases=("ALERTMANAGER_URL",),
)
GRAFANA_URL = Setting[str](
    "grafana_url",
    "STEPWATCH_GRAFANA_URL",
    None,
    _text,
    "Grafana base URL: findings become annotations (needs a token)",
    aliases=("GRAFANA_URL",),
)
GRAFANA_TOKEN = Setting[str](
    "grafana_token",
    "STEPWATCH_GRAFANA_TOKEN",
    None,
    _text,
    "Grafana service-account token",
    aliases=("GRAFANA_TOKEN",),
)
GRAFANA_DASHBOARD_UID = Setting[str](
    "grafana_dashboard_uid",
    "STEPWATCH_GRAFANA_DASHBOARD_UID",
    None,
    _text,
    "dashboard the annotations are tied to (all dashboards when unset)",
)
DASHBOARD_URL = Setting[str](
    "dashboard_url",
    "STEPWATCH_DASHBOARD_URL",
    None,
    _text,
    "Grafana dashboard URL that alerts link to",
)

# ---- detectors: hangs (issue 12) -----------------------------------------------------------
HANG_STEPS = Setting[float](
    "hang_steps",
    "STEPWATCH_HANG_STEPS",
    10.0,
    _float,
    "a job that finished no step for this many of its usual steps is hung ...",
)
HANG_MIN_S = Setting[float](
    "hang_min_s",
    "STEPWATCH_HANG_MIN_S",
    10.0,
    _float,
    "... and for at least this many seconds",
)
HANG_PROBE_INTERVAL_S = Setting[float](
    "hang_probe_interval_s",
    "STEPWATCH_HANG_PROBE_INTERVAL_S",
    5.0,
    _float,
    "how often the detector service of `up` looks for hangs (latest progress only; 0: off)",
)

# ---- the local stack (up, demo) ------------------------------------------------------------
DATA_DIR = Setting[str](
    "data_dir",
    "STEPWATCH_DATA_DIR",
    None,
    _text,
    "home of the managed influxd and the spool (default $XDG_DATA_HOME/stepwatch or "
    "~/.local/share/stepwatch)",
)
XDG_DATA_HOME = Setting[str](
    "xdg_data_home", "XDG_DATA_HOME", None, _text, "base of the default data directory"
)

# ---- exporters (OpenTelemetry's own variables) ---------------------------------------------
# https://opentelemetry.io/docs/specs/otel/protocol/exporter/ : the signal-specific variable
# wins over the generic one. The generic endpoint is a base URL (``/v1/metrics`` appended).
OTLP_ENDPOINT = Setting[str](
    "endpoint",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    None,
    _text,
    "collector or bridge URL (default http://localhost:4318, or :4317 for grpc)",
    aliases=("OTEL_EXPORTER_OTLP_ENDPOINT",),
)
OTLP_PROTOCOL = Setting[str](
    "protocol",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "http/protobuf",
    _text,
    "http/protobuf, grpc, or http/json (sent as http/protobuf, one warning)",
    aliases=("OTEL_EXPORTER_OTLP_PROTOCOL",),
)
OTLP_HEADERS = Setting[str](
    "headers",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    None,
    _text,
    "request headers, k1=v1,k2=v2 URL-encoded",
    aliases=("OTEL_EXPORTER_OTLP_HEADERS",),
)
OTLP_COMPRESSION = Setting[str](
    "compression",
    "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
    "gzip",  # issue 13: 3.3 KB → 983 B per rank per step on the DLRM trace (bench/kernel_bytes.py)
    _text,
    "none, gzip (default, as the Collector's OTLP exporters) or deflate",
    aliases=("OTEL_EXPORTER_OTLP_COMPRESSION",),
)
OTLP_TIMEOUT_S = Setting[float](
    "timeout_s",
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    10.0,
    _milliseconds_as_s,
    "bound on one export call, retries included",
    aliases=("OTEL_EXPORTER_OTLP_TIMEOUT",),
    unit="ms",
)
OTLP_CERTIFICATE = Setting[str](
    "certificate_file",
    "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
    None,
    _text,
    "PEM CA bundle verifying an https endpoint",
    aliases=("OTEL_EXPORTER_OTLP_CERTIFICATE",),
)
OTLP_CLIENT_KEY = Setting[str](
    "client_key_file",
    "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
    None,
    _text,
    "PEM private key for mutual TLS",
    aliases=("OTEL_EXPORTER_OTLP_CLIENT_KEY",),
)
OTLP_CLIENT_CERTIFICATE = Setting[str](
    "client_certificate_file",
    "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
    None,
    _text,
    "PEM client certificate for mutual TLS",
    aliases=("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",),
)
METRIC_EXPORT_INTERVAL_S = Setting[float](
    "export_interval_s",
    "OTEL_METRIC_EXPORT_INTERVAL",
    10.0,
    _milliseconds_as_s,
    "one window per interval (each window whole steps)",
    unit="ms",
)
KINETO_LOG_LEVEL = Setting[str](
    "kineto_log_level",
    "KINETO_LOG_LEVEL",
    None,
    _text,
    "PyTorch's own; when unset, stepwatch's profiler source silences Kineto's per-cycle log",
)


# ---- exporters: who the rank is (torchrun) and the OTel SDK's own variables (issue 13) -----
# torchrun (torch.distributed.run) sets these for every worker; an argument given to
# StepMonitor wins over them. https://pytorch.org/docs/stable/elastic/run.html
TORCHRUN_RANK = Setting[int](
    "rank", "RANK", None, _int, "global rank, when StepMonitor(rank=) is not given (torchrun)"
)
TORCHRUN_WORLD_SIZE = Setting[int](
    "world_size",
    "WORLD_SIZE",
    None,
    _int,
    "number of ranks, when StepMonitor(world_size=) is not given (torchrun)",
)
TORCHRUN_LOCAL_RANK = Setting[int](
    "local_rank",
    "LOCAL_RANK",
    None,
    _int,
    "rank within the node, when StepMonitor(local_rank=) is not given (torchrun)",
)
TORCHRUN_RUN_ID = Setting[str](
    "job_id",
    "TORCHELASTIC_RUN_ID",
    None,
    _text,
    "the job id, when StepMonitor(job_id=) is not given (torchrun's --rdzv-id; 'none' ignored)",
)
# OpenTelemetry specification, "Environment Variable Specification" (general SDK
# configuration) and "OTLP Exporter Configuration": read by StepMonitor, semantics in
# stepwatch.exporters._sdk_env. Booleans: only "true" (any case) is true.
SDK_DISABLED = Setting[str](
    "sdk_disabled",
    "OTEL_SDK_DISABLED",
    "false",
    _text,
    "true: StepMonitor is a no-op (times nothing, exports nothing, never raises)",
)
SERVICE_NAME = Setting[str](
    "service_name",
    "OTEL_SERVICE_NAME",
    None,
    _text,
    "service.name (default stepwatch); wins over service.name in OTEL_RESOURCE_ATTRIBUTES",
)
RESOURCE_ATTRIBUTES = Setting[str](
    "resource_attributes",
    "OTEL_RESOURCE_ATTRIBUTES",
    None,
    _text,
    "extra resource attributes, k1=v1,k2=v2 percent-encoded (stepwatch.* keys ignored)",
)
OTLP_TEMPORALITY_PREFERENCE = Setting[str](
    "temporality_preference",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
    None,
    _text,
    "unset, delta or lowmemory: histograms and counters are delta (one window each); "
    "cumulative: running totals since the first window (docs/exporters.md, Temporality)",
)
OTLP_INSECURE = Setting[str](
    "insecure",
    "OTEL_EXPORTER_OTLP_METRICS_INSECURE",
    "false",
    _text,
    "true: plaintext gRPC to an endpoint given without a scheme (else TLS)",
    aliases=("OTEL_EXPORTER_OTLP_INSECURE",),
)
# --- Exporters' histogram layout (issue 13 item 2; read by WindowBuilder's
# ``histogram_buckets``; StepMonitor wiring pending in exporters/_config.py) ---
HISTOGRAM_BUCKETS = Setting[str](
    "histogram_buckets",
    "STEPWATCH_HISTOGRAM_BUCKETS",
    "exponential",
    _text,
    "exponential, or explicit: fixed log-spaced bounds a Collector's influxdb exporter keeps",
)

# ---- the C extensions (issue 46; docs/packaging.md) ----------------------------------------
# The exporters' and the bridge's C fast paths are optional: a package built without a C
# compiler installs its Python paths, which give the same results at more CPU.
EXPORTERS_NO_C = Setting[bool](
    "exporters_no_c",
    "STEPWATCH_EXPORTERS_NO_C",
    False,
    _switch,
    "1: the exporters use their Python paths even where the C extensions are built (read once, "
    "when stepwatch.exporters is first imported)",
)
BACKWARD_MARK = Setting[str](
    "backward_mark",
    "STEPWATCH_BACKWARD_MARK",
    "engine",
    _backward_mark,
    "engine (auto mode marks a backward's start at the autograd engine's gate) or tensor-hook "
    "(a hook on the forward's output, when its gradient arrives)",
)
REQUIRE_C = Setting[bool](
    "require_c",
    "STEPWATCH_REQUIRE_C",
    False,
    _switch,
    "1: StepMonitor and the bridge refuse to start where their C extension is not built "
    "(CI, images that must have the fast paths)",
)


def all_settings() -> tuple[Setting[object], ...]:
    """Every setting of this module, in definition order (docs/settings.md lists them)."""
    return tuple(value for value in globals().values() if isinstance(value, Setting))
