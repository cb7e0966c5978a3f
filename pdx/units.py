"""Unit conversions, in one place. GB = 1e9 bytes, Gbps = 1e9 bits/s, GiB = 2**30 bytes."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * 1024
GIB = 1024 * 1024 * 1024


def bytes_per_s_to_gbps(bytes_per_s: float) -> float:
    """Bytes per second to gigabits per second (decimal)."""
    return bytes_per_s * 8 / 1e9


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gigabits per second (decimal) to bytes per second."""
    return gbps * 1e9 / 8


def mbps_to_bytes_per_s(mbps: float) -> float:
    """Megabits per second (decimal) to bytes per second."""
    return mbps * 1e6 / 8


def bytes_per_s_to_mbps(bytes_per_s: float) -> float:
    """Bytes per second to megabits per second (decimal)."""
    return bytes_per_s * 8 / 1e6


def s_to_ms(seconds: float) -> float:
    return seconds * 1e3


def ms_to_s(ms: float) -> float:
    return ms / 1e3


def human_bytes(n: float) -> str:
    """Binary-prefixed size for tables: ``human_bytes(327680) == '320.0 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
