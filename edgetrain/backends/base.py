"""Backend adapters: where tensors live and how to wait for the device (edgetrain.probes picks the
probe that reads its memory).

Kept deliberately small (what a method needs stays in that method)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from edgetrain.registry import EdgetrainError, Registry


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str                      # "torch" or "mlx": which model classes it runs
    device: str                         # framework device string
    synchronize: Callable[[], None]     # wait for queued device work (timing must not stop early)
    availability: Callable[[], tuple[bool, str]]
    probe: Callable[[], str]            # the name of the memory probe that reads what this backend uses
    # What differs by framework, as "module:attribute": imported only when used, so that registering a
    # backend never imports its framework. Callers ask the entry; nothing else compares backend names.
    engine: str = "edgetrain.backends.torch.engine:TorchEngine"  # its tensor work (edgetrain.training.engine)
    loader: str = "edgetrain.models:load_torch_model"   # (name_or_path, dtype, device) -> model
    methods: str = "edgetrain.methods:METHODS"          # the registry of methods this framework runs
    profiler: str = "edgetrain.profiler.worker:profile_torch_method"  # ProfileConfig -> record
    add_lora: str = "edgetrain.models.lora:add_lora"    # (model, rank=..., ...) -> model with LoRA
    save_adapter: str = "edgetrain.models.lora:save_lora"  # (model, path): write the LoRA adapter
    adapter_loader: str = "edgetrain.adapters.convert:load_adapter"  # (model, path): any adapter format
    adapter_is_directory: bool = False                  # save_adapter writes a directory, not one file
    quantized_base: bool = False                        # can hold the frozen base in 4/8 bits (--quantize-bits)
    # (model, bits): quantise a loaded model's base (load_model(quantize_bits=...)); None where it cannot
    quantizer: str | None = "edgetrain.models.quantize:quantize_base"
    loader_quantizes: bool = False   # its loader takes quantize_bits (block by block: never all weights dense)
    # (path, dtype, device): a GGUF with its 4/8-bit matrices kept as stored (load_model's default for a
    # GGUF; `loader` dequantises one); None where a backend cannot keep them packed
    packed_gguf_loader: str | None = "edgetrain.models.gguf:load_packed_gguf"
    loads_gguf: bool = True                             # its loader reads llama.cpp GGUF files
    reads_text_out: bool = True                         # text_out runs its models (generate, eval)
    # The module with generate_ids / generate / held_out_loss for this framework's models (the signatures
    # of edgetrain.models.generate, which hands a model of another framework to its backend's module).
    text_out: str = "edgetrain.models.generate"

    def make_engine(self) -> Any:
        """A new engine (edgetrain.training.engine) for one learner on this backend's device."""
        return _resolve(self.engine)(self.device)

    def load_model(self, name_or_path: Any, dtype: Any, device: Any, **options: Any) -> Any:
        return _resolve(self.loader)(name_or_path, dtype=dtype, device=device, **options)

    def quantize(self, model: Any, bits: int) -> Any:
        if self.quantizer is None:
            raise EdgetrainError(f"backend {self.name!r} quantises its base in its own loader, not after loading")
        return _resolve(self.quantizer)(model, bits)

    def load_packed_gguf(self, path: Any, dtype: Any, device: Any) -> Any:
        if self.packed_gguf_loader is None:
            raise EdgetrainError(f"backend {self.name!r} cannot keep a GGUF's 4- and 8-bit weights packed: load it "
                                 "with --dequantize (LoadOptions(dequantize=True))")
        return _resolve(self.packed_gguf_loader)(path, dtype=dtype, device=device)

    def method_registry(self) -> Any:
        return _resolve(self.methods)

    def profile_method(self, config: Any) -> dict[str, Any]:
        return _resolve(self.profiler)(config)

    def load_adapter(self, model: Any, path: Any) -> Any:
        return _resolve(self.adapter_loader)(model, path)

    def adapter_functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """(add_lora, save_adapter) for this framework's models."""
        return _resolve(self.add_lora), _resolve(self.save_adapter)

    def text_functions(self) -> ModuleType:
        """The module that generates text with and evaluates this framework's models (see text_out)."""
        return importlib.import_module(self.text_out)

    def require(self) -> "Backend":
        ok, reason = self.availability()
        if not ok:
            raise EdgetrainError(f"backend {self.name!r} is not available here: {reason}")
        return self


BACKENDS: Registry[Backend] = Registry("backend")
# Names that mean a backend: "torch" is torch on the CPU unless a device says otherwise.
BACKEND_ALIASES = {"torch": "torch-cpu"}
DEFAULT_BACKEND = "torch-cpu"  # what runs everywhere: the learner's and the CLI's default


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def get_backend(name: str) -> Backend:
    return BACKENDS.get(name).require()


def model_framework(model: Any) -> str:
    """The framework of `model`: a model of another framework than torch names it in its `framework`
    attribute (MLX's decoder does); one that names none is a torch model."""
    framework = getattr(model, "framework", None)
    return framework if isinstance(framework, str) else BACKENDS.get(DEFAULT_BACKEND).framework


def text_functions_for(model: Any) -> ModuleType:
    """The text module (Backend.text_out) of the backends that run `model`'s framework, which the model
    names in its `framework` attribute (a model of another framework than torch carries one)."""
    framework = getattr(model, "framework", None)
    for name in BACKENDS.names():
        entry = BACKENDS.get(name)
        if entry.framework == framework and entry.reads_text_out:
            return entry.require().text_functions()
    raise EdgetrainError(f"no backend generates text with a {type(model).__name__}"
                         + (f" (framework {framework!r})" if framework else ""))


def backend_for_model(model: Any) -> Backend | None:
    """The first backend of the framework a model of another framework than torch names in its
    `framework` attribute (None for a torch model, which carries none)."""
    framework = getattr(model, "framework", None)
    if not isinstance(framework, str):
        return None
    for name in BACKENDS.names():
        entry = BACKENDS.get(name)
        if entry.framework == framework:
            return entry.require()
    raise EdgetrainError(f"no backend runs a {type(model).__name__} (framework {framework!r})")
