"""InfluxDB line protocol encoding.

Spec: https://docs.influxdata.com/influxdb/v1/write_protocols/line_protocol_reference/
(measurement: escape comma and space; tag keys/values and field keys: escape comma, equals
sign and space; string field values: double-quoted with ``"`` and ``\\`` escaped; integers
carry an ``i`` suffix; NaN and infinities cannot be represented and are rejected.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from stepwatch._errors import ConfigError

FieldValue = float | int | str | bool

_MEASUREMENT_ESCAPES = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n"})
_KEY_ESCAPES = str.maketrans({",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\n"})


def escape_measurement(name: str) -> str:
    return name.replace("\\", "\\\\").translate(_MEASUREMENT_ESCAPES)


def escape_key(key: str) -> str:
    """Escape a tag key, tag value or field key."""
    return key.replace("\\", "\\\\").translate(_KEY_ESCAPES)


def format_field_value(value: FieldValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}i"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"field value {value!r} is not finite")
        return repr(value)
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def encode_point(
    measurement: str,
    tags: Mapping[str, str],
    fields: Mapping[str, FieldValue],
    time_unix_nano: int,
) -> str:
    """One line of line protocol. Empty tag values are omitted (InfluxDB rejects them)."""
    if not fields:
        raise ConfigError(f"{measurement}: a point needs at least one field")
    parts = [escape_measurement(measurement)]
    for key in sorted(tags):  # sorted tags are what InfluxDB stores; cheaper to index
        value = tags[key]
        if value != "":
            parts.append(f",{escape_key(key)}={escape_key(value)}")
    field_text = ",".join(
        f"{escape_key(key)}={format_field_value(value)}" for key, value in fields.items()
    )
    return f"{''.join(parts)} {field_text} {int(time_unix_nano)}"
