"""The sinks a deployment configures from its environment: a registry, resolved by each sink.

Each sink that can be configured without code (Alertmanager, Grafana) declares a
:class:`Configured` entry in its own module: how it reads its settings, and ``None`` when they
are absent. :func:`sinks_from_environment` asks every entry in turn; adding such a sink is
its module and its line in :data:`CONFIGURED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from stepwatch.core._influx import InfluxClient
from stepwatch.detectors.sinks import _alertmanager, _grafana
from stepwatch.detectors.sinks._sinks import Sink


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What a caller gives in place of the environment (``None``: read the variable).

    Attributes:
        alertmanager_url: Alertmanager's base URL.
        grafana_url: Grafana's base URL.
        dashboard_url: the Grafana dashboard alerts link to.
        state_client: where a sink that remembers what it sent (Grafana) keeps it.
    """

    alertmanager_url: str | None = None
    grafana_url: str | None = None
    dashboard_url: str | None = None
    state_client: InfluxClient | None = None


@dataclasses.dataclass(frozen=True)
class Configured:
    """A sink configured by the environment: its name and how it resolves itself."""

    name: str
    resolve: Callable[[Mapping[str, str], Overrides], Sink | None]


#: Every sink configured by the environment, in the order they publish.
CONFIGURED: tuple[Configured, ...] = (
    Configured(
        "alertmanager",
        lambda environ, given: _alertmanager.AlertmanagerSink.from_environment(
            environ, url=given.alertmanager_url, dashboard_url=given.dashboard_url
        ),
    ),
    Configured(
        "grafana",
        lambda environ, given: _grafana.GrafanaAnnotationSink.from_environment(
            environ, url=given.grafana_url, state_client=given.state_client
        ),
    ),
)


def sinks_from_environment(
    environ: Mapping[str, str],
    *,
    state_client: InfluxClient | None = None,
    alertmanager_url: str | None = None,
    grafana_url: str | None = None,
    dashboard_url: str | None = None,
) -> list[Sink]:
    """The sinks of :data:`CONFIGURED` that arguments, else the environment, configure.

    Reads ``settings.ALERTMANAGER_URL``, ``GRAFANA_URL`` + ``GRAFANA_TOKEN``,
    ``GRAFANA_DASHBOARD_UID`` and ``DASHBOARD_URL`` (docs/settings.md); an argument given here
    wins over its variable. None configured: an empty list.

    Args:
        environ: the environment (``os.environ``).
        state_client: where the Grafana sink remembers its annotation ids.
        alertmanager_url: Alertmanager base URL.
        grafana_url: Grafana base URL.
        dashboard_url: the Grafana dashboard alerts link to.

    Raises:
        ConfigError: a Grafana URL without a token, or a malformed URL (names it).
    """
    given = Overrides(alertmanager_url, grafana_url, dashboard_url, state_client)
    return [sink for entry in CONFIGURED if (sink := entry.resolve(environ, given)) is not None]
