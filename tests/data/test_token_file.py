"""Plain-text files are streamed from disk (edgetrain.data.token_file): tokenised piece by piece into a
memory-mapped token file whose ids, fingerprint and batches equal tokenising the whole text at once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgetrain.data import TextStream
from edgetrain.data.fingerprint import tensors_digest
from edgetrain.data.text import default_text_corpus, encode_compact, read_text_files
from edgetrain.data.token_file import tokenise_to_disk
from edgetrain.data.tokenizer import ByteTokenizer, HFTokenizer

MIB = 2**20


def _corpus_files(tmp_path: Path) -> list[Path]:
    """Two files of real text with what a cut could break: multi-byte characters everywhere, invalid UTF-8,
    lines ending in spaces, blank-line runs and a file without a final newline."""
    text = default_text_corpus()[:60_000]
    first = tmp_path / "a.txt"
    first.write_bytes(("héllo wörld — ünïcode  \n\n\n   indented\n" * 40 + text).encode("utf-8")
                      + b"\xff\xfe broken \xc3 bytes\n" + "末尾の行".encode("utf-8"))
    second = tmp_path / "b.txt"
    second.write_text(text[::-1] + "\n  trailing spaces   \nlast", encoding="utf-8")
    return [first, second]


def _bpe_tokenizer(tmp_path: Path, pre_tokenizer: str) -> HFTokenizer:
    """A small BPE trained on the pydoc corpus: byte-level (GPT-2/SmolLM2 style) or metaspace (a
    SentencePiece-style "first" prefix, which does merge across a cut)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]" if pre_tokenizer == "metaspace" else None))
    if pre_tokenizer == "byte-level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, special_tokens=["[UNK]"],
                                  show_progress=False)
    tokenizer.train_from_iterator([default_text_corpus()[:200_000]], trainer)
    path = tmp_path / pre_tokenizer / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return HFTokenizer(path)


def test_byte_tokens_from_disk_equal_the_whole_text_and_keep_its_fingerprint(tmp_path):
    files = _corpus_files(tmp_path)
    whole = encode_compact(ByteTokenizer(), read_text_files(files))
    on_disk = tokenise_to_disk(files, ByteTokenizer(), directory=tmp_path, piece_chars=97)
    assert on_disk.tokens.dtype == torch.uint8 and torch.equal(on_disk.tokens, whole)
    assert on_disk.sha256 == tensors_digest(whole)
    assert (on_disk.low, on_disk.high) == (int(whole.min()), int(whole.max()))
    assert list(tmp_path.glob("edgetrain-tokens-*")) == []  # unlinked: nothing to clean up


@pytest.mark.parametrize("pre_tokenizer", ["byte-level", "metaspace"])
def test_bpe_tokens_cut_into_pieces_equal_tokenising_the_whole_text(tmp_path, pre_tokenizer):
    files = _corpus_files(tmp_path)
    tokenizer = _bpe_tokenizer(tmp_path, pre_tokenizer)
    whole = torch.tensor(tokenizer.encode(read_text_files(files)), dtype=torch.int32)
    on_disk = tokenise_to_disk(files, tokenizer, directory=tmp_path, piece_chars=500)
    assert torch.equal(on_disk.tokens, whole)
    assert on_disk.sha256 == tensors_digest(whole)


def test_metaspace_cuts_are_refused_and_byte_level_ones_taken(tmp_path, caplog):
    """The check at each cut is what keeps a prefix-marking tokenizer exact: it refuses those cuts."""
    files = _corpus_files(tmp_path)
    with caplog.at_level("INFO", logger="edgetrain.data.token_file"):
        tokenise_to_disk(files, _bpe_tokenizer(tmp_path, "byte-level"), directory=tmp_path, piece_chars=500)
        assert "merges across" not in caplog.text
        tokenise_to_disk(files, _bpe_tokenizer(tmp_path, "metaspace"), directory=tmp_path, piece_chars=500)
        assert "merges across" in caplog.text


def test_a_text_stream_over_files_gives_the_batches_of_the_whole_text(tmp_path):
    files = _corpus_files(tmp_path)
    from_files = TextStream(paths=files, seq_len=64, batch_size=3, shuffle=True, seed=4, vocab_size=256)
    from_text = TextStream(read_text_files(files), seq_len=64, batch_size=3, shuffle=True, seed=4, vocab_size=256)
    assert from_files.fingerprint()["sha256"] == from_text.fingerprint()["sha256"]
    for index in (0, 1, 17, from_files.batches_per_epoch + 2):
        a, b = from_files.batch(index), from_text.batch(index)
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


BUILD_STREAMS = """
import json, resource, sys
import edgetrain.data as data

def build(paths):
    stream = data.TextStream(paths=paths, seq_len=128, batch_size=4)
    stream.batch(stream.batches_per_epoch - 1)
    return len(stream.tokens), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

small, big = sys.argv[1:]
build([small])  # the fixed costs: lazy imports, the allocator's first large blocks
tokens, before = build([big])
twice, after = build([big, big])
print(json.dumps({"tokens": tokens, "twice": twice, "grew_kib": after - before}))
"""


def test_the_memory_a_text_stream_takes_does_not_grow_with_its_files(tmp_path):
    """Streams over 8 MiB, then 64 MiB, then 128 MiB of text: from the second to the third the process's peak
    RSS grows by under 4 MiB (measured: 0). Holding the text whole, it grew by 150 MiB or more at each: the
    text twice over and its ids."""
    line = "The quick brown fox jumps over the lazy dog, ünïcode included.\n"
    files = []
    for name, mib in (("small.txt", 8), ("big.txt", 64)):
        path = tmp_path / name
        with open(path, "w", encoding="utf-8") as handle:
            for _ in range(mib * MIB // len(line.encode("utf-8"))):
                handle.write(line)
        files.append(str(path))
    done = subprocess.run([sys.executable, "-c", BUILD_STREAMS, *files], capture_output=True, text=True,
                          timeout=300, env={"EDGETRAIN_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["tokens"] >= 63 * MIB and figures["twice"] >= 2 * figures["tokens"]
    assert figures["grew_kib"] * 1024 < 4 * MIB, figures


@pytest.mark.slow
def test_smollm2s_tokens_from_disk_equal_its_whole_text_tokens(smollm2_file, tmp_path, caplog):
    """SmolLM2's own tokenizer (from its GGUF): every cut between pieces is taken and exact."""
    from edgetrain.models.gguf.reader import read_gguf
    from edgetrain.models.gguf.tokenizer import gguf_tokenizer

    tokenizer = gguf_tokenizer(read_gguf(smollm2_file))
    files = _corpus_files(tmp_path)
    whole = torch.tensor(tokenizer.encode(read_text_files(files)), dtype=torch.int32)
    with caplog.at_level("INFO", logger="edgetrain.data.token_file"):
        on_disk = tokenise_to_disk(files, tokenizer, directory=tmp_path, piece_chars=2000)
    assert torch.equal(on_disk.tokens, whole)
    assert "merges across" not in caplog.text
