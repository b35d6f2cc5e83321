"""Which base model a store personalises: the first Personaliser given a model binds the store to it (with
its method, kind, LoRA config and held-out split), every later one is checked against that record, and the
base model loads with the same weights in every process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edgetrain.backends.load_options import LoadOptions
from edgetrain.personalise.errors import BadExampleError, ModelMismatchError, PersonaliseError, StoreBusyError, \
    WrongKindError
from edgetrain.personalise.examples import ModelKind, example_from_body
from edgetrain.personalise.kinds import ClassifierKind, DecoderKind
from edgetrain.personalise.store import Store

BASE = "base"


def model_key(model: str | Path) -> str:
    """How the store remembers a base model: a path as an absolute path, a name as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def check_holdout_every(holdout_every: int | None) -> None:
    if holdout_every is not None and (isinstance(holdout_every, bool) or not isinstance(holdout_every, int)
                                      or holdout_every < 2):
        raise PersonaliseError(f"holdout_every must be a whole number >= 2, got {holdout_every!r}")


def bound_load_options(directory: Path, bound: dict[str, Any]) -> LoadOptions:
    """How the store's base is held (a store from before the options were recorded: the default)."""
    return LoadOptions.from_record(bound.get("load"), f"store {directory}")


def check_bound(directory: Path, bound: dict[str, Any], model: str | Path | None, method: str | None,
                holdout_every: int | None, load: LoadOptions | None = None) -> None:
    """ModelMismatchError when what was asked for is not what the store in `directory` was bound to."""
    if model is not None and model_key(model) != bound["name"]:
        raise ModelMismatchError(f"store {directory} personalises {bound['name']!r}, not "
                                 f"{model_key(model)!r}: use another store for another base model")
    if method is not None and method != bound["method"]:
        raise ModelMismatchError(f"store {directory} trains with method {bound['method']!r}, not "
                                 f"{method!r} (its checkpoints and versions are that method's)")
    if holdout_every is not None and holdout_every != bound["holdout_every"]:
        raise ModelMismatchError(f"store {directory} holds out one example in {bound['holdout_every']}; "
                                 f"holdout_every={holdout_every} would train on held-out examples")
    held = bound_load_options(directory, bound)
    if load is not None and load != held:
        raise ModelMismatchError(f"store {directory} holds its base {held.describe()}, not {load.describe()}: every "
                                 "window and served model uses the base the store was created with")


def check_method(backend_name: str, method: str) -> None:
    from edgetrain.backends import get_backend

    get_backend(backend_name).require().method_registry().get(method)  # an unknown one says which exist


def make_kind(kind: ModelKind, backend_name: str, seq_len: int, chat_template: str | None) -> Any:
    """What trains a model of `kind` (edgetrain.personalise.kinds)."""
    from edgetrain.backends import get_backend

    if kind.task == "lm":
        return DecoderKind(get_backend(backend_name), seq_len=seq_len, chat_template=chat_template)
    return ClassifierKind(kind)


def load_base(name: str, backend_name: str, seed: int, load: LoadOptions) -> Any:
    """The base model, the same weights in every process (presets are random init: seeded), held as `load`
    says (a GGUF's 4- and 8-bit weights packed by default)."""
    import torch

    import edgetrain

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return edgetrain.load_model(name, backend=backend_name, options=load)


def bind(store: Store, directory: Path, model: str | Path, loaded: Any, kind: ModelKind, trainer: Any, *,
         method: str | None, holdout_every: int | None, lora: dict[str, Any], backend_name: str,
         load: LoadOptions, seed: int = 0) -> None:
    """Bind the store to `model` (`loaded`, trained by `trainer`): check the method, add the adapters, save
    the base a window starts from and record the binding, provided every example in the store suits the kind."""
    method = method or trainer.default_method
    check_method(backend_name, method)
    lora = lora if kind.task == "lm" else None
    from edgetrain.backends import get_backend
    from edgetrain.files.atomic import make_directory

    # The adapters' random init is the base every window from the base starts with: seeded, so that the same
    # seed gives the same store in any process, whatever drew random numbers before.
    get_backend(backend_name).make_engine().seed(seed)
    trainer.prepare(loaded, lora or {})
    base = directory / BASE / trainer.version_file
    make_directory(base.parent, "the store's base adapter directory")
    trainer.save(loaded, base)
    record = {"name": model_key(model), "method": method, "kind": kind.to_dict(), "lora": lora,
              "holdout_every": holdout_every or 5, "created_backend": backend_name, "load": load.to_record(),
              "base": str(base.relative_to(directory))}
    with store.transaction() as connection:
        if store.get_meta("model", None, connection) is not None:
            raise StoreBusyError(f"store {directory} was bound to a model by another process meanwhile")
        wrong = []
        for _, example, _, body in store.rows(connection=connection):
            try:
                kind.check(example_from_body(body))
            except BadExampleError as exc:
                wrong.append(f"{example} ({exc})")
        for example, body in store.retain_rows(connection):
            try:
                kind.check(example_from_body(body))
            except BadExampleError as exc:
                wrong.append(f"{example} (retain set: {exc})")
        if wrong:
            raise WrongKindError(f"store {directory} holds {len(wrong)} example(s) that {kind.describe()} "
                                 f"cannot learn from: {'; '.join(wrong[:5])}; forget them first")
        store.set_meta("model", record, connection)
