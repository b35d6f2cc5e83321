"""The forgetting guard: the retain set made on the device (the base model's own answers), the gate that
rejects a candidate whose retain score worsened by more than retain_margin (with both figures), replay,
a damaged or missing retain set rebuilt with an event, classifiers scored on the app's general examples,
and the settings refused by name. The tiny preset and a small chat checkpoint; SmolLM2 is in the slow lane
(test_forgetting_guard_smollm2.py)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from edgetrain.personalise import Personaliser, Policy
from edgetrain.personalise.errors import PersonaliseError, WrongKindError
from edgetrain.personalise.general_prompts import GENERAL_PROMPTS
from edgetrain.personalise.kinds import ReplaySampler, RowSampler
from edgetrain.personalise.retain import RetainSplit, worsened_by
from personalise_kit import Recorder, english_texts, make

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_testkit import write_chat_checkpoint  # noqa: E402

# One narrow fact, said forty ways: what a user's notes on one thing look like to the model.
NARROW = [f"Note {i}: the door code for the garage is 4711 and the gate code is 0815." for i in range(40)]


def _guarded(store: Path, recorder: Recorder, **options):
    """The kit's fast settings with the guard on at its default (unless `options` say otherwise)."""
    return make(store, on_event=recorder, threads=1, **{"retain_margin": 0.05, **options})


def test_a_candidate_that_forgets_is_rejected_with_both_figures_while_the_user_only_gate_promotes_it(tmp_path):
    figures = {}
    for name, retain_margin in (("user_only", None), ("guarded", 0.05)):
        recorder = Recorder()
        personaliser = _guarded(tmp_path / name, recorder, lr=0.2, retain_margin=retain_margin)
        personaliser.add_many(NARROW)
        result = personaliser.run(max_steps=6)
        figures[name] = (result, recorder)
    user_only, user_only_events = figures["user_only"]
    assert user_only.promoted == [1] and user_only.rejected == 0
    assert "retain" not in user_only_events.of("promoted")[0]  # no guard: no retain set made or scored
    assert not user_only_events.of("retain_built")
    guarded, events = figures["guarded"]
    assert guarded.promoted == [] and guarded.rejected == 1
    rejected = events.of("rejected")[0]
    assert rejected["reason"] == "forgetting"
    # Both figures: the user's side would have passed, the retain side did not.
    assert rejected["value"] < rejected["reference"] and rejected["by"] > rejected["margin"]
    assert rejected["retain"] > rejected["retain_base"]
    assert rejected["retain_worsened"] == pytest.approx(rejected["retain"] / rejected["retain_base"] - 1)
    assert rejected["retain_worsened"] > rejected["retain_margin"] == 0.05
    status = Personaliser(tmp_path / "guarded").status()
    assert status["served"] == "base" and status["versions"] == []


def test_a_candidate_that_keeps_what_it_knew_is_promoted_with_its_retain_score(tmp_path):
    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder)
    personaliser.add_many(english_texts(40))
    # The app's own general texts: English the user never wrote (the random preset's own answers are noise).
    personaliser.add_retain(english_texts(12, start=200))
    result = personaliser.run(max_steps=6)
    assert result.promoted == [1]
    promoted = recorder.of("promoted")[0]
    assert promoted["retain_worsened"] <= 0.05 and math.isfinite(promoted["retain"])
    version = personaliser.status()["versions"][0]
    assert version["retain"] == pytest.approx(promoted["retain"])
    assert version["retain_base"] == pytest.approx(promoted["retain_base"])
    assert personaliser.status()["guard"]["app_examples"] == 12


def test_the_retain_set_is_made_once_from_the_shipped_prompts_and_a_missing_or_damaged_one_is_rebuilt(tmp_path):
    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder)
    personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    built = recorder.of("retain_built")
    assert len(built) == 1 and built[0]["prompts"] == len(GENERAL_PROMPTS)
    answers = tmp_path / "retain" / "answers.jsonl"
    lines = answers.read_text().splitlines()
    assert len(lines) == built[0]["answers"] > 0
    guard = personaliser.status()["guard"]
    assert guard["answers"] == len(lines) and guard["built_seconds"] > 0 and guard["prompts"] == "shipped"
    personaliser.run(max_steps=6)  # a second window reads them back
    assert len(recorder.of("retain_built")) == 1 and not recorder.of("retain_rebuilt")
    windows = recorder.of("window")
    assert windows[0]["retain_base"] == windows[1]["retain_base"]  # the base's score, cached

    answers.unlink()
    personaliser.run(max_steps=6)
    rebuilt = recorder.of("retain_rebuilt")
    assert len(rebuilt) == 1 and "missing" in rebuilt[0]["reason"]
    assert answers.is_file() and recorder.of("evaluated")[-1]["retain"] is not None

    # Still JSON, one answer changed: only its digest tells.
    answers.write_bytes(answers.read_bytes().replace(b'"text": "', b'"text": "edited ', 1))
    personaliser.run(max_steps=6)
    rebuilt = recorder.of("retain_rebuilt")
    assert len(rebuilt) == 2 and "damaged" in rebuilt[1]["reason"]
    assert recorder.of("evaluated")[-1]["retain"] is not None  # the guard never went quietly off


def test_the_apps_own_prompts_replace_the_shipped_ones_and_a_change_rebuilds_the_answers(tmp_path):
    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder, retain_prompts=["Say hello.", "Count to five."])
    personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    assert recorder.of("retain_built")[0]["prompts"] == 2
    assert personaliser.status()["guard"]["prompts"] == "app"
    again = _guarded(tmp_path, recorder, retain_prompts=["Say goodbye."])
    again.run(max_steps=6)
    rebuilt = recorder.of("retain_rebuilt")
    assert rebuilt and rebuilt[0]["reason"] == "the prompts changed" and rebuilt[0]["prompts"] == 1


def test_a_chat_models_retain_set_is_its_own_answers_in_its_chat_format(tmp_path):
    checkpoint = write_chat_checkpoint(tmp_path / "chat-model")
    recorder = Recorder()
    personaliser = _guarded(tmp_path / "store", recorder, model=str(checkpoint),
                            retain_prompts=["Hello!", "What is two and two?"])
    personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    records = [json.loads(line) for line in (tmp_path / "store" / "retain" / "answers.jsonl").read_text().splitlines()]
    assert [r["messages"][0] for r in records] == [{"role": "user", "content": "Hello!"},
                                                   {"role": "user", "content": "What is two and two?"}]
    for record in records:
        answer = record["messages"][1]
        assert answer["role"] == "assistant" and "<|im_end|>" not in answer["content"]
    assert recorder.of("evaluated")[0]["retain"] is not None


def test_replay_draws_its_fraction_of_batches_from_the_retain_part_the_guard_never_scores():
    user = RowSampler(lambda i: _row(i), 10, 2, seed=1)
    retain = RowSampler(lambda i: _row(1000 + i), 6, 2, seed=2)
    sampler = ReplaySampler(user, retain, 0.25)
    batches = [sampler.batch(k) for k in range(40)]
    from_retain = [k for k, b in enumerate(batches) if int(b.inputs[0, 0]) >= 1000]
    assert len(from_retain) == 10 and [b.index for b in batches] == list(range(40))
    assert all(int(sampler.batch(k).inputs[0, 0]) == int(batches[k].inputs[0, 0]) for k in range(40))
    # The user's batches are the ones the window would have had without replay, in order.
    users = [b for b in batches if int(b.inputs[0, 0]) < 1000]
    assert all(torch.equal(b.inputs, user.batch(i).inputs) for i, b in enumerate(users))
    split = RetainSplit.of([{"text": str(i)} for i in range(7)], 0.25)
    assert split.scored == [{"text": str(i)} for i in (0, 2, 4, 6)]
    assert split.replayed == [{"text": str(i)} for i in (1, 3, 5)]
    assert RetainSplit.of([{"text": "a"}, {"text": "b"}], 0.0).replayed == []


def _row(value: int):
    from edgetrain.data.batch import Batch

    return Batch(torch.full((1, 4), value), torch.full((1, 4), value), value)


def test_a_window_with_replay_trains_on_the_retain_set_and_scores_the_other_half(tmp_path):
    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder, replay=0.5, retain_margin=None)
    personaliser.add_many(english_texts(40))
    result = personaliser.run(max_steps=6)
    window = recorder.of("window")[0]
    answers = len((tmp_path / "retain" / "answers.jsonl").read_text().splitlines())
    assert window["replayed"] == answers // 2 and window["retain_scored"] == answers - answers // 2
    evaluated = recorder.of("evaluated")[0]
    assert evaluated["retain"] is not None and evaluated["retain_margin"] is None  # scored, not enforced
    assert result.windows == 1 and not any(e.get("reason") == "forgetting" for e in recorder.of("rejected"))


def test_a_classifier_is_guarded_by_the_apps_general_examples(tmp_path):
    from edgetrain.data import load_digits_split

    features, labels = load_digits_split("train")
    settings = dict(batch_size=32, window_steps=10, checkpoint_every=5, holdout_every=4, lr=1e-2,
                    policy=Policy(check_every_s=0), threads=1)
    recorder = Recorder()
    personaliser = Personaliser(tmp_path / "plain", "mlp-digits", on_event=recorder, **settings)
    # This user's labels are their own: each digit is called the next one. Learnt, they contradict what
    # the model should know of digits in general.
    personal = [(features[i].tolist(), (int(labels[i]) + 1) % 10) for i in range(400)]
    personaliser.add_many(personal)
    personaliser.run(max_steps=10)
    assert recorder.of("retain_empty") and "retain" not in recorder.of("evaluated")[0]  # nothing to guard with

    recorder = Recorder()
    guarded = Personaliser(tmp_path / "guarded", "mlp-digits", on_event=recorder, **settings)
    guarded.add_many(personal)
    guarded.add_retain([(features[i].tolist(), int(labels[i])) for i in range(400, 600)])
    result = guarded.run(max_steps=10)
    rejected = recorder.of("rejected")[0]
    assert result.promoted == [] and rejected["reason"] == "forgetting"
    assert rejected["metric"] == "accuracy" and rejected["value"] > rejected["reference"] + rejected["margin"]
    assert rejected["retain_worsened"] == pytest.approx(rejected["retain_base"] - rejected["retain"])
    assert rejected["retain_worsened"] > 0.05
    with pytest.raises(WrongKindError):
        guarded.add_retain(["text is not a digit"])


@pytest.mark.parametrize("options, named", [
    (dict(retain_margin=float("nan")), "retain_margin"), (dict(retain_margin=-0.1), "retain_margin"),
    (dict(retain_margin="5%"), "retain_margin"), (dict(replay=1.0), "replay"), (dict(replay=-0.5), "replay"),
    (dict(retain_prompts="one prompt"), "retain_prompts"), (dict(retain_prompts=["", "x"]), "retain_prompts"),
    (dict(retain_prompts=[]), "retain_prompts")])
def test_bad_guard_settings_are_refused_by_name_before_anything_is_written(tmp_path, options, named):
    with pytest.raises(PersonaliseError, match=named):
        Personaliser(tmp_path / "store", "tiny", **options)
    assert not (tmp_path / "store").exists()


def test_worsened_by_reads_perplexity_as_a_fraction_and_accuracy_in_points():
    assert worsened_by(False, 105.0, 100.0) == pytest.approx(0.05)
    assert worsened_by(False, 90.0, 100.0) == pytest.approx(-0.1)
    assert worsened_by(True, 0.8, 0.9) == pytest.approx(0.1)
    assert worsened_by(True, 0.95, 0.9) == pytest.approx(-0.05)


def test_the_cli_adds_general_examples_runs_with_the_guard_and_shows_both_scores_for_every_version(tmp_path, capsys):
    from edgetrain.cli import main

    def run(*argv: str) -> tuple[int, str]:
        code = main(["personalise", *argv])
        return code, capsys.readouterr().out

    store = str(tmp_path / "store")
    notes, general = tmp_path / "notes.jsonl", tmp_path / "general.jsonl"
    notes.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_texts(40)))
    general.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_texts(12, start=200)))
    assert run("add", "--store", store, str(notes))[0] == 0
    code, out = run("add", "--store", store, "--retain", str(general))
    assert code == 0 and len(out.split()) == 12
    assert run("status", "--store", store, "--json")[1] and Personaliser(store).status()["examples"] == 40
    code, out = run("run", "--store", store, "--model", "tiny", "--max-steps", "6", "--seq", "32", "--window-steps",
                    "6", "--lr", "5e-3", "--holdout-every", "4", "--threads", "1", "--retain-margin", "0.05")
    assert code == 0 and json.loads(out)["promoted"] == [1]
    status = json.loads(run("status", "--store", store, "--json")[1])
    version = status["versions"][0]
    assert version["value"] < version["reference"] and version["retain"] <= version["retain_base"] * 1.05
    assert status["guard"]["app_examples"] == 12 and status["guard"]["base"] == pytest.approx(version["retain_base"])
    text = run("status", "--store", store)[1]
    assert f"retain set {version['retain']:.4g} (base {version['retain_base']:.4g})" in text
    assert "12 general examples" in text


def test_a_pause_while_the_retain_set_is_made_stops_it_within_a_token_and_the_next_run_makes_it(tmp_path,
                                                                                                   monkeypatch):
    from edgetrain.personalise.kinds import DecoderKind

    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder)
    personaliser.add_many(english_texts(40))
    real = DecoderKind.retain_answers
    tokens_after_pause = []

    def paused_midway(self, model, prompts, max_new_tokens, interrupted):
        personaliser.pause(wait=False)  # the app takes the device back while the base model answers

        def counting() -> bool:
            stop = interrupted()
            tokens_after_pause.append(stop)
            return stop

        return real(self, model, prompts, max_new_tokens, counting)

    monkeypatch.setattr(DecoderKind, "retain_answers", paused_midway)
    result = personaliser.run(max_steps=6)
    assert result.reason == "paused" and result.steps == 0 and tokens_after_pause == [True]
    assert not recorder.of("retain_built") and not (tmp_path / "retain" / "answers.jsonl").exists()
    monkeypatch.setattr(DecoderKind, "retain_answers", real)
    personaliser.resume()
    result = personaliser.run(max_steps=6)
    assert result.steps == 6 and len(recorder.of("retain_built")) == 1


def test_a_decoder_store_replays_a_quarter_by_default_while_guarded_and_none_otherwise(tmp_path):
    from edgetrain.personalise.retain import DEFAULT_REPLAY

    recorder = Recorder()
    # The guard's default margin, and no replay named (the kit's fast settings turn the guard off).
    personaliser = make(tmp_path / "defaults", on_event=recorder, threads=1, retain_margin=0.05)
    assert personaliser.replay == DEFAULT_REPLAY["lm"] == 0.25
    assert personaliser.status()["guard"] == {**personaliser.status()["guard"], "retain_margin": 0.05, "replay": 0.25}
    personaliser.add_many(english_texts(40))
    personaliser.run(max_steps=6)
    window = recorder.of("window")[0]
    answers = len((tmp_path / "defaults" / "retain" / "answers.jsonl").read_text().splitlines())
    assert window["replayed"] == answers // 2 > 0  # half the set is replayed, the other half scored
    assert make(tmp_path / "unguarded", retain_margin=None).replay == 0.0  # nothing asks to keep the retain set
    assert make(tmp_path / "explicit", retain_margin=0.05, replay=0.0).replay == 0.0  # the app's choice wins
    assert Personaliser(tmp_path / "plain", "tiny").replay == 0.25  # Personaliser(store, model): guard and replay
    assert Personaliser(tmp_path / "classifier", "mlp-digits").replay == 0.0
    assert Personaliser(tmp_path / "unbound").replay == 0.0  # no model yet: nothing to replay for


def test_a_rejection_for_forgetting_says_which_setting_would_help_in_the_event_status_and_cli(tmp_path, capsys):
    from edgetrain.cli import main

    recorder = Recorder()
    personaliser = _guarded(tmp_path, recorder, lr=0.2, replay=0.25)
    personaliser.add_many(NARROW)
    personaliser.run(max_steps=6)
    rejected = recorder.of("rejected")[0]
    assert rejected["reason"] == "forgetting"
    assert "replay=0.5" in rejected["advice"] and "--replay 0.5" in rejected["advice"]
    assert "--lr 0.1" in rejected["advice"] and "--retain-margin 0.1" in rejected["advice"]
    gate = personaliser.status()["last_gate"]
    assert gate["event"] == "rejected" and gate["advice"] == rejected["advice"]
    assert gate["retain_worsened"] == rejected["retain_worsened"]
    personaliser.close()
    assert main(["personalise", "status", "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "last gate: window 1 rejected (forgetting)" in out and f"to help: {rejected['advice']}" in out


def test_forgetting_advice_raises_replay_up_to_half_then_names_the_gentler_settings():
    from edgetrain.personalise.retain import forgetting_advice

    assert forgetting_advice("lm", 0.0, 1e-3, 0.05).startswith("replay more of the retain set (replay=0.25")
    assert "replay=0.5," in forgetting_advice("lm", 0.3, 1e-3, 0.05)
    at_ceiling = forgetting_advice("lm", 0.5, 1e-3, 0.05)
    assert "replay" not in at_ceiling and at_ceiling.startswith("train more gently (lr=0.0005")
    assert forgetting_advice("classify", 0.0, 1e-2, 0.05).startswith("add general examples")
    assert "retain_margin=0.05" in forgetting_advice("lm", 0.25, 1e-3, 0.0)  # a zero margin cannot be doubled
