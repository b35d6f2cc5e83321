"""MeSP as an ExecuTorch program (`edgetrain export --method mesp`): five methods over a weights file, driven
step by step, train the same adapters as torch's `Learner(method="mesp", optimizer="adamw")`; the frozen base
stays packed in the weights file; damaged or mismatched files, bad batches and non-finite steps are refused
with nothing changed.

The export is `tiny` (4 blocks, GQA, q/k/v bias, tied embeddings) with LoRA r4 at seq 16 x batch 2; lowering
takes about 15 s on a small CPU (40 s with XNNPACK, which tests/export/test_mesp_runner.py exports), so these
programs leave their products to ExecuTorch's own kernels and are exported once per module.
"""
from __future__ import annotations

import copy
import itertools
import json
import shutil

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch

pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")

from edgetrain.export import ExportError, make_trainable  # noqa: E402
from edgetrain.export.mesp_program import (AdamWSettings, MeSPProgramTrainer, export_mesp_program,  # noqa: E402
                                           mesp_reference, weights_path_for)
from edgetrain.export.weights_file import WeightsFile, WeightsFileError  # noqa: E402
from edgetrain.methods.base import NonFiniteError  # noqa: E402

TOLERANCE = 1e-5
STEPS = 5
BATCH, SEQ = 2, 16
# A large weight decay, so that its term (lr x decay x weight per step) is well above the tolerance.
OPTIMIZER = AdamWSettings(lr=2e-3, weight_decay=0.5)


def lora_tiny(quantize_bits: int | None = None, layers: int | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny", quantize_bits=quantize_bits)
    if layers is not None:
        del model.blocks[layers:]
    return make_trainable(model, "lora", rank=4)


def text_batches(count: int) -> list[Batch]:
    from edgetrain.data import make_stream

    return list(itertools.islice(make_stream("text", batch_size=BATCH, seq_len=SEQ, vocab_size=256), count))


@pytest.fixture(scope="module")
def dense_program(tmp_path_factory):
    model = lora_tiny()
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path_factory.mktemp("dense") / "tiny.pte",
                                           delegate="none")
    return program, weights, reference


@pytest.fixture(scope="module")
def packed_program(tmp_path_factory):
    model = lora_tiny(quantize_bits=4)
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path_factory.mktemp("packed") / "tiny4.pte",
                                           delegate="none")
    return program, weights, reference


def _parity(program, weights, reference, steps: int) -> tuple[float, float, dict, dict]:
    batches = text_batches(steps)
    trainer = MeSPProgramTrainer(program, weights, OPTIMIZER)
    losses = [trainer.step(batch) for batch in batches]
    ref_losses, ref_adapters = mesp_reference(copy.deepcopy(reference), batches, OPTIMIZER)
    adapters = trainer.adapters()
    assert set(adapters) == set(ref_adapters)
    loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
    adapter_error = max(float((adapters[name] - ref).abs().max()) for name, ref in ref_adapters.items())
    return loss_error, adapter_error, adapters, dict(reference.named_parameters())


def test_five_steps_equal_torch_mesp_with_adamw(dense_program):
    loss_error, adapter_error, adapters, start = _parity(*dense_program, STEPS)
    assert loss_error <= TOLERANCE
    assert adapter_error <= TOLERANCE
    # Both halves of every adapter trained (B from step 1, A once B is no longer zero).
    for name, value in adapters.items():
        assert float((value - start[name].detach()).abs().max()) > 1e-4, name


def test_a_packed_base_trains_as_torch_mesp_on_the_same_packed_model(packed_program):
    loss_error, adapter_error, _, _ = _parity(*packed_program, 3)
    assert loss_error <= TOLERANCE
    assert adapter_error <= TOLERANCE


def test_the_weights_file_holds_the_base_packed(packed_program, dense_program):
    packed = WeightsFile(packed_program[1])
    assert packed.tensor("blocks.0.q.codes").dtype == torch.int8  # 4-bit: the row_halves layout
    assert all(p["row_halves"] for p in packed.manifest["block"]["projections"])
    assert "blocks.0.q.weight" not in packed and "embed.codes" in packed
    assert packed.manifest["tied_head"] is True and "head.codes" not in packed  # the table is read once
    dense = WeightsFile(dense_program[1])
    assert dense.tensor("blocks.0.q.weight").dtype == torch.float32
    # The frozen blocks hold 4-bit codes and float16 scales and minimums: 1.5 of 32 bits per weight.
    block_bytes = [sum(e.nbytes for n, e in f.entries.items() if n.startswith("blocks.0.") and "adapters" not in n)
                   for f in (packed, dense)]
    assert block_bytes[0] < 0.25 * block_bytes[1]


def test_the_program_does_not_grow_with_depth(dense_program, tmp_path):
    program, _ = export_mesp_program(lora_tiny(layers=1), BATCH, SEQ, tmp_path / "one-block.pte", delegate="none")
    assert program.stat().st_size == dense_program[0].stat().st_size


def _copy_pair(program, weights, directory):
    shutil.copy(program, directory / "p.pte")
    shutil.copy(weights, directory / "p.weights")
    return directory / "p.pte", directory / "p.weights"


def test_damaged_or_foreign_files_are_refused_by_name(dense_program, packed_program, tmp_path):
    program, weights = _copy_pair(dense_program[0], dense_program[1], tmp_path)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(WeightsFileError, match="checksum"):
        MeSPProgramTrainer(program)
    weights.write_bytes(bytes(data[:1000]))
    with pytest.raises(WeightsFileError, match="p.weights"):
        MeSPProgramTrainer(program)
    weights.unlink()
    with pytest.raises(WeightsFileError, match="p.weights: the weights file does not exist"):
        MeSPProgramTrainer(program)
    # A program from another export (the packed model's) beside these weights.
    with pytest.raises(ExportError, match="not the program"):
        MeSPProgramTrainer(packed_program[0], dense_program[1])
    damaged = bytearray(dense_program[0].read_bytes())
    damaged[100] ^= 0xFF
    program.write_bytes(bytes(damaged))
    with pytest.raises(ExportError, match="not the program"):
        MeSPProgramTrainer(program, dense_program[1])


def test_bad_batches_are_refused_and_change_nothing(dense_program):
    trainer = MeSPProgramTrainer(dense_program[0], dense_program[1], OPTIMIZER)
    before = trainer.adapters()
    good = text_batches(1)[0]
    outside = Batch(good.inputs.clone(), good.targets, 3)
    outside.inputs[0, 0] = 256
    with pytest.raises(ExportError, match=r"batch 3: token ids .* outside the vocabulary \[0, 256\)"):
        trainer.step(outside)
    with pytest.raises(ExportError, match="fixed at export"):
        trainer.step(Batch(good.inputs[:, :8], good.targets[:, :8], 4))
    bad_target = Batch(good.inputs, good.targets.clone(), 5)
    bad_target.targets[1, 2] = -7
    with pytest.raises(ExportError, match="target ids"):
        trainer.step(bad_target)
    assert trainer.steps_done == 0
    after = trainer.adapters()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_non_finite_gradient_anywhere_changes_no_block(dense_program):
    trainer = MeSPProgramTrainer(dense_program[0], dense_program[1], OPTIMIZER)
    batches = text_batches(2)
    trainer.step(batches[0])
    adapters, moments = trainer.adapters(), [tuple(t.clone() for t in m) for m in trainer._moments]
    run = trainer._run

    def poisoned(method, inputs):
        outputs = run(method, inputs)
        if method == "block_backward" and inputs[0] is not None and len(outputs) == 2 and outputs[1].numel():
            outputs[1] = outputs[1].clone()
            outputs[1][0] = float("nan")
        return outputs

    trainer._run = poisoned
    with pytest.raises(NonFiniteError, match="non-finite gradient in block 3"):
        trainer.step(batches[1])
    trainer._run = run
    assert trainer.steps_done == 1
    assert all(torch.equal(adapters[name], value) for name, value in trainer.adapters().items())
    assert all(torch.equal(a, b) for before, now in zip(moments, trainer._moments) for a, b in zip(before, now))


def test_bad_optimizer_settings_and_output_paths_are_named_errors(tmp_path):
    with pytest.raises(edgetrain.EdgetrainError, match="lr"):
        AdamWSettings(lr=float("nan"))
    with pytest.raises(edgetrain.EdgetrainError, match="beta2"):
        AdamWSettings(betas=(0.9, 1.5))
    # The native runner's bounds: what the replay takes, the runner takes (eps 0 would divide 0 by 0).
    for bad in (dict(eps=0.0), dict(eps=1.5), dict(eps=True), dict(betas=(1.0, 0.999)), dict(weight_decay=2e6)):
        name = next(iter(bad)).replace("betas", "beta1")
        with pytest.raises(edgetrain.EdgetrainError, match=f"AdamW {name}"):
            AdamWSettings(**bad)
    assert AdamWSettings(eps=1.0, betas=(0.0, 0.0), weight_decay=0.0).eps == 1.0  # the runner's edges, valid
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(edgetrain.EdgetrainError, match="a-file"):
        export_mesp_program(lora_tiny(layers=1), BATCH, SEQ, blocker / "p.pte")
    with pytest.raises(ExportError, match="positive integers"):
        export_mesp_program(lora_tiny(layers=1), 0, SEQ, tmp_path / "p.pte")
    assert not (tmp_path / "p.pte").exists() and not weights_path_for(tmp_path / "p.pte").exists()


def test_a_model_without_adapters_or_not_float32_is_refused(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(ExportError, match="no LoRA adapters"):
        export_mesp_program(edgetrain.load_model("tiny"), BATCH, SEQ, tmp_path / "p.pte")
    with pytest.raises(ExportError, match="float32"):
        export_mesp_program(lora_tiny(layers=1).to(torch.bfloat16), BATCH, SEQ, tmp_path / "p.pte")


def test_the_cli_exports_and_checks_against_torch(tmp_path, capsys):
    from edgetrain.cli import main

    out = tmp_path / "cli.pte"
    code = main(["export", "--method", "mesp", "--model", "tiny", "--rank", "4", "--seq", str(SEQ), "--batch",
                 str(BATCH), "--out", str(out), "--check", "2", "--quantize-bits", "8", "--delegate", "none"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(printed.strip().splitlines()[-1])
    assert report["method"] == "mesp" and report["steps"] == 2
    assert report["max_loss_error"] <= TOLERANCE and report["max_adapter_error"] <= TOLERANCE
    assert WeightsFile(weights_path_for(out)).tensor("blocks.0.gate.codes").dtype == torch.int8  # q - 128


def test_addmm_is_split_into_the_optimized_mm_with_its_scales():
    # ExecuTorch's optimized CPU kernels have mm but not addmm (a naive loop there): the lowering rewrites it.
    from edgetrain.export.executorch import _split_addmm

    class Scaled(torch.nn.Module):
        def forward(self, bias, left, right):
            return torch.addmm(bias, left, right, beta=0.5, alpha=-2.0)

    args = (torch.randn(3, 4), torch.randn(3, 5), torch.randn(5, 4))
    exported = torch.export.export(Scaled(), args, strict=False).run_decompositions()
    assert _split_addmm(exported.graph_module) == 1
    targets = {str(node.target) for node in exported.graph_module.graph.nodes}
    assert "aten.addmm.default" not in targets and "aten.mm.default" in targets
    assert "aten.mul.Scalar" not in targets  # ExecuTorch's portable kernel; XNNPACK takes mul.Tensor
    torch.testing.assert_close(exported.module()(*args), Scaled()(*args))


def _pieces(monkeypatch, tmp_path, model) -> tuple[dict, dict]:
    """The modules and example inputs export_mesp_program hands to the lowering."""
    from edgetrain.export import executorch as lowering

    captured = {}

    def capture(modules, examples, delegate="xnnpack"):
        captured.update(modules=modules, examples=examples)
        raise KeyboardInterrupt  # not an Exception: nothing on the way catches it

    monkeypatch.setattr(lowering, "lower_methods", capture)
    with pytest.raises(KeyboardInterrupt):
        export_mesp_program(model, BATCH, SEQ, tmp_path / "never.pte")
    return captured["modules"], captured["examples"]


# What ExecuTorch's portable kernels would run on a whole tile of weights or activations, one element at a time:
# a byte mask at about 1 ns a byte was a sixth of a SmolLM2 block forward, a `where` over attention scores 8 ns an
# element; a number times a tensor (mul.Scalar) or an alias each a pass XNNPACK would not take.
_SLOW_ON_TILES = ("aten.mul.Scalar", "aten.alias.default", "aten.div.Tensor_mode")


def _packed_base(base: str) -> torch.nn.Module:
    """tiny quantised on load (4 or 8 bits), or llama.cpp's tiny GGUF fixture of a 5- or 6-bit type (its blocks'
    codes in row quarters), one block, with LoRA."""
    if base.endswith("-bit"):
        return lora_tiny(quantize_bits=int(base[:-4]), layers=1)
    from pathlib import Path

    torch.manual_seed(0)
    model = edgetrain.load_model(Path(__file__).resolve().parent.parent / "fixtures" / "gguf" / f"tiny-{base}.gguf")
    del model.blocks[1:]
    return make_trainable(model, "lora", rank=4)


# Q6_K's row quarters (three bytes of a last-quarter code, not two) in the slow lane: about 30 s more, and the Q4_K_M
# export below runs them too.
@pytest.mark.parametrize("base", ["4-bit", "8-bit", "Q5_0", pytest.param("Q6_K", marks=pytest.mark.slow)])
def test_packed_pieces_leave_no_tile_to_the_portable_kernels_and_keep_their_numbers(monkeypatch, tmp_path, base):
    from edgetrain.export.executorch import (_linear_for_transposed_products, _replace_empty_permuted, _split_addmm,
                                             trace_for_lowering)

    modules, examples = _pieces(monkeypatch, tmp_path, _packed_base(base))
    quarters = {projection.matrix.row_quarters for projection in modules["block_forward"].layout.projections}
    assert quarters == {not base.endswith("-bit")}
    torch.manual_seed(1)
    for name in ("embed", "block_forward", "block_backward", "head"):
        args = list(examples[name])
        if name == "embed":
            args[0] = torch.randint(0, 256, args[0].shape)
        else:
            args[0] = torch.randn_like(args[0])
        if name == "block_backward":
            args[1] = torch.randn_like(args[1]) * 1e-2
        if name == "head":
            args[1] = torch.randint(0, 256, args[1].shape)
        exported = trace_for_lowering(modules[name], tuple(examples[name]))
        nodes = [node for node in exported.graph_module.graph.nodes if node.op == "call_function"]
        slow = sorted({str(node.target) for node in nodes if str(node.target).startswith(_SLOW_ON_TILES)})
        assert not slow, (name, slow)
        for node in nodes:
            if node.target == torch.ops.aten.expand.default:  # a real broadcast, not a copy to the same shape
                assert node.meta["val"].shape != node.args[0].meta["val"].shape, name
            if node.target == torch.ops.aten.where.self:  # on a mask, never over a batch of attention scores
                assert node.meta["val"].dim() <= 2, name
            if str(node.target).startswith("aten.bitwise_and"):  # on masks (the loss's), never on codes
                assert node.meta["val"].dtype == torch.bool, name
            if node.target == torch.ops.aten.copy.default:  # only a write into another layout (attention's)
                assert node.meta["val"].stride() != node.args[1].meta["val"].stride(), name
            if node.target == torch.ops.aten._to_copy.default:  # integer codes reach float as dequantisations
                assert node.args[0].meta["val"].dtype not in (torch.int8, torch.uint8), name
        # Against the graph with only the rewrites that reorder arithmetic (addmm split up): the rest are exact.
        plain = torch.export.export(modules[name], tuple(examples[name]), strict=False).run_decompositions()
        for rewrite in (_replace_empty_permuted, _split_addmm, _linear_for_transposed_products):
            rewrite(plain.graph_module)
        for got, expected in zip(torch.utils._pytree.tree_leaves(exported.module()(*args)),
                                 torch.utils._pytree.tree_leaves(plain.module()(*args))):
            assert torch.equal(got, expected), name


def test_lowering_keeps_the_traced_order_so_tiles_are_not_all_alive_at_once():
    # Lowering to XNNPACK re-sorts a method breadth-first: every tile cut from an input moved to the front, alive
    # together (a SmolLM2 head's plan: 53 -> 223 MiB). _restore_traced_order puts them back where they were traced.
    pytest.importorskip("executorch.backends.xnnpack")
    from executorch.exir._serialize._program import deserialize_pte_binary

    from edgetrain.export.executorch import lower_methods

    class Tiles(torch.nn.Module):
        def forward(self, x, table):
            total = torch.zeros(x.shape[0], table.shape[1])
            for start in range(0, table.shape[0], 256):
                tile = table[start:start + 256] * 1.5       # a fresh tile, on XNNPACK
                total = total + torch.mm(torch.mm(x, tile.t()).exp(), tile)
            return total

    args = {"tiles": (torch.randn(64, 128), torch.randn(12 * 256, 128))}

    def plan_bytes(delegate: str) -> int:
        program = deserialize_pte_binary(lower_methods({"tiles": Tiles()}, args, delegate))
        return sum(getattr(program, "program", program).execution_plan[0].non_const_buffer_sizes)

    tile_bytes = 256 * 128 * 4
    # Within two tiles of ExecuTorch's own kernels' plan, where twelve hoisted tiles would be eleven more.
    assert plan_bytes("xnnpack") <= plan_bytes("none") + 2 * tile_bytes


@pytest.mark.parametrize("file_type", ["Q3_K_M", "Q4_K_M"])
def test_a_k_quant_base_stays_packed_in_the_program_and_trains_as_torch_mesp(file_type, tmp_path, caplog):
    """llama.cpp's Q3_K_M and Q4_K_M mixes (Q3_K, Q4_K, Q5_K, Q6_K) go into the weights file as their codes
    (in row halves, 5- and 6-bit ones in row quarters; the odd-rowed head a byte a code) with the block scales
    and group steps, dequantised in the block programs; the steps equal torch mesp on the packed model."""
    import logging
    from pathlib import Path

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "gguf" / f"tiny-{file_type}.gguf"
    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model(fixture), "lora", rank=4)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="edgetrain.export.mesp_program"):
        program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path / "kquant.pte", delegate="none")
    assert not [r for r in caplog.records if "dense float32" in r.getMessage()]
    file = WeightsFile(weights)
    assert "blocks.0.q.weight" not in file and "blocks.0.q.scale_steps" in file
    assert file.tensor("blocks.0.q.codes").dtype == torch.int8
    v = next(p for p in file.manifest["block"]["projections"] if p["name"] == "v")  # Q5_K or Q6_K: 6 bits a code
    assert v["row_quarters"] and file.tensor("blocks.0.v.codes").shape == (v["rows"] * 3 // 4, v["cols"])
    loss_error, adapter_error, _, _ = _parity(program, weights, reference, 2)
    assert loss_error <= TOLERANCE
    assert adapter_error <= TOLERANCE


def test_a_non_uniform_grid_goes_in_dense_with_a_message_and_trains_as_torch_mesp(tmp_path, caplog):
    """IQ4_XS (a non-uniform 4-bit grid) is converted to dense float32 at export, said once with the count by
    type and the size; the step is then torch mesp's on the packed model."""
    import logging
    from pathlib import Path

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "gguf" / "tiny-IQ4_XS.gguf"
    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model(fixture), "lora", rank=4)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="edgetrain.export.mesp_program"):
        program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path / "iq4.pte", delegate="none")
    said = [r.getMessage() for r in caplog.records if "dense float32" in r.getMessage()]
    assert len(said) == 1 and "8 packed matrices (IQ4_XS x 8)" in said[0], said
    file = WeightsFile(weights)
    assert file.tensor("blocks.0.q.weight").dtype == torch.float32 and "head.codes" in file  # the Q6_K output
    loss_error, adapter_error, _, _ = _parity(program, weights, reference, 2)
    assert loss_error <= TOLERANCE
    assert adapter_error <= TOLERANCE


def test_blocks_in_different_formats_share_one_exact_format_and_train_as_torch_mesp(tmp_path, caplog):
    """A projection held in different affine formats across blocks (a Q4_K_M file's Q4_K / Q6_K ffn_down, its
    Q5_0 / Q8_0 attn_v) goes into every block in one common format (codes in as few bits as hold every
    format's, scales and biases on the smallest block's grid with group steps), not dense: here blocks from
    llama.cpp's Q4_K_M, Q3_K_M and Q5_0 files."""
    import logging
    from pathlib import Path

    fixtures = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
    model = edgetrain.load_model(fixtures / "tiny-Q4_K_M.gguf")
    for other in ("Q3_K_M", "Q5_0"):
        model.blocks.append(edgetrain.load_model(fixtures / f"tiny-{other}.gguf").blocks[0])
    model.config.num_hidden_layers = len(model.blocks)
    torch.manual_seed(0)
    model = make_trainable(model, "lora", rank=4)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="edgetrain.export.mesp_program"):
        program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path / "mixed.pte", delegate="none")
    assert not [r for r in caplog.records if "dense float32" in r.getMessage()]
    file = WeightsFile(weights)
    projections = {p["name"]: p for p in file.manifest["block"]["projections"]}
    # Every one mixed here, with no 8-bit format among them: codes of -16 to 15 (5 bits) or, with Q6_K's, -32 to 31
    # (6 bits), in row quarters; scales and biases on Q5_0's 32 columns.
    assert all(p["row_quarters"] and p["block_values"] == 32 for p in projections.values())
    assert {name: (p["bits"], p["code_offset"]) for name, p in projections.items()} == {
        "q": (5, 16), "k": (5, 16), "v": (6, 32), "o": (5, 16), "gate": (5, 16), "up": (5, 16), "down": (6, 32)}
    assert projections["q"]["group_size"] == 16 and projections["o"]["group_size"] == 32  # Q3_K's groups of 16
    assert not any(name.endswith(".weight") and name.startswith("blocks.") for name in file.entries)
    batches = text_batches(3)
    trainer = MeSPProgramTrainer(program, weights, OPTIMIZER)
    losses = [trainer.step(batch) for batch in batches]
    ref_losses, ref_adapters = mesp_reference(copy.deepcopy(reference), batches, OPTIMIZER)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOLERANCE  # measured 2e-7
    # Three copies of one block make a chaotic model: AdamW's first steps amplify the float32 sums' order
    # where a gradient nearly cancels (measured: 3% of the trained change in one B). A wrong block's
    # weights would move everything; the common format's exactness is tests/export/test_mesp_graph.py's.
    adapters, start = trainer.adapters(), dict(reference.named_parameters())
    for name, ref in ref_adapters.items():
        change = float((ref - start[name].detach()).abs().max())
        assert float((adapters[name] - ref).abs().max()) <= 0.1 * change, name


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_todays_architectures_train_in_the_program_as_torch_mesp(name, tmp_path):
    """Llama 3.x (its scaled RoPE goes in as the tables) and Qwen3 (its head norms over q and k are two more
    frozen inputs of the one block program), from the GGUF files llama.cpp's converter made."""
    from pathlib import Path

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "arch" / f"{name}.gguf"
    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model(fixture), "lora", rank=4)
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, BATCH, SEQ, tmp_path / f"{name}.pte", delegate="none")
    file = WeightsFile(weights)
    assert ("blocks.1.self_attn.q_norm" in file) == (name == "qwen3")
    loss_error, adapter_error, _, _ = _parity(program, weights, reference, 2)
    assert loss_error <= TOLERANCE
    assert adapter_error <= TOLERANCE


def test_gemma3_is_refused_by_name_saying_what_the_program_lacks(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "arch" / "gemma3.gguf"
    model = make_trainable(edgetrain.load_model(fixture), "lora", rank=4)
    with pytest.raises(ExportError, match="gemma3_text's norms on the attention's and the MLP's outputs, scaled "
                                          "token embeddings, sliding-window layers, a gelu_pytorch_tanh MLP"):
        export_mesp_program(model, BATCH, SEQ, tmp_path / "gemma.pte", delegate="none")
    assert list(tmp_path.iterdir()) == []
