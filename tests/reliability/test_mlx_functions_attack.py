"""Fault class "MLX functions": the directory `edgetrain export --method mesp --runtime mlx` writes (five
.mlxfn files of mx.export_function, weights.safetensors, manifest.json) and MLXProgramTrainer, the replay
that loads it with mx.import_function, attacked file by file. Every file flipped, truncated, extended,
emptied, removed, replaced by a directory, a FIFO or a link to a device, or swapped for the same file of
another export (another seq, batch, rank, number of blocks, base, seed); the manifest with hostile JSON,
both as edited (its SHA-256 stale) and forged (its SHA-256 recomputed, so that its schema and the weights'
layout must catch it); bad batches; bad optimizer settings; an export killed part-way over an older one.
Each case ends in a named EdgetrainError, or in a step whose loss and adapters equal the clean program's
bit for bit. MLX's readers crash the process on some damaged files (a segfault, std::bad_alloc), so every
case that hands files to MLX runs in a child process, which must survive all of them."""
from __future__ import annotations

import copy
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora  # noqa: E402
from edgetrain.export.mlx_manifest import FILES, MANIFEST, WEIGHTS, manifest_digest  # noqa: E402
from edgetrain.export.mlx_program import MLXProgramTrainer, export_mlx_mesp  # noqa: E402
from edgetrain.registry import EdgetrainError  # noqa: E402
from fault_tally import attempt, checked, fuzz_settings, record, refused  # noqa: E402

FAULT = "MLX functions"
BATCH, SEQ, VOCAB, LR = 2, 16, 256, 1e-2
REPO = Path(__file__).resolve().parents[2]


def lora_tiny(layers: int = 2, rank: int = 4, seed: int = 0, bits: int | None = None):
    mx.random.seed(seed)
    model = edgetrain.load_model("tiny", backend="mlx", quantize_bits=bits)
    model.blocks = model.blocks[:layers]
    add_lora(model, rank=rank)
    return model


def the_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, (BATCH, SEQ))
    targets = rng.integers(0, VOCAB, (BATCH, SEQ))
    targets[0, :3] = -100
    return inputs, targets


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The program under attack ("program") and exports that differ from it in one thing each."""
    root = tmp_path_factory.mktemp("mlx-exports")
    variants = {"program": dict(), "seq32": dict(seq=32), "batch1": dict(batch=1), "rank8": dict(rank=8),
                "layers1": dict(layers=1), "seed1": dict(seed=1), "q4": dict(bits=4)}
    result = {}
    for name, options in variants.items():
        model = lora_tiny(options.get("layers", 2), options.get("rank", 4), options.get("seed", 0),
                          options.get("bits"))
        result[name] = export_mlx_mesp(model, options.get("batch", BATCH), options.get("seq", SEQ), root / name)
    return result


@pytest.fixture(scope="module")
def reference(exports):
    """The clean program's first step: (loss, adapters)."""
    trainer = MLXProgramTrainer(exports["program"], lr=LR)
    loss = trainer.step(*the_batch())
    return loss, {name: np.array(array) for name, array in trainer.adapters().items()}


def same_as_reference(reference, loss: float, adapters: dict) -> bool:
    ref_loss, ref_adapters = reference
    return (loss == ref_loss and set(adapters) == set(ref_adapters)
            and all(np.array_equal(np.array(adapters[name]), ref_adapters[name]) for name in ref_adapters))


def load_and_step(directory: Path, **settings) -> tuple[float, dict]:
    trainer = MLXProgramTrainer(directory, **{"lr": LR, **settings})
    loss = trainer.step(*the_batch())
    return loss, trainer.adapters()


def fresh_copy(source: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def rewrite_manifest(directory: Path, change, forge: bool) -> None:
    """Apply change(manifest) to directory's manifest; with `forge`, recompute its SHA-256 afterwards (what an
    adversary who read docs/export.md can do), so that the checks behind the SHA-256 are the ones tested."""
    path = directory / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    if forge and isinstance(manifest, dict):
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def forgefile_record(directory: Path, name: str) -> None:
    """Record `name`'s present size and SHA-256 in the manifest, forged: the file's swap then passes the
    checksums, and must be caught by the layout and the functions' own checks."""
    from edgetrain.export.mlx_manifest import file_record

    rewrite_manifest(directory, lambda m: m["files"].__setitem__(name, file_record(directory / name)), forge=True)


# --- Cases in a child process -------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys, hashlib
    import numpy as np
    from edgetrain.export.mlx_program import MLXProgramTrainer
    from edgetrain.registry import EdgetrainError
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 256, (2, 16)); targets = rng.integers(0, 256, (2, 16)); targets[0, :3] = -100
    for case, directory in json.load(open(sys.argv[1])):
        print("start", case, flush=True)
        try:
            trainer = MLXProgramTrainer(directory, lr=1e-2)
            loss = trainer.step(inputs, targets)
            digest = hashlib.sha256()
            for name, array in sorted(trainer.adapters().items()):
                digest.update(name.encode()); digest.update(np.array(array).tobytes())
            report = ["accepted", f"{loss!r} {digest.hexdigest()}"]
        except EdgetrainError as exc:
            report = ["refused", str(exc)]
        except BaseException as exc:
            report = ["unhandled", repr(exc)]
        print(json.dumps([case, *report]), flush=True)
    print("done", flush=True)
""")


def run_in_child(cases: list[tuple[str, Path]], work: Path, seconds: float = 150.0) -> dict[str, tuple[str, str]]:
    """{case: (outcome, message)} for load-and-step of each (case, directory), all in one child process. A
    crash of the child or a case that does not end in time fails the test, naming the case."""
    listing = work / "cases.json"
    listing.write_text(json.dumps([[case, str(directory)] for case, directory in cases]))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(listing)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    results, current, deadline, lines = {}, None, time.monotonic() + seconds, []
    try:
        while True:
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                child.kill()
                record(FAULT, "unhandled")
                pytest.fail(f"case {current!r} did not end within {seconds} s (a hang)")
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("start "):
                current = line.split(" ", 1)[1].strip()
            elif line.startswith("["):
                case, outcome, message = json.loads(line)
                results[case] = (outcome, message)
                current = None
    finally:
        child.wait(timeout=30)
    if current is not None or child.returncode != 0:
        record(FAULT, "unhandled")
        pytest.fail(f"the child process died (exit {child.returncode}) in case {current!r}: "
                    f"{child.stderr.read()[-2000:]}")
    return results


def tally_child_results(results: dict, expected: dict[str, str | None], clean_case: str) -> None:
    """Count each child outcome. expected[case]: a text the refusal must contain, or None where the case may
    also be accepted (a swap for identical bytes): then its loss and adapters must equal the clean run's."""
    clean_outcome, clean_result = results[clean_case]
    assert clean_outcome == "accepted", results[clean_case]
    failures = []
    for case, match in expected.items():
        outcome, message = results[case]
        if outcome == "refused" and (match is None or match in message):
            record(FAULT, "refused")
        elif outcome == "accepted" and match is None and message == clean_result:
            record(FAULT, "accepted")
        else:
            record(FAULT, "unhandled" if outcome == "unhandled" else "silently wrong")
            failures.append(f"{case}: {outcome}: {message} (expected a refusal naming {match!r})")
    assert not failures, "\n".join(failures)


def damaged_copies(exports, work: Path) -> dict[str, tuple[Path, str | None]]:
    """{case: (directory, text its refusal must contain)} for byte-level damage of every file."""
    rng = np.random.default_rng(53)
    cases = {}
    program = exports["program"]

    def case(name: str, label: str, damage, match: str | None = None) -> None:
        directory = fresh_copy(program, work / f"{name}-{label}".replace("/", "_"))
        damage(directory / name)
        cases[f"{name} {label}"] = (directory, match or name)

    for name in (*FILES, MANIFEST):
        size = (program / name).stat().st_size
        positions = sorted({0, 1, 8, 17, 40, size // 4, size // 2, size - 9, size - 1,
                            *(int(p) for p in rng.integers(0, size, 4))})
        for position in positions:
            for bit in (0, 6):
                def flip(path, position=position, bit=bit):
                    data = bytearray(path.read_bytes())
                    data[position] ^= 1 << bit
                    path.write_bytes(bytes(data))
                case(name, f"bit {bit} of byte {position}", flip)
        # A file of another size is refused by its size alone, before a byte of it is read.
        sized = f"{name}: " if name == MANIFEST else "bytes, but manifest.json records"
        for keep in (0, 1, 8, size // 2, size - 1):
            case(name, f"truncated to {keep}", lambda path, keep=keep: path.write_bytes(path.read_bytes()[:keep]),
                 sized)
        for extra in (b"\0", b"x" * 4096, (program / name).read_bytes()):
            case(name, f"extended by {len(extra)}", lambda path, extra=extra: path.write_bytes(path.read_bytes() + extra),
                 sized)
        case(name, "missing", Path.unlink, "missing")
        case(name, "a directory", lambda path: (path.unlink(), path.mkdir()), "a directory")
        case(name, "a FIFO", lambda path: (path.unlink(), os.mkfifo(path)), "a FIFO")
        case(name, "a link to /dev/zero", lambda path: (path.unlink(), path.symlink_to("/dev/zero")),
             "character device")
        case(name, "a dangling link", lambda path: (path.unlink(), path.symlink_to(path.parent / "nowhere")),
             "missing")
        case(name, "a link loop", lambda path: (path.unlink(), path.symlink_to(path)), "cannot read")
    return cases


def test_every_file_damaged_is_refused_and_never_crashes(exports, tmp_path):
    cases = damaged_copies(exports, tmp_path)
    clean = fresh_copy(exports["program"], tmp_path / "clean")
    results = run_in_child([("clean", clean), *((c, d) for c, (d, _) in cases.items())], tmp_path)
    tally_child_results(results, {c: m for c, (_, m) in cases.items()}, "clean")
    assert len(cases) > 150


def swapped_copies(exports, work: Path) -> dict[str, tuple[Path, str | None]]:
    """Each file of the program swapped for the same file of another export: as is (the checksum must catch
    it) and forged (the manifest's record and SHA-256 rewritten to match it: the layout or the functions' own
    input checks must catch it). A swap for identical bytes (the functions of an export that differs only in
    its weights' values) may be accepted: it is the same program."""
    cases = {}
    for other in ("seq32", "batch1", "rank8", "layers1", "seed1", "q4"):
        for name in FILES:
            for forged in (False, True):
                if forged and other == "seed1" and name == WEIGHTS:
                    continue  # the seed-1 export's own program: test_forged_weights_of_the_same_layout
                label = f"{name} of {other}{' forged' if forged else ''}"
                directory = fresh_copy(exports["program"], work / label.replace(" ", "-"))
                shutil.copy(exports[other] / name, directory / name)
                identical = (exports[other] / name).read_bytes() == (exports["program"] / name).read_bytes()
                if forged:
                    forgefile_record(directory, name)
                cases[label] = (directory, None if identical else name if not forged else None)
        # The whole manifest of another export, and the manifest with its weights: files of mixed exports.
        directory = fresh_copy(exports["program"], work / f"manifest-of-{other}")
        shutil.copy(exports[other] / MANIFEST, directory / MANIFEST)
        cases[f"manifest of {other}"] = (directory, MANIFEST)
        if other == "seed1":
            continue  # its manifest and weights with identical functions are the seed-1 export itself
        directory = fresh_copy(exports["program"], work / f"manifest-and-weights-of-{other}")
        for name in (MANIFEST, WEIGHTS):
            shutil.copy(exports[other] / name, directory / name)
        cases[f"manifest and weights of {other}"] = (directory, None)
    return cases


def test_files_of_other_exports_are_refused(exports, tmp_path):
    cases = swapped_copies(exports, tmp_path)
    clean = fresh_copy(exports["program"], tmp_path / "clean")
    results = run_in_child([("clean", clean), *((c, d) for c, (d, _) in cases.items())], tmp_path)
    tally_child_results(results, {c: m for c, (_, m) in cases.items()}, "clean")
    # Unforged, only a swap for identical bytes passes. Forged, another function passes only where it
    # computes the same (the tally checked the step bit for bit: embed and adamw do not depend on the rank or
    # the seq); a function traced for other shapes or another base is refused when called.
    for case, (directory, _) in cases.items():
        name = case.split(" of ")[0]
        if name in FILES and (directory / name).read_bytes() != (exports["program"] / name).read_bytes():
            assert results[case][0] == "refused" or case.endswith("forged"), (case, results[case])
    for other in ("seq32", "batch1", "rank8", "q4"):
        for name in ("block_forward.mlxfn", "block_backward.mlxfn"):
            assert results[f"{name} of {other} forged"][0] == "refused", (name, other)


def test_forged_weights_of_the_same_layout_train_as_their_own_program(exports, tmp_path):
    """Weights of an export with the same layout, their SHA-256 forged into the manifest, are a consistent
    program (the seed-1 export's base and adapters with this program's functions): the replay must train them
    exactly as the seed-1 export itself does, never a mix."""
    directory = fresh_copy(exports["program"], tmp_path / "forged")
    shutil.copy(exports["seed1"] / WEIGHTS, directory / WEIGHTS)
    forgefile_record(directory, WEIGHTS)
    own = load_and_step(exports["seed1"])
    attempt(FAULT, lambda: load_and_step(directory),
            sound=lambda result: same_as_reference((own[0], {k: np.array(v) for k, v in own[1].items()}), *result))


def crafted_weights(program: Path, work: Path, label: str, change) -> Path:
    """A copy whose weights file is rewritten by change(arrays), keeping the program's layout metadata, and
    whose manifest is forged to record it: only the checks of the arrays themselves can refuse it."""
    directory = fresh_copy(program, work / label.replace(" ", "-"))
    arrays, metadata = mx.load(str(directory / WEIGHTS), return_metadata=True)
    change(arrays)
    mx.save_safetensors(str(directory / WEIGHTS), arrays, metadata=metadata)
    forgefile_record(directory, WEIGHTS)
    return directory


CRAFTED_WEIGHTS = {
    "lacks an array": (lambda a: a.pop("blocks.1.mlp.up_proj.lora_b"), "lacks blocks.1.mlp.up_proj.lora_b"),
    "an extra array": (lambda a: a.__setitem__("blocks.2.mlp.up_proj.lora_b", a["blocks.1.mlp.up_proj.lora_b"]),
                       "holds blocks.2.mlp.up_proj.lora_b"),
    "a block of other shapes": (lambda a: a.__setitem__("blocks.1.self_attn.q_proj.lora_a", mx.zeros((128, 8))),
                                "blocks.1.self_attn.q_proj.lora_a is (128, 8)"),
    "every block of other shapes": (lambda a: [a.__setitem__(f"blocks.{i}.self_attn.q_proj.lora_a", mx.zeros((128, 8)))
                                               for i in range(2)], "block_forward.mlxfn"),
    "RoPE of 32 positions": (lambda a: [a.__setitem__(k, mx.zeros((32, 32))) for k in ("rope.cos", "rope.sin")],
                             "RoPE tables of 16 positions"),
    "a norm of another width": (lambda a: a.__setitem__("head.norm", mx.ones((64,))), "head.norm is (64,)"),
    "an lm weight of another vocabulary": (lambda a: a.__setitem__("embed.embed_tokens.weight", mx.zeros((100, 128))),
                                           "embed.embed_tokens.weight is (100, 128)"),
    "integer adapters": (lambda a: [a.__setitem__(f"blocks.{i}.mlp.up_proj.lora_a", mx.zeros((128, 4), dtype=mx.int32))
                                    for i in range(2)], "not floating point"),
    "a NaN adapter": (lambda a: a.__setitem__("blocks.0.mlp.up_proj.lora_a", mx.full((128, 4), float("nan"))),
                      "NaN or infinity"),
    "an inf base weight": (lambda a: a.__setitem__("blocks.0.mlp.up_proj.linear.weight",
                                                   mx.full((352, 128), float("inf"))), "nothing was changed"),
}


def test_crafted_weights_with_the_right_layout_are_refused(exports, tmp_path):
    """Weights rebuilt by hand with the program's layout metadata and a forged checksum: the arrays must
    still be the ones the manifest implies, and the base's numbers finite when used."""
    for label, (change, match) in CRAFTED_WEIGHTS.items():
        directory = crafted_weights(exports["program"], tmp_path, label, change)
        refused(FAULT, lambda: load_and_step(directory), match=match)


@pytest.mark.parametrize("size", [True, 0, -1, 2**40, "2", 2.0, None])
def test_hostile_export_sizes_are_refused(tmp_path, size):
    refused(FAULT, lambda: export_mlx_mesp(lora_tiny(), size, SEQ, tmp_path / "out"), match="positive integers")
    refused(FAULT, lambda: export_mlx_mesp(lora_tiny(), BATCH, size, tmp_path / "out"), match="positive integers")
    assert not (tmp_path / "out").exists()


# --- The manifest: hostile JSON -----------------------------------------------------------------------------

def _drop(key):
    return lambda m: m.pop(key)


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _set_in(outer, key, value):
    return lambda m: m[outer].__setitem__(key, value)


def _swap_pair(key, first, second):
    def change(m):
        m[key][first], m[key][second] = m[key][second], m[key][first]
    return change


MANIFEST_FIELDS = ("format", "version", "batch", "seq", "vocab", "hidden", "blocks", "block_arrays", "lora_arrays",
                   "embed_arrays", "head_lm_weight", "trainable", "functions", "chunks", "files", "manifest_sha256")
HOSTILE_VALUES = [None, True, False, 0, -1, 1, 3, 2.5, 10**30, -10**30, 10**400, "", "2", "../x", "/etc/passwd",
                  [], ["../x"], {}, {"a": 1}, "\ud800", "é" * 3]


def manifest_changes():
    changes = {f"{field} missing": _drop(field) for field in MANIFEST_FIELDS}
    for field in MANIFEST_FIELDS:
        for index, value in enumerate(HOSTILE_VALUES):
            changes[f"{field} = {value!r:.20}#{index}"] = _set(field, value)
    changes.update({
        "an unknown field": _set("extra", 1),
        "format of another program": _set("format", "edgetrain-mesp-executorch"),
        "version 1 (an older export)": _set("version", 1),
        "version 3 (a newer export)": _set("version", 3),
        "batch 3 (not the traced one)": _set("batch", 3),
        "seq 32": _set("seq", 32), "seq 8": _set("seq", 8), "vocab 300": _set("vocab", 300),
        "vocab 100": _set("vocab", 100), "hidden 64": _set("hidden", 64), "blocks 1": _set("blocks", 1),
        "blocks 3": _set("blocks", 3), "blocks 10**12": _set("blocks", 10**12),
        "blocks 100000 of 200 arrays": lambda m: (m.__setitem__("blocks", 100_000),
                                                  m["block_arrays"].extend(f"a{i}" for i in range(200))),
        "block_arrays reordered (same shapes)": _swap_pair("block_arrays", 3, 7),
        "block_arrays reordered (other shapes)": _swap_pair("block_arrays", 0, 1),
        "block_arrays with a duplicate": lambda m: m["block_arrays"].append(m["block_arrays"][0]),
        "block_arrays with ../x": lambda m: m["block_arrays"].append("../x"),
        "block_arrays with an absolute path": lambda m: m["block_arrays"].append("/etc/passwd"),
        "block_arrays missing one": lambda m: m["block_arrays"].pop(),
        "lora_arrays reordered": _swap_pair("lora_arrays", 0, 1),
        "lora_arrays not a block array": lambda m: m["lora_arrays"].append("nope.lora_a"),
        "lora_arrays with a duplicate": lambda m: m["lora_arrays"].append(m["lora_arrays"][0]),
        "embed_arrays with ../x": lambda m: m["embed_arrays"].append("../x"),
        "head_lm_weight rope.cos": _set("head_lm_weight", "rope.cos"),
        "head_lm_weight head.lm_weight (untied)": _set("head_lm_weight", "head.lm_weight"),
        "trainable missing one": lambda m: m["trainable"].pop(),
        "trainable with a duplicate": lambda m: m["trainable"].append(m["trainable"][0]),
        "trainable unsorted": _swap_pair("trainable", 0, 1),
        "files without the weights": lambda m: m["files"].pop(WEIGHTS),
        "files naming ../x": _set_in("files", "../x", {"bytes": 1, "sha256": "0" * 64}),
        "files naming an absolute path": _set_in("files", "/etc/passwd", {"bytes": 1, "sha256": "0" * 64}),
        "files with a huge size": lambda m: m["files"][WEIGHTS].__setitem__("bytes", 10**30),
        "files with a size as text": lambda m: m["files"][WEIGHTS].__setitem__("bytes", "12"),
        "files with an upper-case SHA-256": lambda m: m["files"][WEIGHTS].__setitem__(
            "sha256", m["files"][WEIGHTS]["sha256"].upper()),
        "files with another SHA-256": lambda m: m["files"]["head.mlxfn"].__setitem__("sha256", "0" * 64),
        "files with an extra key": lambda m: m["files"][WEIGHTS].__setitem__("path", "../x"),
        "functions described otherwise": _set_in("functions", "embed", {"inputs": []}),
        "chunks described otherwise": _set_in("chunks", "vocab", 7),
    })
    return changes


# The fields that only describe the functions to an app: the replay reads none of them.
DESCRIPTIVE = ("functions", "chunks", "manifest_sha256")


def changes_what_the_replay_reads(original: dict, changed: Path) -> bool:
    now = json.loads(changed.read_text())
    return not (isinstance(now, dict) and {k: v for k, v in now.items() if k not in DESCRIPTIVE}
                == {k: v for k, v in original.items() if k not in DESCRIPTIVE})


def attack_manifest(directory: Path, original: dict, reference) -> None:
    """Load and step `directory`: refused naming a file, or, where nothing the replay reads was changed,
    the clean program's step bit for bit."""
    harmless = not changes_what_the_replay_reads(original, directory / MANIFEST)
    outcome = attempt(FAULT, lambda: load_and_step(directory),
                      sound=lambda result: harmless and same_as_reference(reference, *result))
    if isinstance(outcome, EdgetrainError):
        assert any(name in str(outcome) for name in (MANIFEST, WEIGHTS, ".mlxfn")), outcome
    return outcome


@pytest.mark.parametrize("forge", [False, True], ids=["edited", "forged"])
def test_hostile_manifest_fields_are_refused(exports, reference, tmp_path, forge):
    program = exports["program"]
    original = json.loads((program / MANIFEST).read_text())
    refusals = 0
    for label, change in manifest_changes().items():
        directory = fresh_copy(program, tmp_path / "case")
        # Forging recomputes manifest_sha256, which would undo a change of that field itself.
        rewrite_manifest(directory, change, forge and not label.startswith("manifest_sha256"))
        outcome = attack_manifest(directory, original, reference)
        if isinstance(outcome, EdgetrainError):
            refusals += 1
            if not forge:  # an edit, its SHA-256 stale: refused by the field checked first or by the SHA-256
                assert "field" in str(outcome), (label, outcome)
        else:
            assert forge and label.startswith(("functions", "chunks")), (label, "accepted")
    assert refusals > 300 if not forge else refusals > 280
    error = refused(FAULT, lambda: load_and_step(directory_with_version(program, tmp_path, 1)), match="re-export")
    assert "older edgetrain" in str(error)


def directory_with_version(program: Path, work: Path, version: int) -> Path:
    directory = fresh_copy(program, work / f"version-{version}")
    # What a version-1 export's manifest is: no checksums at all.
    rewrite_manifest(directory, lambda m: (m.pop("files"), m.pop("manifest_sha256"), m.__setitem__("version", 1)),
                     forge=False)
    return directory


def test_a_manifest_of_too_many_arrays_is_refused_before_they_are_listed(exports, tmp_path):
    """100000 blocks of 200 arrays, every field consistent with the others, the SHA-256 forged: refused by
    count, before a list of 2e7 names is built."""
    def change(m):
        m["blocks"], m["lora_arrays"] = 100_000, m["lora_arrays"][:1]
        m["block_arrays"] += [f"a{i}" for i in range(200)]
        m["trainable"] = sorted(f"blocks.{i}.{m['lora_arrays'][0]}" for i in range(100_000))

    directory = fresh_copy(exports["program"], tmp_path / "many")
    rewrite_manifest(directory, change, forge=True)
    refused(FAULT, lambda: MLXProgramTrainer(directory), match="which no model has")


RAW_MANIFESTS = {
    "empty": b"",
    "not UTF-8": b'{"format": "\xff\xfe"}',
    "UTF-16": json.dumps({"format": "edgetrain-mesp-mlx"}).encode("utf-16"),
    "a UTF-8 BOM": b"\xef\xbb\xbf{}",
    "NaN": b'{"format": "edgetrain-mesp-mlx", "version": 2, "batch": NaN}',
    "Infinity": b'{"batch": Infinity}',
    "1e999": b'{"batch": 1e999}',
    "a 5000-digit number": b'{"batch": ' + b"9" * 5000 + b"}",
    "a duplicated key": None,  # the real manifest with "batch" given twice, below
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "an array": b"[1, 2]",
    "a string": b'"edgetrain-mesp-mlx"',
    "null": b"null",
    "truncated JSON": b'{"format": "edgetrain-mesp-mlx", "vers',
    "17 MiB of spaces": b" " * (17 << 20) + b"{}",
    "NUL bytes": b"\0" * 64,
}


def test_hostile_manifest_text_is_refused(exports, tmp_path):
    program = exports["program"]
    for label, text in RAW_MANIFESTS.items():
        directory = fresh_copy(program, tmp_path / "case")
        if text is None:
            original = (program / MANIFEST).read_text()
            text = original.replace('"batch": 2,', '"batch": 2, "batch": 3,', 1).encode()
            assert text != original.encode()
        (directory / MANIFEST).write_bytes(text)
        error = refused(FAULT, lambda: MLXProgramTrainer(directory), match="manifest.json")
        if label == "a duplicated key":
            assert "twice" in str(error)


@pytest.mark.parametrize("what", ["missing", "a file", "a link loop", "None", "an int", "NUL in the name", "an empty directory"])
def test_a_directory_that_is_not_a_program_is_refused(exports, tmp_path, what):
    target = {"missing": tmp_path / "nowhere", "a file": exports["program"] / WEIGHTS,
              "a link loop": tmp_path / "loop", "None": None, "an int": 5,
              "NUL in the name": str(tmp_path / "a\0b"), "an empty directory": tmp_path / "empty"}[what]
    if what == "a link loop":
        target.symlink_to(target)
    if what == "an empty directory":
        target.mkdir()
    refused(FAULT, lambda: MLXProgramTrainer(target))


# --- Batches and settings ------------------------------------------------------------------------------------

def bad_batches():
    inputs, targets = the_batch()
    wrapped = inputs.copy()
    wrapped[0, 0] = 2**32 + 5  # int32 would wrap it to 5, inside the vocabulary
    huge = inputs.astype(np.uint64)
    huge[1, 1] = np.iinfo(np.uint64).max
    cases = {
        "transposed": (inputs.T, targets.T), "1-D": (inputs.reshape(-1), targets.reshape(-1)),
        "3-D": (inputs[None], targets[None]), "empty": (inputs[:0], targets[:0]),
        "one row short": (inputs[:1], targets[:1]), "longer": (np.tile(inputs, 2), np.tile(targets, 2)),
        "inputs and targets differ in shape": (inputs, targets[:, :8]),
        "float ids": (inputs.astype(np.float32), targets), "float targets": (inputs, targets + 0.5),
        "bool ids": (inputs > 5, targets), "complex ids": (inputs.astype(np.complex64), targets),
        "string ids": (inputs.astype(str), targets), "object ids": (inputs.astype(object), targets),
        "ragged list": ([[1, 2], [3]], targets), "None": (None, targets), "a string": ("hello", targets),
        "a scalar": (5, targets), "id -1": (np.where(inputs == inputs[0, 0], -1, inputs), targets),
        f"id {VOCAB}": (np.full_like(inputs, VOCAB), targets), "id 2**32 + 5 (wraps in int32)": (wrapped, targets),
        "uint64 max": (huge, targets), "target -1": (inputs, np.full_like(targets, -1)),
        "target -101": (inputs, np.full_like(targets, -101)), f"target {VOCAB}": (inputs, np.full_like(targets, VOCAB)),
        "target 2**32 (wraps to 0)": (inputs, np.full_like(targets, 2**32)),
        "every target ignored": (inputs, np.full_like(targets, -100)),
    }
    return cases


def test_bad_batches_are_refused_with_nothing_changed(exports, reference, tmp_path):
    trainer = MLXProgramTrainer(exports["program"], lr=LR)
    before = {name: np.array(array) for name, array in trainer.adapters().items()}
    for label, (inputs, targets) in bad_batches().items():
        refused(FAULT, lambda: trainer.step(inputs, targets))
        assert trainer.steps_done == 0, label
    assert all(np.array_equal(np.array(array), before[name]) for name, array in trainer.adapters().items())
    # After every refusal, the next good step is the clean program's first step bit for bit.
    attempt(FAULT, lambda: (trainer.step(*the_batch()), trainer.adapters()),
            sound=lambda result: same_as_reference(reference, *result))


@pytest.mark.parametrize("kind", ["uint8", "int16", "uint32", "int64", "mlx", "list", "torch"])
def test_token_ids_of_any_integer_type_train_the_same(exports, reference, kind):
    import torch

    inputs, targets = the_batch()
    convert = {"uint8": lambda a: a.astype(np.uint8) if a.min() >= 0 else a.astype(np.int16),
               "int16": lambda a: a.astype(np.int16), "uint32": lambda a: a.astype(np.uint32) if a.min() >= 0 else a,
               "int64": lambda a: a, "mlx": mx.array, "list": lambda a: a.tolist(), "torch": torch.from_numpy}[kind]
    trainer = MLXProgramTrainer(exports["program"], lr=LR)
    attempt(FAULT, lambda: (trainer.step(convert(inputs), convert(targets)), trainer.adapters()),
            sound=lambda result: same_as_reference(reference, *result))


HOSTILE_SETTINGS = {
    "lr nan": dict(lr=float("nan")), "lr inf": dict(lr=float("inf")), "lr -1": dict(lr=-1.0),
    "lr 1e7": dict(lr=1e7), "lr text": dict(lr="0.1"), "lr None": dict(lr=None), "lr True": dict(lr=True),
    "beta1 1": dict(betas=(1.0, 0.999)), "beta2 -0.1": dict(betas=(0.9, -0.1)), "beta nan": dict(betas=(float("nan"), 0.9)),
    "betas of one": dict(betas=(0.9,)), "betas of three": dict(betas=(0.9, 0.99, 0.999)), "betas text": dict(betas="ab"),
    "betas None": dict(betas=None), "betas an int": dict(betas=5), "betas of text": dict(betas=("a", "b")),
    "betas of bools": dict(betas=(True, False)),
    "eps 0": dict(eps=0.0), "eps -1": dict(eps=-1.0), "eps nan": dict(eps=float("nan")), "eps inf": dict(eps=float("inf")),
    "eps 1e-50 (0 in float32)": dict(eps=1e-50), "eps text": dict(eps="1e-8"),
    "weight_decay -1": dict(weight_decay=-1.0), "weight_decay nan": dict(weight_decay=float("nan")),
    "weight_decay inf": dict(weight_decay=float("inf")), "weight_decay 1e300": dict(weight_decay=1e300),
    "weight_decay None": dict(weight_decay=None),
}


def test_hostile_settings_are_refused(exports):
    for label, settings in HOSTILE_SETTINGS.items():
        refused(FAULT, lambda: MLXProgramTrainer(exports["program"], **settings))


def test_lr_zero_changes_no_adapter(exports):
    trainer = MLXProgramTrainer(exports["program"], lr=0.0, weight_decay=0.5)
    before = {name: np.array(array) for name, array in trainer.adapters().items()}
    with checked(FAULT):
        trainer.step(*the_batch())
        assert trainer.steps_done == 1
        assert all(np.array_equal(np.array(array), before[name]) for name, array in trainer.adapters().items())


def test_a_failing_function_changes_nothing_and_the_replay_is_deterministic(exports, reference):
    trainer = MLXProgramTrainer(exports["program"], lr=LR)
    before = {name: np.array(array) for name, array in trainer.adapters().items()}
    head = trainer.functions["head"]
    for broken in (lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")),
                   lambda *a: head(*a)[:1], lambda *a: [head(*a)[0], head(*a)[1][:, :4]]):
        trainer.functions["head"] = broken
        refused(FAULT, lambda: trainer.step(*the_batch()), match="head.mlxfn")
    trainer.functions["head"] = head
    assert trainer.steps_done == 0
    assert all(np.array_equal(np.array(array), before[name]) for name, array in trainer.adapters().items())
    second = MLXProgramTrainer(exports["program"], lr=LR)
    with checked(FAULT):  # two replays of the same steps agree bit for bit, step after step
        for _ in range(3):
            assert trainer.step(*the_batch()) == second.step(*the_batch())
        assert all(np.array_equal(np.array(trainer.adapters()[n]), np.array(second.adapters()[n]))
                   for n in reference[1])


# --- An export killed part-way -------------------------------------------------------------------------------

EXPORT_CHILD = textwrap.dedent("""
    import sys
    import mlx.core as mx, edgetrain
    from edgetrain.backends.mlx.lora import add_lora
    from edgetrain.export.mlx_program import export_mlx_mesp
    mx.random.seed(7)
    model = edgetrain.load_model("tiny", backend="mlx")
    model.blocks = model.blocks[:2]
    add_lora(model, rank=4)
    print("exporting", flush=True)
    while True:
        export_mlx_mesp(model, 2, 16, sys.argv[1])
""")


def test_an_export_killed_part_way_leaves_a_complete_program(exports, reference, tmp_path):
    """SIGKILL at several moments of exports that replace the program (in a loop, so each kill lands in some
    write): the directory then loads as the old program or the new one, never a mix, never a refusal. A
    crash between the swap's two renames (the directory moved aside) reads the old one."""
    target = fresh_copy(exports["program"], tmp_path / "program")
    new = None
    for delay in (0.05, 0.15, 0.3, 0.45, 0.7, 1.0):
        child = subprocess.Popen([sys.executable, "-c", EXPORT_CHILD, str(target)], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "exporting"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        with checked(FAULT):
            loss, adapters = load_and_step(target)
            if not same_as_reference(reference, loss, adapters):
                new = new or (load_and_step(export_mlx_mesp(lora_tiny(seed=7), BATCH, SEQ, tmp_path / "new")))
                assert same_as_reference((new[0], {k: np.array(v) for k, v in new[1].items()}), loss, adapters)
    moved = fresh_copy(exports["program"], tmp_path / "moved")
    os.replace(moved, moved.parent / f".{moved.name}.old")
    with checked(FAULT):
        assert same_as_reference(reference, *load_and_step(moved))


# --- A randomized sweep -------------------------------------------------------------------------------------

def test_random_forged_manifests(exports, reference, tmp_path):
    """Any field set to any JSON value, the manifest's SHA-256 recomputed: refused naming a file, or (only
    where the value changes nothing the replay reads) the clean program's step bit for bit."""
    from hypothesis import given
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                          max_leaves=8)
    original = json.loads((exports["program"] / MANIFEST).read_text())
    fields = sorted(set(original) - {"manifest_sha256"}) + ["extra"]

    @fuzz_settings(max_examples=40)
    @given(field=st.sampled_from(fields), value=values, nested=st.booleans())
    def sweep(field, value, nested):
        directory = fresh_copy(exports["program"], tmp_path / "fuzz")

        def change(m):
            if nested and isinstance(m.get(field), dict) and m[field]:
                m[field][sorted(m[field])[0]] = value
            elif nested and isinstance(m.get(field), list) and m[field]:
                m[field][0] = value
            else:
                m[field] = value

        rewrite_manifest(directory, change, forge=True)
        attack_manifest(directory, original, reference)

    sweep()
