"""Quantities with units, as cluster files write them (pure logic).

Bandwidths: ``"100Gb/s"`` (bits, also ``Gbps``, ``Gbit/s``), ``"12.5GB/s"``
(bytes), or a plain number of bytes per second. Times: ``"10us"``,
``"1.5ms"``, ``"2s"``, or a plain number of seconds. Sizes: ``"80GiB"``,
``"16GB"``, or a plain number of bytes. Decimal prefixes are powers of 1000,
binary ones (``Ki``, ``Mi``, ``Gi``, ``Ti``) of 1024.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bandwidth", "parse_seconds", "parse_size"]

_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_BANDWIDTH = re.compile(_NUMBER + r"(|k|K|M|G|T|Ki|Mi|Gi|Ti)(b|B|bit|bps)(/s|ps)?\s*$")
_SIZE = re.compile(_NUMBER + r"(|k|K|M|G|T|Ki|Mi|Gi|Ti)B?\s*$")
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_SECONDS = re.compile(_NUMBER + r"(s|ms|us|µs|ns)\s*$")


def _number(value: object, what: str) -> float | None:
    """``value`` as a float if it is a plain number; ``None`` if it is a string."""
    if isinstance(value, bool):
        raise ValueError(
            f"{what} must be a number or a string with a unit, got {value!r}"
        )
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    raise ValueError(f"{what} must be a number or a string with a unit, got {value!r}")


def _positive(value: float, what: str, raw: object, *, zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        need = "at least 0" if zero else "positive"
        raise ValueError(f"{what} must be finite and {need}, got {raw!r}")
    return value


def parse_bandwidth(value: object, what: str = "bandwidth") -> float:
    """Bytes per second from ``value`` (see the module).

    Raises:
        ValueError: Not a bandwidth, or not positive; naming ``what``.
    """
    plain = _number(value, what)
    if plain is not None:
        return _positive(plain, what, value)
    match = _BANDWIDTH.match(str(value))
    if not match or (match.group(3) == "bps" and match.group(4)):
        raise ValueError(
            f"{what}: cannot read {value!r}; write e.g. '100Gb/s' (bits), "
            "'12.5GB/s' (bytes) or a number of bytes per second"
        )
    number, prefix, unit = float(match.group(1)), match.group(2), match.group(3)
    scale = _PREFIX[prefix] / (1.0 if unit == "B" else 8.0)
    return _positive(number * scale, what, value)


def parse_seconds(value: object, what: str = "latency") -> float:
    """Seconds from ``value`` (``"10us"``, ``"1ms"``, or a number); 0 is allowed.

    Raises:
        ValueError: Not a time, or negative; naming ``what``.
    """
    plain = _number(value, what)
    if plain is not None:
        return _positive(plain, what, value, zero=True)
    match = _SECONDS.match(str(value))
    if not match:
        raise ValueError(
            f"{what}: cannot read {value!r}; write e.g. '10us', '1.5ms' or a "
            "number of seconds"
        )
    return _positive(
        float(match.group(1)) / _PER_SECOND[match.group(2)], what, value, zero=True
    )


def parse_size(value: object, what: str = "memory") -> float:
    """Bytes from ``value`` (``"80GiB"``, ``"16GB"``, or a number).

    Raises:
        ValueError: Not a size, or not positive; naming ``what``.
    """
    plain = _number(value, what)
    if plain is not None:
        return _positive(plain, what, value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{what}: cannot read {value!r}; write e.g. '80GiB', '16GB'")
    return _positive(float(match.group(1)) * _PREFIX[match.group(2)], what, value)
