"""InfluxDB line protocol encoding.

Spec: https://docs.influxdata.com/influxdb/v1/write_protocols/line_protocol_reference/
Measurement: escape comma and space. Tag keys, tag values and field keys: escape comma, equals
sign and space; a backslash there is literal (InfluxDB 1.x does not unescape a doubled one)
and one at the very end cannot be carried at all. String field values: double-quoted, with
``"`` and ``\\`` escaped. Integers carry an ``i`` suffix; NaN and infinities are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from stepwatch.core._errors import ConfigError

FieldValue = float | int | str | bool

_MEASUREMENT_ESCAPES = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n"})
_KEY_ESCAPES = str.maketrans({",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\n"})


def _representable(text: str, what: str) -> str:
    # InfluxDB 1.x cannot parse a measurement, tag or field key/value that ends in a
    # backslash, however it is escaped: refuse it here with a clear error.
    if text.endswith("\\"):
        raise ConfigError(f"{what} {text!r} ends in a backslash, which line protocol cannot carry")
    return text


def escape_measurement(name: str) -> str:
    _representable(name, "measurement")
    return name.translate(_MEASUREMENT_ESCAPES)


def escape_key(key: str) -> str:
    """Escape a tag key, tag value or field key."""
    _representable(key, "key or tag value")
    return key.translate(_KEY_ESCAPES)


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
