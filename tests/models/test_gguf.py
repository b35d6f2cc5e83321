"""GGUF loading: tiny llama/qwen2 models written with the `gguf` package's GGUFWriter (as llama.cpp's
convert_hf_to_gguf writes them), read by edgetrain's own reader and compared with transformers'
GGUF path on the same file; dequantisation against gguf.quants; hostile files refused by name."""
from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgetrain
from edgetrain.data.tokenizer import ByteTokenizer, model_tokenizer
from edgetrain.models.gguf import (GGUFError, GGUFTokenizer, dequantize, load_gguf, load_gguf_tokenizer,
                                   read_gguf)
from edgetrain.models.gguf import loader as gguf_loader
from edgetrain.models.llama import LlamaModel
from edgetrain.registry import EdgetrainError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

from gguf_testkit import TEXTS, VOCAB, hf_model, permute_rows, write_gguf  # noqa: E402


def _tokens(seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, len(VOCAB[0]), (2, seq_len), generator=torch.Generator().manual_seed(5))


def _transformers_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(tokens).logits


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", hf_model())


# ---------------------------------------------------------------------------------------------------
# (1) logits equal transformers' on the same file


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_logits_match_transformers(tmp_path, qtype):
    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", hf_model(), qtype)
    ours = edgetrain.load_model(path)
    assert isinstance(ours, LlamaModel) and not ours.config.tie_word_embeddings
    tokens = _tokens()
    with torch.no_grad():
        got = ours(tokens)
    assert _relative_error(got, _transformers_logits(path, tokens)) <= 1e-4


def test_f32_file_equals_the_source_checkpoint(tmp_path):
    """Without transformers' GGUF path in between: the unpermuted model is the model that was converted."""
    source = hf_model(seed=3)
    ours = load_gguf(write_gguf(tmp_path / "llama.gguf", source))
    tokens = _tokens()
    with torch.no_grad():
        assert _relative_error(ours(tokens), source(tokens).logits) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings_and_qwen2_biases(tmp_path, arch):
    path = write_gguf(tmp_path / f"{arch}-tied.gguf", hf_model(arch, tie=True, seed=1), Q.Q8_0)
    ours = edgetrain.load_model(path, quantized=False)  # dense: the tie is one Parameter
    assert ours.config.tie_word_embeddings and ours.head.lm_head.weight is ours.embed.embed_tokens.weight
    assert ours.config.attention_bias == (arch == "qwen2") and ours.config.model_type == arch
    tokens = _tokens()
    with torch.no_grad():
        got = ours(tokens)
    assert _relative_error(got, _transformers_logits(path, tokens)) <= 1e-4


def test_dtype_is_honoured(llama_file):
    model = edgetrain.load_model(llama_file, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = load_gguf(llama_file)
    torch.testing.assert_close(model.blocks[0].mlp.up_proj.weight,
                               reference.blocks[0].mlp.up_proj.weight.to(torch.bfloat16), atol=0, rtol=0)


def test_config_from_metadata(llama_file):
    config = edgetrain.load_model(llama_file).config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.max_position_embeddings) == (len(VOCAB[0]), 64, 128, 2, 4, 2, 16, 128)
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.rope_theta == 10000.0


# ---------------------------------------------------------------------------------------------------
# (5) the Q/K unpermute is needed


def test_qk_unpermute_is_needed(llama_file, monkeypatch):
    tokens = _tokens()
    with torch.no_grad():
        expected = _transformers_logits(llama_file, tokens)
        right = load_gguf(llama_file)(tokens)
        monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda tensor, heads: tensor)
        wrong = load_gguf(llama_file)(tokens)
    assert _relative_error(right, expected) <= 1e-4
    assert _relative_error(wrong, expected) > 1e-2


def test_unpermute_inverts_the_converters_permute():
    rows = torch.arange(2 * 16 * 3, dtype=torch.float32).reshape(32, 3)
    for heads in (1, 2, 4):
        permuted = torch.from_numpy(permute_rows(rows.numpy(), heads))
        assert not torch.equal(permuted, rows)
        assert torch.equal(gguf_loader.unpermute_rope_rows(permuted, heads), rows)
        assert torch.equal(gguf_loader.unpermute_rope_rows(permuted[:, 0], heads), rows[:, 0])  # a bias


# ---------------------------------------------------------------------------------------------------
# (2) dequantisation equals gguf.quants bit for bit


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_dequantize_equals_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((6, 96)).astype(np.float32)
    values[0] = 0.0  # an all-zero block (scale 0)
    values[1] *= 1e4  # large scales
    values[2, :32] = np.linspace(-1, 1, 32)  # every quantisation level in one block
    quantized = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(quantized, qtype)
    got = dequantize(np.ascontiguousarray(quantized).view(np.uint8).reshape(-1), int(qtype), values.shape)
    assert got.dtype == np.float32 and got.shape == values.shape
    np.testing.assert_array_equal(_bits(got), _bits(expected.reshape(values.shape)))


@settings(max_examples=50, deadline=None)
@given(raw=st.binary(min_size=20 * 36, max_size=20 * 36),
       qtype=st.sampled_from([Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]))
def test_dequantize_arbitrary_bytes_equals_gguf_package(raw, qtype):
    """Any bit pattern, including scales that are subnormal, infinite or NaN."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = len(raw) // block_bytes
    data = np.frombuffer(raw[:blocks * block_bytes], dtype=np.uint8)
    shape = (blocks * block_size,)
    with np.errstate(all="ignore"):  # NaN and infinite scales are part of the point
        expected = gguf.quants.dequantize(data.reshape(1, -1) if block_size > 1 else data, qtype)
        got = dequantize(data, int(qtype), shape)
    np.testing.assert_array_equal(_bits(got), _bits(np.asarray(expected).reshape(shape)))


# ---------------------------------------------------------------------------------------------------
# (3) the tokenizer equals transformers' GGUF tokenizer


@pytest.mark.parametrize("pre", [None, "llama-bpe", "qwen2"])
def test_tokenizer_matches_transformers(tmp_path, pre):
    path = write_gguf(tmp_path / "tok.gguf", hf_model(), pre=pre)
    ours = load_gguf_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours.vocab_size == len(VOCAB[0])


def test_tokenizer_special_tokens_and_template(llama_file):
    tokenizer = load_gguf_tokenizer(llama_file)
    tokens = VOCAB[0]
    assert tokenizer.encode("<|im_start|>") == [tokens.index("<|im_start|>")]
    assert tokenizer.encode("<think>") == [tokens.index("<think>")]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == \
        (tokens.index("<|im_start|>"), tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"), None)
    assert tokenizer.chat_template.startswith("{% for m in messages %}")


def test_a_tokenizer_model_edgetrain_does_not_build_is_refused_by_name(tmp_path, caplog):
    """T5's unigram ("t5") is not built (SentencePiece "llama": tests/models/test_gguf_spm_tokenizer.py)."""
    def unigram(writer):
        writer.kv_data[0]["tokenizer.ggml.model"].value = "t5"

    path = write_gguf(tmp_path / "t5.gguf", hf_model(), tweak=unigram)
    with pytest.raises(GGUFError, match="'t5' is not supported; edgetrain builds byte-level BPE"):
        load_gguf_tokenizer(path)
    with caplog.at_level(logging.WARNING, logger="edgetrain"):
        model = edgetrain.load_model(path)  # the model itself still loads, without a tokenizer
    assert isinstance(model, LlamaModel) and isinstance(model_tokenizer(model), ByteTokenizer)
    assert "'t5' is not supported yet" in caplog.text and str(path) in caplog.text


def test_the_loaded_model_carries_its_tokenizer(llama_file):
    model = edgetrain.load_model(llama_file)
    tokenizer = model_tokenizer(model)
    assert isinstance(tokenizer, GGUFTokenizer) and tokenizer.vocab_size == model.config.vocab_size
    assert tokenizer.encode(TEXTS[0]) == load_gguf_tokenizer(llama_file).encode(TEXTS[0])


def test_a_model_without_tokenizer_metadata_loads_without_one(tmp_path):
    def no_tokenizer(writer):
        for key in [k for k in writer.kv_data[0] if k.startswith("tokenizer.")]:
            del writer.kv_data[0][key]

    model = edgetrain.load_model(write_gguf(tmp_path / "bare.gguf", hf_model(), tweak=no_tokenizer))
    assert isinstance(model_tokenizer(model), ByteTokenizer)


# ---------------------------------------------------------------------------------------------------
# (4) hostile files: every failure a GGUFError naming the file and what is wrong


def _refused(path: Path, *fragments: str) -> GGUFError:
    with pytest.raises(GGUFError) as info:
        edgetrain.load_model(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def _tensor_info_at(raw: bytes, name: str) -> int:
    """Byte offset just after `name` in the tensor table (its n_dims field)."""
    encoded = name.encode()
    at = raw.rindex(struct.pack("<Q", len(encoded)) + encoded)
    return at + 8 + len(encoded)


def _damaged(tmp_path: Path, raw: bytes | bytearray, name: str = "damaged.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(raw))
    return path


def test_bad_magic_and_versions(tmp_path, llama_file):
    raw = bytearray(llama_file.read_bytes())
    _refused(_damaged(tmp_path, b"GGML" + raw[4:]), "not a GGUF file", "offset 0")
    _refused(_damaged(tmp_path, raw[:4] + struct.pack("<I", 1) + raw[8:]), "unsupported GGUF version 1")
    _refused(_damaged(tmp_path, raw[:4] + struct.pack(">I", 3) + raw[8:]), "big-endian")
    _refused(_damaged(tmp_path, b""), "empty file")
    # v2 differs from v3 only in allowing big-endian files: a little-endian v2 file is read alike.
    assert isinstance(edgetrain.load_model(_damaged(tmp_path, raw[:4] + struct.pack("<I", 2) + raw[8:])), LlamaModel)


def test_duplicate_metadata_keys_and_tensor_names(tmp_path, llama_file):
    raw = llama_file.read_bytes()
    # Renames to a name of the same length that is already there.
    key = raw.replace(b"llama.rope.freq_base", b"llama.context_length", 1)
    _refused(_damaged(tmp_path, key, "key.gguf"), "metadata key 'llama.context_length' appears twice")
    at = _tensor_info_at(raw, "blk.0.attn_k.weight")
    name = raw[:at].replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight") + raw[at:]
    _refused(_damaged(tmp_path, name, "name.gguf"), "tensor 'blk.0.attn_q.weight' appears twice")


def test_custom_alignment(tmp_path):
    source = hf_model()
    path = write_gguf(tmp_path / "aligned.gguf", source, Q.Q8_0, tweak=lambda w: w.add_custom_alignment(64))
    assert read_gguf(path).data_start % 64 == 0
    tokens = _tokens()
    with torch.no_grad():
        assert _relative_error(edgetrain.load_model(path)(tokens), _transformers_logits(path, tokens)) <= 1e-4

    def bad_alignment(writer):
        writer.add_uint32("general.alignment", 48)

    _refused(write_gguf(tmp_path / "misaligned.gguf", source, tweak=bad_alignment),
             "general.alignment = 48 is not a positive power of two")


def test_non_finite_weights_refused(tmp_path):
    source = hf_model()
    with torch.no_grad():
        source.model.norm.weight[3] = float("nan")
    _refused(write_gguf(tmp_path / "nan.gguf", source), "'output_norm.weight' holds NaN")


def test_truncated_anywhere(tmp_path, llama_file):
    raw = llama_file.read_bytes()
    tensors_at = _tensor_info_at(raw, "token_embd.weight")
    for cut, fragment in [(2, "truncated"), (13, "truncated"), (40, "truncated"), (4000, "truncated"),
                          (tensors_at + 3, "truncated"), (len(raw) - 100, "runs past the end of the file")]:
        _refused(_damaged(tmp_path, raw[:cut]), fragment)


@pytest.mark.parametrize("field,offset", [("tensor count", 8), ("metadata key count", 16)])
def test_counts_past_the_file_end(tmp_path, llama_file, field, offset):
    raw = bytearray(llama_file.read_bytes())
    raw[offset:offset + 8] = struct.pack("<Q", 1 << 60)
    _refused(_damaged(tmp_path, raw), f"the {field} is {1 << 60}")


def test_string_length_and_array_count_past_the_file_end(tmp_path, llama_file):
    raw = bytearray(llama_file.read_bytes())
    first_key = bytearray(raw)
    first_key[24:32] = struct.pack("<Q", 1 << 60)  # the length of the first metadata key
    _refused(_damaged(tmp_path, first_key, "key.gguf"), f"claims {1 << 60} bytes", "byte offset 24")
    key = b"tokenizer.ggml.tokens"
    count_at = raw.index(key) + len(key) + 4 + 4  # value type (array), element type (string), count
    assert struct.unpack_from("<Q", raw, count_at)[0] == len(VOCAB[0])
    raw[count_at:count_at + 8] = struct.pack("<Q", 1 << 60)
    _refused(_damaged(tmp_path, raw, "array.gguf"), "element count of array 'tokenizer.ggml.tokens'")


def test_tensor_offset_past_the_end_and_unknown_type(tmp_path, llama_file):
    raw = bytearray(llama_file.read_bytes())
    at = _tensor_info_at(raw, "output_norm.weight")
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    past_end = bytearray(raw)
    past_end[type_at + 4:type_at + 12] = struct.pack("<Q", 1 << 40)
    _refused(_damaged(tmp_path, past_end, "offset.gguf"), "'output_norm.weight'", "runs past the end")
    unknown = bytearray(raw)
    unknown[type_at:type_at + 4] = struct.pack("<I", 99)
    _refused(_damaged(tmp_path, unknown, "type.gguf"), "'output_norm.weight'", "unknown ggml type 99")


def test_type_it_cannot_dequantise_is_named(tmp_path):
    def q8_1(writer):  # llama.cpp's intermediate type for activations: never a weight edgetrain reads
        name = "blk.0.ffn_up.weight"
        rows, cols = tuple(writer.tensors[0].pop(name).shape)
        writer.add_tensor(name, np.zeros((rows, cols // 32 * 40), np.uint8), raw_dtype=Q.Q8_1)

    path = write_gguf(tmp_path / "q8_1.gguf", hf_model(), tweak=q8_1)
    _refused(path, "'blk.0.ffn_up.weight'", "Q8_1", "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
             "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS")


@pytest.mark.parametrize("key", ["general.architecture", "llama.block_count", "llama.embedding_length",
                                 "llama.feed_forward_length", "llama.attention.head_count",
                                 "llama.attention.layer_norm_rms_epsilon", "llama.context_length"])
def test_missing_required_metadata(tmp_path, key):
    path = write_gguf(tmp_path / "missing.gguf", hf_model(), tweak=lambda w: w.kv_data[0].pop(key))
    _refused(path, f"required metadata key {key!r} is missing")


@pytest.mark.parametrize("key,value,fragment", [
    ("llama.attention.head_count", 5, "not a multiple of llama.attention.head_count 5"),
    ("llama.attention.head_count_kv", 3, "must divide num_attention_heads"),
    ("llama.block_count", 3, "missing tensor(s) for blocks.2"),
    ("llama.block_count", 1, "does not belong to a 1-layer llama decoder"),
    ("llama.feed_forward_length", 96, "'blk.0.ffn_gate.weight' has shape (128, 64)"),
    ("llama.vocab_size", 7, "vocab_size = 7"),
    ("general.architecture", "gemma", "'gemma' is not supported"),
    ("llama.block_count", "two", "must be an integer, found str 'two'"),
])
def test_inconsistent_metadata(tmp_path, key, value, fragment):
    def edit(writer):
        entry = writer.kv_data[0][key]
        entry.value = value
        entry.type = gguf.GGUFValueType.STRING if isinstance(value, str) else entry.type

    _refused(write_gguf(tmp_path / "inconsistent.gguf", hf_model(), tweak=edit), fragment)


def test_mlx_backend_loads_gguf_or_says_it_is_missing(llama_file):
    # Where mlx is installed it loads the file (tests/mlx/test_mlx_gguf.py checks how); elsewhere the
    # backend says it is not available.
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        with pytest.raises(EdgetrainError, match="not available"):
            edgetrain.load_model(llama_file, backend="mlx")
        return
    model = edgetrain.load_model(llama_file, backend="mlx")
    assert type(model).__name__ == "MLXDecoder" and model.config == load_gguf(llama_file).config


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    model = hf_model(seed=2)
    model.config.num_hidden_layers = 1
    model.model.layers = model.model.layers[:1]
    return write_gguf(tmp_path_factory.mktemp("fuzz") / "pristine.gguf", model, Q.Q4_0).read_bytes()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_load_or_raise_gguf_error(tmp_path, pristine, data):
    raw = bytearray(pristine)
    mode = data.draw(st.sampled_from(["truncate", "flip-head", "flip-anywhere", "garbage"]))
    if mode == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif mode == "garbage":
        raw = bytearray(b"GGUF" + data.draw(st.binary(max_size=512)))
    else:
        limit = _tensor_info_at(pristine, "output_norm.weight") + 40 if mode == "flip-head" else len(raw)
        for position in data.draw(st.lists(st.integers(0, limit - 1), min_size=1, max_size=6)):
            raw[position] ^= data.draw(st.integers(1, 255))
    path = _damaged(tmp_path, raw, "fuzzed.gguf")
    for load in (edgetrain.load_model, load_gguf_tokenizer, read_gguf):
        try:
            result = load(path)
        except GGUFError as exc:
            assert str(path) in str(exc)
        else:
            assert result is not None


def _write_words(path: Path, words: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.words", words)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_array_of_strings_is_kept_as_the_files_bytes(tmp_path):
    """A vocabulary-sized array costs a few objects, not one per string (reader.StringArray says why)."""
    import sys

    from edgetrain.models.gguf.reader import StringArray, read_gguf

    words = [f"tok{i}\u00e9" for i in range(50_000)]
    path = _write_words(tmp_path / "words.gguf", words)
    before = sys.getallocatedblocks()
    read = read_gguf(path).metadata["test.words"]
    assert sys.getallocatedblocks() - before < 1_000
    assert isinstance(read, StringArray) and len(read) == len(words)
    assert read == words and list(read) == words and read[-1] == words[-1] and read[2:5] == words[2:5]
    assert read != words[:-1] and read != "tok0"


def test_an_array_string_that_is_not_utf8_is_refused_with_its_element(tmp_path):
    from edgetrain.models.gguf.reader import read_gguf

    path = _write_words(tmp_path / "words.gguf", ["alpha", "omega"])
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"omega", b"\xffmega"))
    with pytest.raises(GGUFError, match=r"element 1 of array 'test.words' is not valid UTF-8"):
        read_gguf(path)


def test_the_bpe_is_built_from_json_with_tokens_respelled_and_a_repeated_tokens_last_id():
    from tokenizers import Tokenizer

    from edgetrain.models.gguf.tokenizer import _bpe_json

    backend = Tokenizer.from_str(_bpe_json(iter(["a", "b", "ab", " ", "\"q\\", "a"]), iter([("a", "b")])))
    vocab = backend.get_vocab()
    # " " is outside GPT-2's byte alphabet: spelled byte by byte ("Ġ"); a dict would keep "a"'s last id.
    assert vocab == {"b": 1, "ab": 2, "\u0120": 3, "\"q\\": 4, "a": 5}
    assert backend.encode("ab").ids == [2]


def test_a_string_array_indexes_like_a_list(tmp_path):
    from edgetrain.models.gguf.reader import read_gguf

    words = ["", "a", "\u00e9t\u00e9", "z" * 300]
    read = read_gguf(_write_words(tmp_path / "words.gguf", words)).metadata["test.words"]
    assert [read[i] for i in range(-4, 4)] == words + words and read[::-1] == words[::-1]
    for index in (4, -5):
        with pytest.raises(IndexError):
            read[index]
