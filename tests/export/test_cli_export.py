"""`edgetrain export`: writes the program, the batch file, and checks N runtime steps against torch."""
from __future__ import annotations

import json

import pytest

from edgetrain.cli import main


def test_export_onnxruntime_head_with_check(tmp_path, capsys):
    pytest.importorskip("onnxruntime.training.api", reason="onnxruntime-training not installed: pip install 'edgetrain[export]'")
    pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn")
    code = main(["export", "--model", "mlp-digits", "--runtime", "onnxruntime", "--out", str(tmp_path / "ort"),
                 "--batch", "8", "--check", "4", "--lr", "0.3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "head of mlp-digits: 330 trainable weights" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["max_loss_error"] <= 1e-5 and result["max_weight_error"] <= 1e-5
    assert sorted(p.name for p in (tmp_path / "ort").iterdir()) == ["checkpoint", "eval_model.onnx",
                                                                     "optimizer_model.onnx", "training_model.onnx"]


def test_export_onnxruntime_lora_writes_artifacts_and_batch_file(tmp_path, capsys):
    pytest.importorskip("onnxruntime.training.api", reason="onnxruntime-training not installed: pip install 'edgetrain[export]'")
    from edgetrain.export import read_batch_file

    code = main(["export", "--model", "tiny", "--runtime", "onnxruntime", "--rank", "2", "--out",
                 str(tmp_path / "lora"), "--batch", "2", "--seq", "16", "--batch-file", str(tmp_path / "b.bin"),
                 "--batch-steps", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "lora of tiny" in out
    batches = read_batch_file(tmp_path / "b.bin")
    assert len(batches) == 3 and tuple(batches[0].inputs.shape) == (2, 16)


def test_export_refuses_lora_on_a_classifier(tmp_path, capsys):
    code = main(["export", "--model", "mlp-digits", "--trainable", "lora", "--out", str(tmp_path / "x.pte")])
    assert code == 2
    assert "use 'head'" in capsys.readouterr().err
