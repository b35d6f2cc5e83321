"""Every user path that loads a GGUF keeps its 4- and 8-bit weights packed by default, and --dequantize (or
LoadOptions(dequantize=True)) asks for the dense base: train, eval, generate, profile, personalise run, the
Personaliser and model_for_inference, export --merge (always dense: merged weights are), load_model.
Checkpoints and adapters made on one base load on the other, and the packed base evaluates and trains to
the dense base's numbers. (SmolLM2's own GGUF: tests/test_packed_base_smollm2.py, slow lane.)"""
from __future__ import annotations

import json
import math

import pytest
import torch

import edgetrain
from edgetrain.cli import main
from edgetrain.backends.load_options import LoadOptions
from edgetrain.models.quantized import packed_matrix_count

CORPUS = "the device learns where it runs, and keeps what it learned. " * 60


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from gguf_testkit import Q, hf_model, write_gguf

    directory = tmp_path_factory.mktemp("packed")
    (directory / "train.txt").write_text(CORPUS)
    return write_gguf(directory / "model.gguf", hf_model("qwen2"), Q.Q4_1)


def _packed(models) -> list[bool]:
    return [packed_matrix_count(model) > 0 for model in models]


@pytest.mark.parametrize("flags, packed", [([], True), (["--dequantize"], False)])
def test_train_keeps_the_base_packed_unless_asked(gguf, loaded, tmp_path, flags, packed):
    adapter = tmp_path / "adapter.safetensors"
    assert main(["train", "--model", str(gguf), "--method", "mesp", "--steps", "2", "--seq", "16", "--batch", "2",
                 "--files", str(gguf.parent / "train.txt"), "--save-adapter", str(adapter), "--quiet", *flags]) == 0
    assert _packed(loaded) == [packed] and adapter.exists()


def _eval(capsys, gguf, *flags) -> dict:
    assert main(["eval", "--model", str(gguf), "--data", str(gguf.parent / "train.txt"), "--seq", "32", "--batch",
                 "2", "--max-batches", "3", "--quiet", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_and_generate_on_the_packed_base_give_the_dense_bases_numbers(gguf, loaded, capsys):
    packed, dense = _eval(capsys, gguf), _eval(capsys, gguf, "--dequantize")
    assert _packed(loaded) == [True, False]
    assert packed["tokens"] == dense["tokens"] > 0
    assert packed["loss"] == pytest.approx(dense["loss"], rel=1e-4)
    texts = []
    for flags in ([], ["--dequantize"]):
        assert main(["generate", "--model", str(gguf), "--prompt", "the device", "--max-tokens", "8", "--quiet",
                     *flags]) == 0
        texts.append(capsys.readouterr().out)
    assert _packed(loaded) == [True, False, True, False] and texts[0] == texts[1]


def test_the_chunked_held_out_loss_equals_the_whole_logits_loss(gguf, monkeypatch):
    """eval never holds a batch's logits: the head reads its LM weight a tile of vocabulary rows at a time
    (packed or dense), or a head it cannot tile runs a chunk of positions at a time; either sum is the
    whole-logits cross-entropy's (ignored targets skipped)."""
    import torch.nn.functional as F

    from edgetrain.data.batch import Batch
    from edgetrain.methods.mesp import loss as mesp_loss
    from edgetrain.models import token_loss

    inputs = torch.randint(0, 301, (3, 50))
    targets = torch.randint(0, 301, (3, 50))
    targets[1, 10:30] = -100
    for model in (edgetrain.load_model(gguf), edgetrain.load_model(gguf, quantized=False)):
        with torch.no_grad():
            reference = float(F.cross_entropy(model(inputs).flatten(0, 1).double(), targets.flatten(),
                                              ignore_index=-100, reduction="sum"))
            for tile_rows, vocab_tile in ((7, 13), (1000, 64), (1000, 4096)):  # positions a pass, rows a tile
                monkeypatch.setattr(token_loss, "TILED_TOKEN_ROWS", tile_rows)
                monkeypatch.setattr(mesp_loss, "default_vocab_chunk", lambda quantized, device: vocab_tile)
                total, tokens = token_loss.summed_token_loss(model, inputs, targets)
                # the same fp32 logits up to BLAS's blocking, summed in fp64
                assert tokens == 150 - 20 and total == pytest.approx(reference, rel=1e-6)
            monkeypatch.setattr(token_loss, "_vocabulary_rows", lambda head, hidden: None)
            for chunk in (1, 64, 1000):
                assert token_loss.summed_token_loss(model, inputs, targets, chunk)[0] == pytest.approx(reference,
                                                                                                      rel=1e-6)
            monkeypatch.undo()
    # The learner's evaluation (the personaliser's gate) reads the same chunked loss.
    edgetrain.add_lora(model, rank=4)
    metrics = edgetrain.Learner(model, method="mesp").evaluate([Batch(inputs, targets)])
    assert metrics["loss"] == pytest.approx(reference / 130, rel=1e-6)


def test_generation_computes_the_last_positions_logits_only(gguf):
    from edgetrain.models.generate import KVCache, forward_cached

    model = edgetrain.load_model(gguf)
    tokens = torch.randint(0, model.config.vocab_size, (1, 9))
    whole = forward_cached(model, tokens, KVCache())
    last = forward_cached(model, tokens, KVCache(), last_only=True)
    assert last.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(last[0, 0], whole[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, packed", [([], True), (["--dequantize"], False)])
def test_profile_measures_the_base_the_flags_name(gguf, tmp_path, flags, packed):
    out = tmp_path / "records.json"
    assert main(["profile", "--model", str(gguf), "--methods", "mesp", "--seq", "16", "--steps", "1",
                 "--no-fidelity", "--json", str(out), "--quiet", *flags]) == 0
    [record] = json.loads(out.read_text())
    assert (record["packed_matrices"] > 0) == packed
    assert record["base"] == ("kept as stored" if packed else "dequantised to float32")


def test_personalise_run_keeps_the_base_packed_and_the_store_remembers_how(gguf, loaded, tmp_path, capsys):
    store = tmp_path / "store"
    notes = [tmp_path / f"note{i}.txt" for i in range(6)]
    for i, note in enumerate(notes):
        note.write_text(f"note {i}: " + CORPUS[: 200 + 10 * i])
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)]) == 0
    run = ["personalise", "run", "--store", str(store), "--max-steps", "2", "--window-steps", "2", "--seq", "16",
           "--batch", "2", "--quiet"]
    assert main([*run, "--model", str(gguf), "--method", "mesp"]) == 0
    assert loaded and all(_packed(loaded))
    with edgetrain.Personaliser(store) as personaliser:
        assert personaliser.bound["load"] == LoadOptions().to_record()
        assert packed_matrix_count(personaliser.model_for_inference()) > 0
    capsys.readouterr()
    # Another base for the same store is refused by name: its versions were made on this one.
    assert main([*run, "--dequantize"]) == 2
    assert "holds its base kept as stored, not dequantised to float32" in capsys.readouterr().err
    assert main(run) == 0  # no flag: the store's own base


def test_a_personaliser_made_on_the_dense_base_serves_the_dense_base(gguf, tmp_path):
    store = tmp_path / "dense"
    with edgetrain.Personaliser(store, gguf, method="mesp", load=LoadOptions(dequantize=True)) as personaliser:
        assert packed_matrix_count(personaliser.require_model()[0]) == 0
        assert packed_matrix_count(personaliser.model_for_inference()) == 0
    with edgetrain.Personaliser(store) as personaliser:  # reopened without options: the store's own
        assert personaliser.load_options == LoadOptions(dequantize=True)
    with pytest.raises(edgetrain.EdgetrainError, match="holds its base dequantised to float32"):
        edgetrain.Personaliser(store, load=LoadOptions())
    with pytest.raises(edgetrain.EdgetrainError, match="load must be a LoadOptions"):
        edgetrain.Personaliser(tmp_path / "other", load={"dequantize": True})


def _learner(model, **options):
    edgetrain.add_lora(model, rank=4)
    return edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-2, seed=0, **options)


def test_a_checkpoint_from_the_packed_base_resumes_on_the_dense_one_and_steps_alike(gguf, tmp_path):
    """The adapter and the optimizer state are the same whichever base trained them; this file's packed
    logits are the dense ones bit for bit, so the next steps are too."""
    from edgetrain.data import text_stream

    batches = list(text_stream(16, 2, text=CORPUS, vocab_size=edgetrain.load_model(gguf).config.vocab_size,
                               tokenizer=edgetrain.load_model(gguf).tokenizer, epochs=1))[:4]
    packed = _learner(edgetrain.load_model(gguf))
    for batch in batches[:2]:
        packed.step(batch)
    packed.save_rotating(tmp_path / "checkpoints")
    dense = _learner(edgetrain.load_model(gguf, quantized=False))
    assert dense.resume(tmp_path / "checkpoints") is not None and dense.steps_done == 2
    for batch in batches[2:]:
        assert packed.step(batch).loss == dense.step(batch).loss
    trained = {name: p for name, p in dense.model.named_parameters() if p.requires_grad}
    assert trained and trained.keys() == {name for name, p in packed.model.named_parameters() if p.requires_grad}
    for name, parameter in packed.model.named_parameters():
        if parameter.requires_grad:
            assert torch.equal(parameter, trained[name]), name
    # And the adapter file of either loads on the other.
    edgetrain.save_lora(dense.model, tmp_path / "adapter.safetensors")
    again = edgetrain.load_model(gguf, adapter=tmp_path / "adapter.safetensors")
    assert packed_matrix_count(again) > 0
    tokens = batches[0].inputs
    with torch.no_grad():
        assert torch.equal(again(tokens), dense.model(tokens))


def test_merging_reads_the_dense_base_and_a_packed_one_is_refused_by_name(gguf, tmp_path, capsys):
    from edgetrain.export.merged import MergeError, save_merged_hf

    model = edgetrain.load_model(gguf)
    edgetrain.add_lora(model, rank=4)
    edgetrain.save_lora(model, tmp_path / "adapter.safetensors")
    with pytest.raises(MergeError, match="held packed .*LoadOptions\\(dequantize=True\\)"):
        save_merged_hf(model, tmp_path / "merged")
    with pytest.raises(edgetrain.EdgetrainError, match="cannot merge a LoRA adapter into a quantised base"):
        edgetrain.merge_lora(model)
    assert not (tmp_path / "merged").exists()
    # export --merge loads the base dense itself, so the default flags give a merged model.
    assert main(["export", "--merge", "--model", str(gguf), "--adapter", str(tmp_path / "adapter.safetensors"),
                 "--out", str(tmp_path / "merged")]) == 0
    merged = edgetrain.load_model(tmp_path / "merged")
    tokens = torch.randint(0, merged.config.vocab_size, (1, 10))
    with torch.no_grad():
        assert math.isclose(float((merged(tokens) - model(tokens)).abs().max()), 0.0, abs_tol=1e-4)


def test_loading_a_gguf_costs_no_more_than_its_weights(gguf, tmp_path):
    """What keeps a load's peak near the weights: blocks repacked a slice of rows at a time (the same
    packing as at once), the file's pages dropped from the resident set once copied, and no torch._dynamo
    import (70 MiB) for initialisers of meta tensors -- while a model built on another thread is still
    initialised."""
    import subprocess
    import sys

    import numpy as np

    from edgetrain.models.gguf import packed as packing
    from edgetrain.models.gguf.reader import read_gguf

    file = read_gguf(gguf)
    for info in file.tensors.values():
        if info.ggml_type in packing.PACKABLE_TYPES:
            whole = packing.pack_blocks(file.tensor_bytes(info), info.ggml_type, info.shape)
            saved, packing.PACK_ROWS = packing.PACK_ROWS, 7
            try:
                sliced = packing.pack_blocks(file.tensor_bytes(info), info.ggml_type, info.shape)
            finally:
                packing.PACK_ROWS = saved
            for name in ("weight", "scales", "biases"):
                assert np.array_equal(getattr(whole, name), getattr(sliced, name)), (info.name, name)
            file.release(info)
            assert np.array_equal(file.tensor_bytes(info)[:64], file.tensor_bytes(info)[:64])  # still readable
    code = ("import sys, edgetrain; edgetrain.load_model(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_a_model_initialised_on_another_thread_meanwhile_gets_its_weights():
    import threading

    from edgetrain.models.meta_build import meta_without_init

    built: list = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        built.append(torch.nn.Linear(16, 16))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with meta_without_init():
        shell = torch.nn.Linear(16, 16)
        inside.set()
        done.wait(10)
    thread.join()
    assert shell.weight.is_meta and not built[0].weight.is_meta and built[0].weight.abs().sum() > 0


def test_the_peak_of_a_command_is_measured_above_its_floor(tmp_path):
    from edgetrain.profiler.command_peak import peak_rss_of_command

    floor = peak_rss_of_command([])
    assert floor > 50 * 2**20
    with pytest.raises(edgetrain.EdgetrainError, match="returned 2"):
        peak_rss_of_command(["train", "--method", "no-such-method", "--steps", "1", "--quiet"])


def test_eval_refuses_binary_data_before_it_loads_the_model(gguf, loaded, tmp_path, capsys):
    binary = tmp_path / "program.txt"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 40)
    assert main(["eval", "--model", str(gguf), "--data", str(binary), "--quiet"]) == 2
    assert loaded == [] and "program.txt" in capsys.readouterr().err


def test_a_long_eval_says_how_far_it_is(gguf, capsys):
    """Without a terminal (no bar) eval logs every tenth of its batches, after saying how many it will read."""
    assert main(["eval", "--model", str(gguf), "--data", str(gguf.parent / "train.txt"), "--seq", "16", "--batch",
                 "1", "--max-batches", "20"]) == 0
    err = capsys.readouterr().err
    assert "evaluating 20 batch(es) of 1 x 16 tokens" in err and "base kept as stored" in err
    assert [f"evaluated {done} of 20 batches" in err for done in (2, 10, 18)] == [True, True, True]
    assert "evaluated 20 of 20" not in err  # the result line says it


def test_train_and_personalise_import_no_dynamo_and_pin_the_heap(gguf, tmp_path):
    """What kept these paths 70 MiB and more above `edgetrain train`'s figure: torch.optim's first step and
    a meta-device LlamaModel built with its initialisers (the adapter check) import torch._dynamo, and a
    personaliser left glibc's dynamic mmap threshold to keep freed blocks resident. Each command runs in a
    fresh interpreter, as a user's does."""
    import subprocess
    import sys

    notes = [tmp_path / f"note{i}.txt" for i in range(6)]
    for i, note in enumerate(notes):
        note.write_text(f"note {i}: " + CORPUS[: 200 + 10 * i])
    store = tmp_path / "store"
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)]) == 0
    small = ["--seq", "16", "--batch", "2", "--quiet"]
    commands = {"train": ["train", "--model", str(gguf), "--method", "mesp", "--steps", "2",
                          "--files", str(gguf.parent / "train.txt"), *small],
                "personalise run": ["personalise", "run", "--store", str(store), "--model", str(gguf),
                                    "--max-steps", "2", "--window-steps", "2", *small]}
    code = ("import json, sys\n"
            "from edgetrain.cli import main\n"
            "code = main(sys.argv[1:])\n"
            "print(json.dumps([code, 'torch._dynamo' in sys.modules]))")
    for path, command in commands.items():
        done = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (path, done.stderr[-2000:])
        assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, False], path
    # The personaliser pins the threshold itself (train's memory probe does it for train).
    from edgetrain.personalise import personaliser as personaliser_module

    with edgetrain.Personaliser(store) as personaliser:
        pinned = []
        original = personaliser_module.fix_malloc_mmap_threshold
        personaliser_module.fix_malloc_mmap_threshold = lambda *a: pinned.append(1) or original(*a)
        try:
            personaliser.require_model()
        finally:
            personaliser_module.fix_malloc_mmap_threshold = original
        assert pinned == [1]


def test_held_out_blocks_run_a_few_rows_at_a_time_to_the_same_loss(gguf, monkeypatch):
    """The personaliser's gate evaluates 16 rows at once; the blocks see rows_per_pass of them (whole rows,
    at most EVAL_BLOCK_POSITIONS positions) and the summed loss is the whole batch's."""
    import torch.nn.functional as F

    from edgetrain.models import token_loss

    model = edgetrain.load_model(gguf)
    inputs = torch.randint(0, 301, (5, 40))
    targets = torch.randint(0, 301, (5, 40))
    targets[3, :25] = -100
    seen: list[int] = []
    model.blocks[0].register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    with torch.no_grad():
        reference = float(F.cross_entropy(model(inputs).flatten(0, 1).double(), targets.flatten(),
                                          ignore_index=-100, reduction="sum"))
        for positions, rows in ((512, [5]), (80, [2, 2, 1]), (1, [1] * 5)):
            monkeypatch.setattr(token_loss, "EVAL_BLOCK_POSITIONS", positions)
            seen.clear()
            total, tokens = token_loss.summed_token_loss(model, inputs, targets)
            assert seen == rows and tokens == 200 - 25
            assert total == pytest.approx(reference, rel=1e-6)
