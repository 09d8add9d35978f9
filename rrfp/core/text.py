"""Words for the messages users read."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in agreement: ``counted(1, "microbatch")`` is "1 microbatch",
    ``counted(2, "microbatch")`` "2 microbatches" (``plural`` where adding "s" or "es"
    does not make it)."""
    if n == 1:
        return f"{n} {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")
    return f"{n} {plural}"
