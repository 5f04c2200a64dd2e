"""Number formatting for the report: one place, so the page, the PNGs and the tests agree.

Every formatter takes None (a figure that was not measured or not predicted) and returns NA.
"""
from __future__ import annotations

import html
import math

NA = "not measured"
NP = "not predicted"


def _bad(x) -> bool:
    return x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or math.isinf(x)


def num(x, digits: int = 3, none: str = NA) -> str:
    """3 significant digits, no exponent for everyday magnitudes."""
    if _bad(x):
        return none
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - mag)
    return f"{x:,.{decimals}f}"


def ci_text(ci, none: str = "-") -> str:
    """A 95 % interval of a rate as "lo-hi" (whole numbers); `none` when there is none."""
    return none if not ci or _bad(ci[0]) or _bad(ci[1]) else f"{ci[0]:,.0f}-{ci[1]:,.0f}"


def seconds(x, none: str = NA) -> str:
    if _bad(x):
        return none
    if abs(x) < 1:
        return f"{num(x * 1e3)} ms"
    return f"{num(x)} s"


def rate(x, none: str = NA) -> str:
    """tokens/s and similar: whole numbers with thousands separators."""
    return none if _bad(x) else f"{x:,.0f}"


def pct(x, none: str = NA) -> str:
    return none if _bad(x) else f"{x:.1f}%"


def nbytes(n, none: str = NA) -> str:
    """Binary units (KiB = 1024 B), as the rest of brigade prints them."""
    if _bad(n):
        return none
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ratio(measured, predicted) -> float | None:
    if _bad(measured) or _bad(predicted) or predicted == 0:
        return None
    return measured / predicted


def ratio_class(r) -> str:
    """Colour class of a measured/predicted ratio: within 10% good, within 50% fair, else poor."""
    if r is None:
        return "r-none"
    dev = abs(math.log(r)) if r > 0 else math.inf
    if dev <= math.log(1.10):
        return "r-good"
    if dev <= math.log(1.50):
        return "r-fair"
    return "r-poor"


def esc(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)
