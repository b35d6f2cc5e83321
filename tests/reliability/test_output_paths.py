"""Output paths that cannot be written get a named error (OutputPathError, an EdgetrainError and an
OSError) that says which part of the path is wrong, from every writer edgetrain has and from the CLI's
commands; nothing already on disk changes. (An adversary met `export-adapter -o DIR/x` with DIR a file
ending in a FileExistsError traceback.)"""
from __future__ import annotations

import json

import pytest
import torch

import edgetrain
from edgetrain.files.atomic import (OutputPathError, atomic_torch_save, atomic_write_bytes, atomic_write_directory,
                                    atomic_write_json, ensure_writable_directory, ensure_writable_target)
from edgetrain.training.checkpoint import atomic_save_safetensors
from fault_tally import attempt, refused

PATHS = "resources and paths"


def _writers():
    """name -> write(path): each of edgetrain's ways of writing a user's path."""
    def adapter(path):
        model = edgetrain.load_model("tiny")
        edgetrain.add_lora(model, rank=2)
        edgetrain.save_lora(model, path)

    def checkpoint(path):
        model = edgetrain.load_model("tiny")
        edgetrain.add_lora(model, rank=2)
        edgetrain.Learner(model, method="bp", probe=False).save(path)

    return {
        "bytes": lambda path: atomic_write_bytes(b"x", path),
        "json": lambda path: atomic_write_json({"a": 1}, path),
        "torch": lambda path: atomic_torch_save({"a": torch.zeros(2)}, path),
        "safetensors": lambda path: atomic_save_safetensors({"a": torch.zeros(2)}, path, {}),
        "directory": lambda path: atomic_write_directory(path, lambda tmp: (tmp / "f").write_text("x")),
        "adapter": adapter,
        "learner checkpoint": checkpoint,
    }


WRITERS = _writers()


def _hostile(tmp_path):
    """(path, the part of it the error must name) for paths no writer can write."""
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's file")
    return [
        (blocker / "out.bin", str(blocker)),                    # the parent is a file
        (blocker / "sub" / "deeper" / "out.bin", str(blocker)),  # an ancestor further up is a file
        (tmp_path / ("x" * 300), "File name too long"),          # a name the file system refuses
        (tmp_path / "a\0b", "null byte"),                        # no file system takes a NUL byte
        (tmp_path / "link" / "out.bin", str(tmp_path / "link")),  # a symlink to a file where a directory must be
    ]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_names_the_part_of_the_path_that_is_wrong(tmp_path, writer):
    cases = _hostile(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "a-file")
    for path, named in cases:
        error = refused(PATHS, lambda: WRITERS[writer](path), match=named)
        assert isinstance(error, OutputPathError) and isinstance(error, OSError)
        assert str(path).replace("\0", "\\x00") in str(error) or repr(str(path)) in str(error)
    assert (tmp_path / "a-file").read_text() == "the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "link"]  # no temp, no directory left


@pytest.mark.parametrize("writer", ["bytes", "json", "torch", "safetensors", "adapter", "learner checkpoint"])
def test_a_file_writer_refuses_an_existing_directory_and_keeps_it(tmp_path, writer):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep").write_text("mine")
    refused(PATHS, lambda: WRITERS[writer](target), match="is a directory")
    assert (target / "keep").read_text() == "mine"


def test_a_directory_writer_refuses_an_existing_file_and_keeps_it(tmp_path):
    target = tmp_path / "out"
    target.write_text("mine")
    refused(PATHS, lambda: WRITERS["directory"](target), match="is not a directory")
    assert target.read_text() == "mine"


@pytest.mark.parametrize("check", [
    lambda path: ensure_writable_directory(path, "--checkpoint-dir"),
    lambda path: ensure_writable_target(path / "x.safetensors", "--save-adapter")])
def test_the_up_front_checks_name_the_file_in_the_way(tmp_path, check):
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's file")
    error = refused(PATHS, lambda: check(blocker / "sub"), match=f"{blocker} is a file")
    assert isinstance(error, OutputPathError)


def _adapter(tmp_path):
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=2)
    return edgetrain.save_lora(model, tmp_path / "adapter.safetensors") or tmp_path / "adapter.safetensors"


@pytest.mark.parametrize("argv", [
    ["export-adapter", "--adapter", "{adapter}", "--format", "peft", "-o", "{blocker}/x"],
    ["export-adapter", "--adapter", "{adapter}", "--format", "mlx-lm", "-o", "{blocker}/x"],
    ["export-adapter", "--model", "tiny", "--adapter", "{adapter}", "--format", "gguf", "-o", "{blocker}/x.gguf"],
    ["train", "--model", "tiny", "--steps", "1", "--quiet", "--save-adapter", "{blocker}/deeper/a.safetensors"],
    ["train", "--model", "tiny", "--steps", "1", "--quiet", "--checkpoint-dir", "{blocker}/ckpt"],
    ["profile", "--model", "tiny", "--methods", "bp", "--steps", "1", "--json", "{blocker}/p.json"],
])
def test_the_cli_names_the_part_of_an_output_path_that_is_wrong(tmp_path, capsys, argv):
    from edgetrain.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("the user's file")
    adapter = _adapter(tmp_path)
    argv = [a.format(adapter=adapter, blocker=blocker) for a in argv]
    code = attempt(PATHS, lambda: main(argv), sound=lambda code: code == 2)
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(blocker) in err and "Traceback" not in err, err
    assert blocker.read_text() == "the user's file"
