"""The `key=value,...` options of the simulator's command-line specs (workloads, admission
variants, router configs), read one way."""

from __future__ import annotations

from typing import Any


def key_values(text: str, what: str) -> dict[str, str]:
    """`key=value,...` as a mapping (a key's `-` read as `_`); `what` names the spec in errors."""
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} option {item!r}: expected key=value")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")


def convert(key: str, value: str, kind: Any, what: str) -> Any:
    """`value` as the field's type: bool, int, float (`none` too where the field may be None),
    else the string."""
    text = str(kind)
    if value.lower() == "none" and "None" in text:
        return None
    if kind is bool:
        if value.lower() not in TRUE + FALSE:
            raise ValueError(f"{what} option {key}={value!r}: expected true or false")
        return value.lower() in TRUE
    try:
        if kind is int or text.startswith("int"):
            return int(value)
        if kind is float or text.startswith("float"):
            return float(value)
    except ValueError:
        raise ValueError(f"{what} option {key}={value!r}: expected a number") from None
    return value
