"""What differs between a decoder and a classifier being personalised: the examples it trains on, how they
become batches, the held-out metric that gates promotion, and the weights a version keeps.

- decoder (model.task == "lm"): LoRA adapters on the frozen base; text and chat examples, through
  edgetrain's JSONL stream (chats rendered with the model's chat template, the loss on assistant turns
  only); metric: held-out perplexity, lower is better, `margin` a fraction (0.02 = at least 2% lower).
  A version is the backend's adapter file (torch: edgetrain's .safetensors; MLX: an mlx-lm directory),
  which edgetrain.adapters.convert turns into PEFT, mlx-lm or GGUF adapters.
- classifier (model.task == "classify"): every weight trains (methods bp, fgd, ...); (input, label)
  examples; metric: held-out accuracy, higher is better, `margin` in accuracy points (0.02 = 2 points).
  A version is the model's weights (a checksummed .safetensors file).

A window's examples are written to a JSON Lines snapshot when the window opens, so a resumed window trains
on exactly the batches it would have had without the crash, whatever was added or dropped meanwhile.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from edgetrain.data.batch import Batch
from edgetrain.data.indexed import seeded_permutation
from edgetrain.personalise.errors import ModelMismatchError, PersonaliseError
from edgetrain.personalise.examples import Example, ModelKind
from edgetrain.registry import EdgetrainError
from edgetrain.training.checkpoint import atomic_write_file


class NotEnoughData(PersonaliseError):
    """Too few examples (or tokens) for one batch, or no held-out example to judge a candidate by."""


def model_kind(model: Any) -> ModelKind:
    """What `model` learns from, read off the model."""
    task = getattr(model, "task", None)
    if task == "lm":
        return ModelKind("lm")
    if task == "classify":
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "vocab_size"):
            raise PersonaliseError(f"{type(model).__name__} classifies token sequences; the personaliser takes "
                                   "classifiers of numeric inputs and decoders")
        from edgetrain.models.zoo import example_input

        shape = tuple(example_input(model, 1, 1).shape[1:])
        classes = getattr(config, "num_classes", None) or getattr(getattr(model, "head", None), "out_features", None)
        return ModelKind("classify", features=math.prod(shape), num_classes=classes)
    raise PersonaliseError(f"{type(model).__name__} is neither a decoder (task 'lm') nor a classifier "
                           "(task 'classify'): the personaliser cannot train it")


def write_snapshot(records: Iterable[dict[str, Any]], path: Path) -> Path:
    """The window's examples as JSON Lines, written atomically."""
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    return atomic_write_file(path, lambda tmp: tmp.write_text(lines, encoding="utf-8"))


def read_snapshot(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class RowSampler:
    """Batches of `batch_size` rows drawn from `rows(i) -> Batch` (one row each) in a seeded per-epoch shuffle:
    batch k is a pure function of (rows, batch_size, seed, k), so a resumed window trains on the same ones."""

    def __init__(self, rows: Any, count: int, batch_size: int, seed: int) -> None:
        self.rows, self.count, self.seed = rows, count, seed
        self.batch_size = max(1, min(batch_size, count))
        self.per_epoch = count // self.batch_size

    def batch(self, index: int) -> Batch:
        import torch

        epoch, within = divmod(index, self.per_epoch)
        order = seeded_permutation(self.count, self.seed, epoch)[within * self.batch_size:(within + 1) * self.batch_size]
        parts = [self.rows(int(row)) for row in order]
        return Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]), index)


class ReplaySampler:
    """A window's batches with a fraction `replay` of them from the retain set: batch k is a replay batch
    when floor((k + 1) * replay) > floor(k * replay), so the replay batches are spread evenly, exactly that
    fraction of any window, and batch k stays a pure function of k (a resumed window gets the same ones)."""

    def __init__(self, user: RowSampler, retain: RowSampler, replay: float) -> None:
        self.user, self.retain, self.replay = user, retain, replay

    def batch(self, index: int) -> Batch:
        replayed_before = math.floor(index * self.replay)
        if math.floor((index + 1) * self.replay) > replayed_before:
            batch = self.retain.batch(replayed_before)
        else:
            batch = self.user.batch(index - replayed_before)
        return Batch(batch.inputs, batch.targets, index)


class DecoderKind:
    """LoRA on a decoder (see the module docstring)."""

    metric = "perplexity"
    higher_is_better = False
    # MeSP: bp's exact gradients in the least memory (no whole-batch logits, block inputs kept only) -- what a
    # device personalising in the background needs; mebp's autograd step held 4x more on SmolLM2.
    default_method = "mesp"

    def __init__(self, backend: Any, *, seq_len: int, chat_template: str | None) -> None:
        self.backend = backend  # the Backend registry entry: its adapter functions and file layout
        self.seq_len = seq_len
        self.chat_template = chat_template

    @property
    def version_file(self) -> str:
        return "adapter" if self.backend.adapter_is_directory else "adapter.safetensors"

    answers_prompts = True  # its retain set is the base's answers to general prompts (edgetrain.personalise.retain)

    def prepare(self, model: Any, lora: dict[str, Any]) -> None:
        from edgetrain.models.lora import LoraConfig

        add_lora, _ = self.backend.adapter_functions()
        add_lora(model, LoraConfig(**lora))

    def save(self, model: Any, path: Path) -> Path:
        _, save_adapter = self.backend.adapter_functions()
        return save_adapter(model, path)

    def load(self, model: Any, path: Path) -> None:
        self.backend.load_adapter(model, path)

    def records(self, model: Any, examples: Sequence[Example]) -> tuple[list[dict], list[tuple[str, str]]]:
        """(training records, [(id, why)] of examples left out): chats need a chat template that renders them."""
        from edgetrain.data.chat_template import ChatTemplateError, chat_template_for
        from edgetrain.data.tokenizer import model_tokenizer

        template, template_error = None, ""
        if any(e.kind == "chat" for e in examples):
            try:
                template = chat_template_for(model_tokenizer(model), self.chat_template)
            except EdgetrainError as exc:
                template_error = str(exc)
            if template is None and not template_error:
                template_error = ("the model's tokenizer has no chat template (pass chat_template= to the "
                                  "Personaliser)")
        records, skipped = [], []
        for example in examples:
            record = example.record()
            if example.kind == "chat":
                if template is None:
                    skipped.append((example.id, template_error))
                    continue
                try:
                    template.assistant_spans(record["messages"])
                except ChatTemplateError as exc:
                    skipped.append((example.id, str(exc)))
                    continue
            records.append(record)
        return records, skipped

    def retain_answers(self, model: Any, prompts: Sequence[str], max_new_tokens: int,
                       interrupted: Callable[[], bool]) -> list[dict[str, Any]]:
        """The model's greedy answers to `prompts` as records: chats in its chat template when it has one
        (scored on the answer alone), else the answer as a text record. Answers with nothing to score are left out."""
        from edgetrain.data.chat_prompt import chat_prompt, text_prompt
        from edgetrain.data.chat_template import chat_template_for
        from edgetrain.data.jsonl_stream import padding_id
        from edgetrain.data.tokenizer import model_tokenizer
        from edgetrain.models.generate_batch import answer_ids

        tokenizer = model_tokenizer(model)
        chat = chat_template_for(tokenizer, self.chat_template) is not None
        starts = [chat_prompt(tokenizer, [{"role": "user", "content": p}], self.chat_template) if chat
                  else text_prompt(tokenizer, f"{p}\n") for p in prompts]
        answers = answer_ids(model, [start.ids for start in starts], max_new_tokens,
                             stop_ids=set().union(*(start.stop_ids for start in starts)),
                             pad_id=padding_id(tokenizer), interrupted=interrupted)
        answers = [cut_at_stop(ids, start.stop_sequences) for ids, start in zip(answers, starts)]
        records = []
        for prompt, ids in zip(prompts, answers):
            answer = tokenizer.decode(ids)
            if chat and answer.strip():  # templates trim a message's content: keep what the model will see
                records.append({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer.strip()}]})
            elif not chat and len(ids) >= 2:  # a text record needs two tokens for one target
                records.append({"text": answer})
        return records

    def _rows(self, model: Any, path: Path, epochs: int | None):
        from edgetrain.data.jsonl_stream import JsonlStream
        from edgetrain.data.tokenizer import model_tokenizer

        try:
            return JsonlStream([path], seq_len=self.seq_len, batch_size=1, tokenizer=model_tokenizer(model),
                               vocab_size=model.config.vocab_size, chat_template=self.chat_template,
                               shuffle=False, epochs=epochs)
        except EdgetrainError as exc:
            if "too few for one batch" in str(exc):
                raise NotEnoughData(f"the examples hold too few tokens for one window of {self.seq_len}") from None
            raise

    def train_batches(self, model: Any, path: Path, batch_size: int, seed: int) -> RowSampler:
        rows = self._rows(model, path, epochs=None)
        return RowSampler(rows.batch, rows.windows, batch_size, seed)

    def eval_batches(self, model: Any, path: Path, rows_per_batch: int = 16) -> list[Batch]:
        import torch

        rows = list(self._rows(model, path, epochs=1))
        return [Batch(torch.cat([r.inputs for r in rows[i:i + rows_per_batch]]),
                      torch.cat([r.targets for r in rows[i:i + rows_per_batch]]), n)
                for n, i in enumerate(range(0, len(rows), rows_per_batch))]

    def step_estimate(self, model: Any, batch: Batch, method: str) -> int | None:
        from edgetrain.training.step_estimates import estimate_step_bytes

        try:
            return estimate_step_bytes(model, batch, method)
        except (AttributeError, TypeError):  # a model these estimates do not cover (another framework's)
            return None


class ClassifierKind:
    """Full fine-tuning of a classifier of numeric inputs (see the module docstring)."""

    metric = "accuracy"
    higher_is_better = True
    default_method = "bp"
    version_file = "weights.safetensors"
    answers_prompts = False  # its retain set is the general examples the app adds

    def __init__(self, kind: ModelKind) -> None:
        self.kind = kind

    def prepare(self, model: Any, lora: dict[str, Any]) -> None:
        pass

    def save(self, model: Any, path: Path) -> Path:
        from edgetrain.training.checkpoint import atomic_save_safetensors

        return atomic_save_safetensors(dict(model.state_dict()), path, {"format": "edgetrain-personalise-weights"})

    def load(self, model: Any, path: Path) -> None:
        import torch

        from edgetrain.training.checkpoint import load_safetensors_checked

        tensors, _ = load_safetensors_checked(path)
        own = model.state_dict()
        if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
            raise ModelMismatchError(f"{path}: its weights do not fit this model")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(tensors[name])

    def records(self, model: Any, examples: Sequence[Example]) -> tuple[list[dict], list[tuple[str, str]]]:
        return [example.record() for example in examples], []

    def _arrays(self, model: Any, path: Path):
        import torch

        from edgetrain.models.zoo import example_input

        records = read_snapshot(path)
        if not records:
            raise NotEnoughData("no examples")
        shape = tuple(example_input(model, 1, 1).shape[1:])
        features = torch.tensor([r["input"] for r in records], dtype=torch.float32).reshape(len(records), *shape)
        return features, torch.tensor([r["label"] for r in records], dtype=torch.long)

    def train_batches(self, model: Any, path: Path, batch_size: int, seed: int) -> RowSampler:
        features, labels = self._arrays(model, path)
        return RowSampler(lambda i: Batch(features[i:i + 1], labels[i:i + 1], i), len(labels), batch_size, seed)

    def eval_batches(self, model: Any, path: Path) -> list[Batch]:
        features, labels = self._arrays(model, path)
        return [Batch(features[i:i + 256], labels[i:i + 256], n) for n, i in enumerate(range(0, len(labels), 256))]

    def step_estimate(self, model: Any, batch: Batch, method: str) -> int | None:
        return None


def cut_at_stop(ids: list[int], stop_sequences: Sequence[Sequence[int]]) -> list[int]:
    """`ids` up to the first of `stop_sequences` (an end of turn the tokenizer spells in several tokens)."""
    for sequence in stop_sequences:
        for at in range(len(ids) - len(sequence) + 1):
            if ids[at:at + len(sequence)] == list(sequence):
                ids = ids[:at]
                break
    return ids


def gate(metric_higher_is_better: bool, candidate: float, reference: float, margin: float) -> tuple[bool, float]:
    """(promote?, by how much the candidate is better: a fraction of the reference for perplexity, accuracy
    points for accuracy; negative when worse). Promoted only when better by more than `margin`."""
    if metric_higher_is_better:
        better = candidate - reference
    else:
        better = (reference - candidate) / reference if reference > 0 else 0.0
    return better > margin, better
