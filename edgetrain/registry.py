"""Name-keyed registries: one dict per kind of plug-in, duplicates refused, unknown names listed."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class EdgetrainError(Exception):
    """Base class of every error edgetrain raises on purpose (bad input, bad config, bad files)."""


class UnknownNameError(EdgetrainError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    """A dict of named entries with a decorator that refuses duplicates.

    `kind` appears in error messages ("unknown method 'foo'; known methods: bp, mebp").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorator

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise EdgetrainError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
