"""The user's examples in SQLite (the standard library's sqlite3): durable, shared, and never destroyed.

One database file, `examples.sqlite` in the store directory, in WAL mode with `synchronous=FULL`: `add`
returns after its transaction is committed and on disk, so a process killed at any moment afterwards loses
nothing it was told was added. Other threads and processes may add while a run trains: every transaction
is short (one add, one version record), readers never block the writer (WAL), and a writer waits for
another at most `busy_timeout` seconds.

Tables: `schema` (the version of this layout: a store written by a newer edgetrain is refused untouched),
`meta` (JSON values by key: the model the store was made for, retention caps, the run's state), `examples`
(id = content hash, kind, canonical JSON, size), `versions`, `trained_on` and `version_retain`
(edgetrain.personalise.versions), `retain_examples` (what the app marked as general: the forgetting guard's,
never trained on but by replay; edgetrain.personalise.retain).

Deleted examples are overwritten in the file (`secure_delete`), and forget() checkpoints the WAL, so what
the user asked to forget does not linger in free pages.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from edgetrain.files.space import free_bytes, is_disk_full
from edgetrain.personalise.errors import DamagedStoreError, StoreBusyError, StoreError, StoreFullError, StoreVersionError
from edgetrain.personalise.events import EventLog
from edgetrain.personalise.examples import Example, ModelKind, parse_example

SCHEMA_VERSION = 1
DATABASE = "examples.sqlite"
EVENTS = "events.jsonl"
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS examples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    added REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    parent INTEGER,
    created REAL NOT NULL,
    path TEXT NOT NULL,
    metric TEXT NOT NULL,
    value REAL NOT NULL,
    reference REAL,
    held_out INTEGER NOT NULL,
    trained INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    stale INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'kept'
);
CREATE TABLE IF NOT EXISTS trained_on (
    version INTEGER NOT NULL,
    example TEXT NOT NULL,
    PRIMARY KEY (version, example)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS trained_on_example ON trained_on (example);
CREATE TABLE IF NOT EXISTS retain_examples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS version_retain (
    version INTEGER PRIMARY KEY,
    value REAL NOT NULL,
    base REAL NOT NULL
);
"""


# SQLite's primary result codes for a full disk, and for an I/O error (which is what a failed write of its
# journal reports when the disk fills: told apart from a failing disk by the free space left).
_SQLITE_FULL, _SQLITE_IOERR = 13, 10
_NEARLY_FULL_BYTES = 1 << 20


def _disk_full(exc: sqlite3.Error, path: Path) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return "disk is full" in str(exc)
    if code & 0xFF == _SQLITE_FULL:
        return True
    free = free_bytes(path.parent)
    return code & 0xFF == _SQLITE_IOERR and free is not None and free < _NEARLY_FULL_BYTES


def store_full_error(path: Path, needed: int | None = None, said: str | None = None) -> StoreFullError:
    """The store at `path` has no room: what it needed (when known) and what is free, and what SQLite said."""
    free = free_bytes(path.parent)
    sizes = ", ".join(part for part in (f"it needs {needed:,} bytes" if needed is not None else "",
                                        f"{free:,} bytes free in {path.parent}" if free is not None else "") if part)
    return StoreFullError(f"{path}: no space left on the device for the store" + (f" ({sizes})" if sizes else "")
                          + "; nothing was written and the examples and versions already stored are as they were "
                          "(free some space and run it again" + (f"; SQLite said: {said})" if said else ")"))


def _translate(exc: sqlite3.Error, path: Path) -> StoreError:
    message = str(exc)
    if _disk_full(exc, path):
        return store_full_error(path, said=message)
    if isinstance(exc, sqlite3.OperationalError):
        if "locked" in message or "busy" in message:
            return StoreBusyError(f"{path}: another writer held the store for more than {BUSY_TIMEOUT_S:g} s ({message})")
        return StoreError(f"{path}: {message}")
    if isinstance(exc, sqlite3.DatabaseError):
        return DamagedStoreError(f"{path} is damaged ({message}); it was left as it is: move it aside to start "
                                 "a new store, or recover it with the sqlite3 shell's .recover")
    return StoreError(f"{path}: {message}")


class Store:
    """The examples of one store directory (created if absent). Safe to use from several threads (each gets
    its own connection) and several processes at once."""

    def __init__(self, directory: str | Path, *, events: EventLog | None = None) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise StoreError(f"store {self.directory} exists and is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if is_disk_full(exc):
                free = free_bytes(self.directory)
                raise StoreFullError(f"cannot create the store {self.directory}: no space left on the device"
                                     + (f" ({free:,} bytes free)" if free is not None else "")
                                     + "; free some space and run it again") from None
            raise StoreError(f"cannot create the store {self.directory} ({exc.strerror or exc})") from None
        self.path = self.directory / DATABASE
        self.events = events if events is not None else EventLog(self.directory / EVENTS)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._check_schema()

    # -- connections -------------------------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is not None and self._local.pid == os.getpid():
            return connection
        try:
            connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                         check_same_thread=False)
            connection.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            connection.execute("PRAGMA synchronous = FULL")  # a commit is on disk before add returns
            connection.execute("PRAGMA secure_delete = ON")  # forgotten examples are overwritten
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from None
        self._local.connection, self._local.pid = connection, os.getpid()
        with self._lock:
            self._connections.append(connection)
        return connection

    def close(self) -> None:
        """Close every connection this object opened (in any thread)."""
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            try:
                connection.close()
            except sqlite3.Error:
                pass
        self._local = threading.local()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE: the writer lock is taken up front), committed on success."""
        connection = self._connection()
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from None
        try:
            yield connection
            connection.execute("COMMIT")
        except BaseException as exc:
            try:
                connection.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise _translate(exc, self.path) from None
            raise

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: one consistent snapshot for every query inside it."""
        connection = self._connection()
        try:
            connection.execute("BEGIN")
            try:
                yield connection
            finally:
                connection.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from None

    def _check_schema(self) -> None:
        """Create the tables in a new store; refuse, untouched, a store of a newer schema or a damaged file."""
        connection = self._connection()
        try:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "schema" in tables:
                row = connection.execute("SELECT version FROM schema").fetchone()
                version = row[0] if row else None
                if not isinstance(version, int):
                    raise DamagedStoreError(f"{self.path} has no schema version; it was left as it is")
                if version > SCHEMA_VERSION:
                    raise StoreVersionError(f"{self.path} was written by a newer edgetrain (store schema {version}; "
                                            f"this edgetrain reads schema {SCHEMA_VERSION}): upgrade edgetrain. "
                                            "The store was left as it is")
                if version == SCHEMA_VERSION and {"meta", "examples", "versions", "trained_on"} <= tables:
                    return
            elif tables:
                raise DamagedStoreError(f"{self.path} is an SQLite database but not an edgetrain store "
                                        f"(tables: {', '.join(sorted(tables))}); it was left as it is")
            if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.execute("CREATE TABLE IF NOT EXISTS schema (version INTEGER NOT NULL)")
                if connection.execute("SELECT COUNT(*) FROM schema").fetchone()[0] == 0:
                    connection.execute("INSERT INTO schema (version) VALUES (?)", (SCHEMA_VERSION,))
                for statement in _SCHEMA.split(";"):  # not executescript: it would commit first
                    if statement.strip():
                        connection.execute(statement)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self.close()
            raise _translate(exc, self.path) from None
        except StoreError:
            self.close()
            raise

    def data_version(self) -> int:
        """Changes when another connection commits (PRAGMA data_version): a cheap "did anything change"."""
        try:
            return int(self._connection().execute("PRAGMA data_version").fetchone()[0])
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from None

    def integrity_problems(self) -> list[str]:
        """What SQLite's quick_check finds wrong with the file ([] when it is sound)."""
        with self.reading() as connection:
            rows = [row[0] for row in connection.execute("PRAGMA quick_check")]
        return [] if rows == ["ok"] else rows

    # -- meta ----------------------------------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None, connection: sqlite3.Connection | None = None) -> Any:
        if connection is None:
            with self.reading() as connection:
                return self.get_meta(key, default, connection)
        row = connection.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return default
        try:
            return json.loads(row[0])
        except json.JSONDecodeError:
            raise DamagedStoreError(f"{self.path}: meta {key!r} is not JSON; the store was left as it is") from None

    def set_meta(self, key: str, value: Any, connection: sqlite3.Connection | None = None) -> None:
        if connection is None:
            with self.transaction() as connection:
                return self.set_meta(key, value, connection)
        if value is None:
            connection.execute("DELETE FROM meta WHERE key = ?", (key,))
        else:
            connection.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                               "value = excluded.value", (key, json.dumps(value)))

    def model_kind(self, connection: sqlite3.Connection | None = None) -> ModelKind | None:
        """What the store's model learns from; None while no model is bound."""
        bound = self.get_meta("model", None, connection)
        return None if bound is None else ModelKind.from_dict(bound["kind"])

    # -- examples ------------------------------------------------------------------------------------------
    def add(self, example: Any) -> str:
        """Add one example (committed to disk when this returns); its id. Adding an example already in the
        store changes nothing and returns its id."""
        return self.add_many([example])[0]

    def add_many(self, examples: Iterable[Any]) -> list[str]:
        """Add examples in one transaction (all or none: a bad one is an error before anything is written);
        their ids, in order, the existing id for each one already in the store."""
        parsed = [parse_example(example) for example in examples]
        if not parsed:
            return []
        self._check_room(parsed)
        import time

        dropped: list[tuple[str, int]] = []
        with self.transaction() as connection:
            kind = self.model_kind(connection)
            if kind is not None:
                for example in parsed:
                    kind.check(example)
            now = time.time()
            connection.executemany(
                "INSERT INTO examples (id, kind, body, bytes, added) VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING",
                [(e.id, e.kind, e.body, len(e.body.encode("utf-8")), now) for e in parsed])
            dropped = self._apply_retention(connection)
        if dropped:
            self.events.emit("examples_dropped", ids=[i for i, _ in dropped], count=len(dropped),
                             bytes=sum(b for _, b in dropped), reason="retention cap")
        return [example.id for example in parsed]

    def _check_room(self, examples: Sequence[Example]) -> None:
        """Refuse examples whose text alone is more than the disk has free, before SQLite writes any of it: a
        transaction that fails on a full disk leaves its pages in the WAL until the disk has room again."""
        needed = sum(len(example.body.encode("utf-8")) for example in examples)
        free = free_bytes(self.path.parent)
        if free is not None and needed > free:
            raise store_full_error(self.path, needed)

    def retention(self) -> tuple[int | None, int | None]:
        """(max examples, max bytes) kept; None where there is no cap."""
        caps = self.get_meta("retention", {}) or {}
        return caps.get("max_examples"), caps.get("max_bytes")

    def set_retention(self, max_examples: int | None, max_bytes: int | None) -> list[str]:
        """Set the caps (kept in the store, so adds from any process obey them) and apply them now; the ids
        dropped."""
        for name, value in (("max_examples", max_examples), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise StoreError(f"{name} must be a whole number >= 1 or None, got {value!r}")
        with self.transaction() as connection:
            self.set_meta("retention", {"max_examples": max_examples, "max_bytes": max_bytes}, connection)
            dropped = self._apply_retention(connection)
        if dropped:
            self.events.emit("examples_dropped", ids=[i for i, _ in dropped], count=len(dropped),
                             bytes=sum(b for _, b in dropped), reason="retention cap")
        return [i for i, _ in dropped]

    def _apply_retention(self, connection: sqlite3.Connection) -> list[tuple[str, int]]:
        """Delete the oldest examples until the caps hold; (id, bytes) of each deleted."""
        caps = self.get_meta("retention", {}, connection) or {}
        max_examples, max_bytes = caps.get("max_examples"), caps.get("max_bytes")
        if max_examples is None and max_bytes is None:
            return []
        count, total = connection.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM examples").fetchone()
        dropped: list[tuple[str, int]] = []
        if (max_examples is None or count <= max_examples) and (max_bytes is None or total <= max_bytes):
            return dropped
        for seq, example, size in connection.execute("SELECT seq, id, bytes FROM examples ORDER BY seq"):
            if (max_examples is None or count <= max_examples) and (max_bytes is None or total <= max_bytes):
                break
            dropped.append((example, size))
            count, total = count - 1, total - size
        connection.executemany("DELETE FROM examples WHERE id = ?", [(i,) for i, _ in dropped])
        return dropped

    def add_retain(self, examples: Iterable[Any]) -> list[str]:
        """Add examples the app marks as general (the retain set's, not the user's: never held out, never
        trained on but by replay, not subject to the retention cap or forget) in one transaction; their ids."""
        parsed = [parse_example(example) for example in examples]
        self._check_room(parsed)
        with self.transaction() as connection:
            kind = self.model_kind(connection)
            if kind is not None:
                for example in parsed:
                    kind.check(example)
            connection.executemany("INSERT INTO retain_examples (id, kind, body) VALUES (?, ?, ?) "
                                   "ON CONFLICT(id) DO NOTHING", [(e.id, e.kind, e.body) for e in parsed])
        return [example.id for example in parsed]

    def retain_rows(self, connection: sqlite3.Connection | None = None) -> list[tuple[str, str]]:
        """(id, body) of the app's general examples, oldest first."""
        if connection is None:
            with self.reading() as connection:
                return self.retain_rows(connection)
        return list(connection.execute("SELECT id, body FROM retain_examples ORDER BY seq"))

    def count(self) -> tuple[int, int]:
        """(examples, bytes of their canonical form)."""
        with self.reading() as connection:
            count, total = connection.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM examples").fetchone()
        return int(count), int(total)

    def ids(self) -> list[str]:
        with self.reading() as connection:
            return [row[0] for row in connection.execute("SELECT id FROM examples ORDER BY seq")]

    def get(self, example: str) -> Example | None:
        with self.reading() as connection:
            row = connection.execute("SELECT kind, body FROM examples WHERE id = ?", (example,)).fetchone()
        return None if row is None else Example(row[0], row[1])

    def rows(self, upto: int | None = None, connection: sqlite3.Connection | None = None
             ) -> list[tuple[int, str, str, str]]:
        """(seq, id, kind, body) of the examples with seq <= `upto` (all when None), oldest first."""
        if connection is None:
            with self.reading() as connection:
                return self.rows(upto, connection)
        query = "SELECT seq, id, kind, body FROM examples"
        arguments: tuple = ()
        if upto is not None:
            query, arguments = query + " WHERE seq <= ?", (upto,)
        return list(connection.execute(query + " ORDER BY seq", arguments))

    def high_water(self, connection: sqlite3.Connection | None = None) -> int:
        """The largest seq ever given to an example (0 for none): later examples have larger ones."""
        if connection is None:
            with self.reading() as connection:
                return self.high_water(connection)
        row = connection.execute("SELECT seq FROM sqlite_sequence WHERE name = 'examples'").fetchone()
        return int(row[0]) if row else 0

    def delete(self, ids: Sequence[str], connection: sqlite3.Connection) -> list[tuple[int, str]]:
        """Delete the examples with these ids inside the caller's transaction; (seq, id) of those found."""
        found = []
        for example in dict.fromkeys(ids):
            row = connection.execute("SELECT seq FROM examples WHERE id = ?", (example,)).fetchone()
            if row is not None:
                found.append((int(row[0]), example))
        connection.executemany("DELETE FROM examples WHERE seq = ?", [(seq,) for seq, _ in found])
        return found

    def checkpoint_wal(self) -> None:
        """Copy the WAL into the database and truncate it (best effort: a reader may keep part of it)."""
        try:
            self._connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from None
