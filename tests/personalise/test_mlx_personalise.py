"""The personaliser on the MLX backend (the MLX learner, the tiny decoder): promotion, versions as mlx-lm
adapter directories that convert to the other formats, resuming a window from its checkpoint, and forget
rebuilding from the base."""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install 'edgetrain[mlx]')")

from edgetrain.personalise import is_held_out  # noqa: E402
from personalise_kit import Recorder, english_texts, make  # noqa: E402

MLX = dict(backend="mlx", window_steps=4)


def _logits(model) -> np.ndarray:
    ids = mx.array([list(b"The function returns the value.")])
    return np.array(model(ids))


def test_mlx_promotes_resumes_and_forgets(tmp_path):
    from edgetrain.adapters.convert import detect_format, load_adapter_into_mlx
    from edgetrain.backends.mlx.loading import load_mlx_model

    recorder = Recorder()
    personaliser = make(tmp_path, on_event=recorder, **MLX)
    ids = personaliser.add_many(english_texts(24, length=120))
    result = personaliser.run(max_steps=6)  # one window promoted, two steps of the next, checkpointed
    assert result.promoted == [1]
    promoted = recorder.of("promoted")[0]
    assert promoted["value"] < promoted["reference"]
    assert detect_format(personaliser.adapter_path()) == "mlx-lm"
    served = personaliser.model_for_inference()
    converted = load_mlx_model("tiny")
    load_adapter_into_mlx(converted, personaliser.adapter_path("edgetrain"))
    np.testing.assert_allclose(_logits(served), _logits(converted), rtol=1e-4, atol=1e-4)
    assert detect_format(personaliser.adapter_path("peft")) == "peft"

    again = Recorder()
    resumed = make(tmp_path, on_event=again, **MLX)
    resumed.run(max_steps=2)
    assert again.of("window_resumed")[0] == {**again.of("window_resumed")[0], "window": 2, "step": 2}
    assert again.of("evaluated"), "the resumed window reached its gate after its last two steps"

    trained = next(i for i in ids if not is_held_out(i, 4))
    assert resumed.forget([trained])["stale"] == [v["version"] for v in resumed.status()["versions"]]
    resumed.run(max_steps=4)
    assert again.of("window")[-1]["start"] == "base"


def test_mlx_makes_its_retain_set_one_prompt_at_a_time_and_guards_with_it(tmp_path):
    from edgetrain.models.generate import generate_ids

    recorder = Recorder()
    prompts = ["Say hello.", "Name a colour.", "Count to three."]
    personaliser = make(tmp_path, on_event=recorder, retain_margin=0.05, retain_prompts=prompts, **MLX)
    personaliser.add_many(english_texts(24, length=120))
    personaliser.add_retain(english_texts(4, start=300, length=120))
    personaliser.run(max_steps=4)
    built = recorder.of("retain_built")[0]
    assert built["prompts"] == 3
    # The answers are MLX's own greedy ones (the base, before any step), as text records: tiny has no template.
    answers = [line for line in (tmp_path / "retain" / "answers.jsonl").read_text().splitlines() if line]
    assert len(answers) == built["answers"]
    base = make(tmp_path / "other", **MLX).model_for_inference()
    from edgetrain.data.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(base)
    expected = [tokenizer.decode(generate_ids(base, tokenizer.encode(f"{p}\n"), 48)) for p in prompts]
    import json

    assert [json.loads(a)["text"] for a in answers] == [e for e in expected if len(tokenizer.encode(e)) >= 2]
    gate = (recorder.of("promoted") or recorder.of("rejected"))[0]
    assert gate["retain"] is not None and gate["retain_base"] is not None
