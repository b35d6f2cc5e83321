"""Adapter versions: the files, which one is promoted, which examples each saw, and what is stale.

A version is promoted in two steps, each atomic: its adapter is written completely (atomic writes) and
renamed into `versions/vNNNNNN/`, then one SQLite transaction records it, the examples its line of training
saw (`trained_on`: its parent's and its own window's, by example id: content, so an example dropped and
added again is still the same one) and makes it the
promoted one. A crash between the two leaves a directory no row names, removed at the next run; a crash
at any other moment leaves the previous promoted version, complete. The newest `keep` versions are kept
(and always the promoted one); older ones are deleted.

forget() marks stale every version whose `trained_on` holds a forgotten example; rollback() moves the
promotion back to the newest earlier version that is neither stale nor rolled back (or to the base model).
Both bump the store's `generation`, which tells a run that its training window no longer applies.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from edgetrain.files.atomic import fsync_directory, make_directory
from edgetrain.personalise.errors import NothingToRollBackError, PersonaliseError, StoreError
from edgetrain.personalise.store import Store

VERSIONS = "versions"


@dataclass(frozen=True)
class Version:
    version: int
    parent: int | None
    created: float
    path: str          # relative to the store directory
    metric: str
    value: float       # the held-out metric when it was promoted
    reference: float | None  # what it beat (its start's metric on the same held-out examples)
    held_out: int
    trained: int       # training examples in its window
    steps: int
    stale: bool
    state: str         # kept | rolled_back | damaged
    retain: float | None = None       # its retain-set score when promoted (None: no forgetting guard)
    retain_base: float | None = None  # the base model's score on the same retain set

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Versions:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.directory = store.directory / VERSIONS

    # -- reading ---------------------------------------------------------------------------------------
    def promoted(self, connection: sqlite3.Connection | None = None) -> int | None:
        return self.store.get_meta("promoted", None, connection)

    def generation(self, connection: sqlite3.Connection | None = None) -> int:
        return int(self.store.get_meta("generation", 0, connection))

    def all(self, connection: sqlite3.Connection | None = None) -> list[Version]:
        if connection is None:
            with self.store.reading() as connection:
                return self.all(connection)
        rows = connection.execute("SELECT v.version, parent, created, path, metric, v.value, reference, held_out, "
                                  "trained, steps, stale, state, r.value, r.base FROM versions v LEFT JOIN "
                                  "version_retain r ON r.version = v.version ORDER BY v.version")
        return [Version(*row[:10], bool(row[10]), *row[11:]) for row in rows]

    def get(self, version: int, connection: sqlite3.Connection | None = None) -> Version | None:
        return next((v for v in self.all(connection) if v.version == version), None)

    def path(self, version: Version) -> Path:
        return self.store.directory / version.path

    def served(self, serve_stale: bool, connection: sqlite3.Connection | None = None) -> Version | None:
        """The version the app should use: the promoted one, unless it is stale and stale ones are not
        served; None = the base model."""
        promoted = self.promoted(connection)
        version = None if promoted is None else self.get(promoted, connection)
        if version is None or (version.stale and not serve_stale):
            return None
        return version

    def start(self, connection: sqlite3.Connection | None = None) -> Version | None:
        """Where the next training window starts: the promoted version, or the base when there is none or it
        is stale (a stale version is rebuilt from the base without what was forgotten)."""
        version = self.served(False, connection)
        return version

    # -- promotion -------------------------------------------------------------------------------------
    def _next_number(self, connection: sqlite3.Connection) -> int:
        highest = connection.execute("SELECT COALESCE(MAX(version), 0) FROM versions").fetchone()[0]
        on_disk = [int(p.name[1:]) for p in self.directory.glob("v*") if p.name[1:].isdigit()] \
            if self.directory.is_dir() else []
        recorded = int(self.store.get_meta("last_version", 0, connection))
        return max([highest, recorded, *on_disk]) + 1

    def promote(self, candidate: Path, *, parent: int | None, generation: int, metric: str, value: float,
                reference: float | None, held_out: int, trained: Sequence[str], steps: int, keep: int,
                retain: tuple[float, float] | None = None) -> int | None:
        """Move the complete adapter at `candidate` into a new version and promote it, in one transaction
        that also checks nothing invalidated the window meanwhile (the store's generation is still
        `generation`); the version's number, or None when the window no longer applies (the candidate is
        deleted). `retain`: its retain-set score and the base model's, kept with it."""
        with self.store.reading() as connection:
            number = self._next_number(connection)
        target_directory = self.directory / f"v{number:06d}"
        target = target_directory / candidate.name
        make_directory(target_directory, "the version directory")
        os.replace(candidate, target)
        fsync_directory(target_directory)
        fsync_directory(self.directory)
        try:
            promoted_number, pruned = self._record(number, target, parent=parent, generation=generation,
                                                   metric=metric, value=value, reference=reference,
                                                   held_out=held_out, trained=trained, steps=steps, keep=keep,
                                                   retain=retain)
        except StoreError:
            # SQLite rolled the transaction back (the disk is full, say), so no row names the directory: its
            # space goes back now, not at the next run's clean-up. The promoted version is the one before.
            _remove(target_directory)
            raise
        if promoted_number is None:
            _remove(target_directory)
        for path in pruned:
            _remove(path)
        return promoted_number

    def _record(self, number: int, target: Path, *, parent: int | None, generation: int, metric: str, value: float,
                reference: float | None, held_out: int, trained: Sequence[str], steps: int, keep: int,
                retain: tuple[float, float] | None) -> tuple[int | None, list[Path]]:
        """promote()'s transaction: the version's rows, made the promoted one; (its number, or None when the
        window no longer applies; the directories of the versions it pruned)."""
        pruned: list[Path] = []
        with self.store.transaction() as connection:
            if self.generation(connection) != generation:
                promoted_number = None
            else:
                connection.execute(
                    "INSERT INTO versions (version, parent, created, path, metric, value, reference, held_out, "
                    "trained, steps) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (number, parent, time.time(), str(target.relative_to(self.store.directory)), metric, value,
                     reference, held_out, len(trained), steps))
                if retain is not None:
                    connection.execute("INSERT OR REPLACE INTO version_retain (version, value, base) VALUES (?, ?, ?)",
                                       (number, *retain))
                if parent is not None:
                    connection.execute("INSERT OR IGNORE INTO trained_on (version, example) SELECT ?, example "
                                       "FROM trained_on WHERE version = ?", (number, parent))
                connection.executemany("INSERT OR IGNORE INTO trained_on (version, example) VALUES (?, ?)",
                                       [(number, example) for example in trained])
                self.store.set_meta("promoted", number, connection)
                self.store.set_meta("last_version", number, connection)
                pruned = self._prune(connection, keep, number)
                promoted_number = number
        return promoted_number, pruned

    def _prune(self, connection: sqlite3.Connection, keep: int, promoted: int) -> list[Path]:
        rows = connection.execute("SELECT version, path FROM versions ORDER BY version DESC").fetchall()
        doomed = [(version, path) for version, path in rows[keep:] if version != promoted]
        for version, _ in doomed:
            connection.execute("DELETE FROM versions WHERE version = ?", (version,))
            connection.execute("DELETE FROM trained_on WHERE version = ?", (version,))
            connection.execute("DELETE FROM version_retain WHERE version = ?", (version,))
        return [(self.store.directory / path).parent for _, path in doomed]

    def remove_orphans(self) -> list[Path]:
        """Delete version directories no row names (a crash between writing one and recording it)."""
        if not self.directory.is_dir():
            return []
        known = {(self.store.directory / v.path).parent.name for v in self.all()}
        orphans = [p for p in self.directory.iterdir() if p.name not in known]
        for path in orphans:
            _remove(path)
        return orphans

    # -- forgetting and rolling back -------------------------------------------------------------------
    def mark_stale(self, examples: Sequence[str], connection: sqlite3.Connection) -> list[int]:
        """Mark stale every version that trained on one of these examples (ids); the versions newly marked."""
        stale: set[int] = set()
        for example in examples:
            stale.update(row[0] for row in connection.execute(
                "SELECT version FROM trained_on WHERE example = ?", (example,)))
        newly = [v for v in sorted(stale)
                 if connection.execute("SELECT stale FROM versions WHERE version = ?", (v,)).fetchone() == (0,)]
        connection.executemany("UPDATE versions SET stale = 1 WHERE version = ?", [(v,) for v in newly])
        return newly

    def bump_generation(self, connection: sqlite3.Connection) -> int:
        generation = self.generation(connection) + 1
        self.store.set_meta("generation", generation, connection)
        return generation

    def rollback(self) -> tuple[int, int | None]:
        """(the version rolled back, the one now promoted or None for the base)."""
        with self.store.transaction() as connection:
            current = self.promoted(connection)
            if current is None:
                raise NothingToRollBackError("nothing to roll back: no version is promoted (the base model is served)")
            earlier = connection.execute(
                "SELECT version FROM versions WHERE version < ? AND stale = 0 AND state = 'kept' "
                "ORDER BY version DESC LIMIT 1", (current,)).fetchone()
            target = None if earlier is None else int(earlier[0])
            connection.execute("UPDATE versions SET state = 'rolled_back' WHERE version = ?", (current,))
            self.store.set_meta("promoted", target, connection)
            self.bump_generation(connection)
        return current, target

    def mark_damaged(self, version: int) -> int | None:
        """A version that fails its checksum: never served again; the promotion falls back as in rollback.
        The version promoted afterwards (None: the base)."""
        with self.store.transaction() as connection:
            connection.execute("UPDATE versions SET state = 'damaged' WHERE version = ?", (version,))
            if self.promoted(connection) != version:
                return self.promoted(connection)
            earlier = connection.execute(
                "SELECT version FROM versions WHERE version < ? AND stale = 0 AND state = 'kept' "
                "ORDER BY version DESC LIMIT 1", (version,)).fetchone()
            target = None if earlier is None else int(earlier[0])
            self.store.set_meta("promoted", target, connection)
            self.bump_generation(connection)
        return target

    # -- files -------------------------------------------------------------------------------------------
    def verify(self, version: Version) -> None:
        """CorruptCheckpointError unless every safetensors file of the version passes its checksum."""
        from edgetrain.training.checkpoint import CorruptCheckpointError, load_safetensors_checked, readable_directory

        path = self.path(version)
        files = [path] if path.is_file() else sorted(readable_directory(path).glob("*.safetensors"))
        if not files:
            raise CorruptCheckpointError(f"version {version.version}: {path} is missing")
        for file in files:
            load_safetensors_checked(file)

    def export(self, version: Version, target_format: str, *, base_model: str | None, base_config: Any) -> Path:
        """The version's adapter in `target_format` (edgetrain, peft, mlx-lm, gguf), converted once and kept
        beside it."""
        from edgetrain.adapters.convert import convert_adapter, detect_format

        source = self.path(version)
        if detect_format(source) == target_format:
            return source
        suffix = {"edgetrain": ".safetensors", "gguf": ".gguf"}.get(target_format, "")
        target = source.parent / "export" / f"{target_format}{suffix}"
        if not target.exists():
            make_directory(target.parent, "the version's export directory")
            convert_adapter(source, target, target_format, base_model=base_model, base_config=base_config)
        return target


def check_keep(keep: int) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise PersonaliseError(f"keep_versions must be a whole number >= 1, got {keep!r}")
    return keep
