"""The personaliser on a classifier (mlp-digits, every weight trained with bp) and scikit-learn's digits:
promotion on held-out accuracy, and a window of shuffled labels rejected by the gate."""
from __future__ import annotations

import random

import torch

from edgetrain.personalise import Personaliser, Policy
from personalise_kit import Recorder, training_only

SETTINGS = dict(batch_size=32, window_steps=10, checkpoint_every=5, holdout_every=4, lr=1e-2,
                policy=Policy(check_every_s=0))


def _digits(count: int) -> list[tuple[list[float], int]]:
    from edgetrain.data import load_digits_split

    features, labels = load_digits_split("train")
    return [(features[i].tolist(), int(labels[i])) for i in range(count)]


def test_accuracy_gates_promotion_and_shuffled_labels_are_rejected(tmp_path):
    recorder = Recorder()
    personaliser = Personaliser(tmp_path, "mlp-digits", on_event=recorder, **SETTINGS)
    digits = _digits(400)
    personaliser.add_many(digits)
    result = personaliser.run(max_steps=20)
    assert result.promoted and result.promoted[0] == 1
    first = recorder.of("promoted")[0]
    assert first["metric"] == "accuracy" and first["value"] > first["reference"] + 0.2  # the base guesses
    served_accuracy = recorder.of("promoted")[-1]["value"]
    # The user's labels go wrong: many examples with shuffled labels, all of them training data.
    rng = random.Random(0)
    more = [(features, rng.randrange(10)) for features, _ in _digits(1400)[400:]]
    personaliser.add_many(training_only(more))
    harmful = personaliser.run(max_steps=10)
    assert harmful.promoted == [] and harmful.rejected == 1
    rejected = recorder.of("rejected")[-1]
    assert rejected["value"] < rejected["reference"] and rejected["by"] < 0
    assert personaliser.status()["served"] == result.promoted[-1]
    # The app's classifier is the promoted weights.
    model = personaliser.model_for_inference()
    features = torch.tensor([f for f, _ in digits])
    labels = torch.tensor([label for _, label in digits])
    with torch.no_grad():
        accuracy = float((model(features).argmax(-1) == labels).float().mean())
    assert accuracy > served_accuracy - 0.15 and accuracy > 0.5
