"""Reading a report's fields for the HTML page: a field that is missing or of the wrong type reads
"not measured"; every string is escaped with html.escape. Standard library only."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

NOT_MEASURED = "not measured"

# -- values ----------------------------------------------------------------------------------------


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _num(value: Any) -> float | None:
    """A finite number, else None (missing, null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _nm() -> str:
    return f'<span class="nm">{NOT_MEASURED}</span>'


def _sig(value: float, digits: int = 3) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits + 2) or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _ms(value: Any) -> str:
    v = _num(value)
    return _nm() if v is None else f"{_sig(v)} ms"


def _bytes(value: Any) -> str:
    v = _num(value)
    if v is None:
        return _nm()
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def _plain(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _nm()
    if isinstance(value, float):
        return _sig(value)
    return _e(value)


def _list(values: Any) -> list[Any]:
    return list(values) if isinstance(values, list | tuple) else []


def _dicts(values: Any) -> list[Mapping[str, Any]]:
    return [v for v in _list(values) if isinstance(v, Mapping)]


def _node_names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in _list(value)]


def _nodes_html(nodes: Sequence[str], limit: int = 200) -> str:
    shown = "".join(f"<code>{_e(n)}</code>" for n in nodes[:limit])
    more = f" … and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return f'<span class="nodes">{shown}{more}</span>'


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
