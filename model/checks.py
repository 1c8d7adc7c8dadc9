"""The one-line checks every config in ``model/`` shares (an integer count, naming its key)."""

from __future__ import annotations


def is_int(value, low: int | None = None) -> bool:
    """Whether ``value`` is an int (a bool is not) and, with ``low``, at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def check_int(name: str, value, low: int = 1, optional: bool = False) -> None:
    """Raise the one-line error for a count that is not an integer >= ``low`` (None allowed
    when ``optional``): ``train.steps (0) must be an integer >= 1``."""
    if (value is None and optional) or is_int(value, low):
        return
    raise ValueError(f"{name} ({value!r}) must be an integer >= {low}" + (" or null" if optional else ""))
