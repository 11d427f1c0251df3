"""Where the commands find InfluxDB: ``--influx-url``, ``--database``, ``--token``.

Every command that reads or writes InfluxDB takes the same three options, each falling back
to its variable in :mod:`stepwatch.core.settings`, then to the default.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from stepwatch.core import settings
from stepwatch.core._influx import InfluxClient

_SETTINGS = (settings.INFLUX_URL, settings.INFLUX_DATABASE, settings.INFLUX_TOKEN)


def add_influx_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--influx-url``, ``--database`` and ``--token`` (default: unset)."""
    for setting in _SETTINGS:
        default = "" if setting.default is None else f", default {setting.default}"
        parser.add_argument(
            "--" + setting.name.replace("_", "-"),
            dest=setting.name,
            default=None,
            help=f"{setting.help} (env {' or '.join(setting.variables)}{default})",
        )


def influx_client(args: argparse.Namespace, environ: Mapping[str, str]) -> InfluxClient:
    """The client the options name: argument > environment variable > default."""
    url = settings.INFLUX_URL.resolve(args.influx_url, environ)
    database = settings.INFLUX_DATABASE.resolve(args.database, environ)
    return InfluxClient(
        str(url),
        database=str(database),
        token=settings.INFLUX_TOKEN.resolve(args.token, environ),
    )
