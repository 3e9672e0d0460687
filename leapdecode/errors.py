"""Exceptions shared across the package."""
from __future__ import annotations


class InvalidParameter(ValueError):
    """A request argument is invalid. ``param`` names the offending field as the raiser knows it (a
    ``SamplingParams`` field such as ``"temperature"``, or ``"prompt"``), so an API layer can report the field
    without parsing the message. Still a ValueError: callers catching ValueError keep working."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
