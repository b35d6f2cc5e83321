"""ExecuTorch training export and its Python runtime. EVERY experimental ExecuTorch call lives in this file.

Pinned to executorch==1.5.1 (the `export` extra): `_export_forward_backward`, the training pybindings
(`_load_for_executorch_for_training_from_buffer`, `get_sgd_optimizer`) and the `__et_training_*` method
names are experimental upstream and change between releases.

Export is four calls on the loss-inside module (edgetrain.export.trainable.LossModule):
    torch.export.export -> _export_forward_backward -> to_edge -> to_executorch
The resulting `forward` method returns [loss, gradients..., parameters...]; the methods
`__et_training_gradients_index_forward` / `__et_training_parameters_index_forward` give where the
gradients and the parameters start, `__et_training_fqn_forward` their names. The parameter outputs alias
the program's weights, so an optimizer that writes them in place trains the program (what
targets/executorch/runner.cpp does without Python).
"""
from __future__ import annotations

import operator
import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgetrain.registry import Registry
from edgetrain.files.space import check_free_space, tensor_bytes
from edgetrain.training.checkpoint import atomic_write_bytes
from edgetrain.utils.logs import get_logger
from edgetrain.utils.progress import stage_progress
from edgetrain.data.batch import Batch
from edgetrain.export.trainable import (BatchSignature, ExportError, LossModule, require, strip_prefix,
                                        trainable_names)

EXECUTORCH_VERSION = "1.5.1"
METHOD = "forward"
_log = get_logger(__name__)


def _require_executorch() -> None:
    require("executorch.exir", "ExecuTorch export")
    version = getattr(require("executorch.version", "ExecuTorch export"), "__version__", "?")
    if not str(version).startswith(EXECUTORCH_VERSION):
        warnings.warn(f"edgetrain's ExecuTorch export is tested with executorch=={EXECUTORCH_VERSION}, "
                      f"found {version}; its training APIs are experimental and change between releases")


# A rewrite of one node: given the node and `add(target, args, kwargs=None)` (a new node before it, with its
# metadata), the node that replaces it, or None to leave it.
NodeRewrite = Callable[[torch.fx.Node, Callable[..., torch.fx.Node]], "torch.fx.Node | None"]


def _rewrite_nodes(graph_module: torch.fx.GraphModule, target: object, rewrite: NodeRewrite) -> int:
    """Apply `rewrite` to every call of `target`; inputs left without users (and without side effects) go too.
    Returns how many nodes were replaced."""
    graph = graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != target:
            continue

        def add(op: object, args: tuple, kwargs: dict | None = None, node: torch.fx.Node = node) -> torch.fx.Node:
            created = graph.call_function(op, args, kwargs or {})
            created.meta = dict(node.meta)
            return created

        with graph.inserting_before(node):
            replacement = rewrite(node, add)
        if replacement is None:
            continue
        inputs = node.all_input_nodes
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        for dead in inputs:
            if dead.op == "call_function" and not dead.users and not dead.is_impure():
                graph.erase_node(dead)
        replaced += 1
    if replaced:
        graph.lint()
        graph_module.recompile()
    return replaced


def _empty_then_permute(node: torch.fx.Node, add: Callable[..., torch.fx.Node]) -> torch.fx.Node:
    size, physical_layout = node.args[0], node.args[1]
    inverse = [0] * len(physical_layout)
    for position, dim in enumerate(physical_layout):
        inverse[dim] = position
    empty = add(torch.ops.aten.empty.memory_format, ([size[i] for i in physical_layout],),
                {k: v for k, v in node.kwargs.items() if k != "memory_format"})
    return empty if inverse == list(range(len(inverse))) else add(torch.ops.aten.permute.default, (empty, inverse))


def _replace_empty_permuted(graph_module: torch.fx.GraphModule) -> int:
    """aten.empty_permuted (emitted by SiLU's backward decomposition) is not in the Core ATen opset
    that ExecuTorch lowers; rewrite it as empty in the physical order + permute back (same values)."""
    return _rewrite_nodes(graph_module, torch.ops.aten.empty_permuted.default, _empty_then_permute)


def _mm_plus_bias(node: torch.fx.Node, add: Callable[..., torch.fx.Node]) -> torch.fx.Node:
    aten = torch.ops.aten
    bias, left, right = node.args[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    product = add(aten.mm.default, (left, right))
    # mul.Tensor with a number, not mul.Scalar: XNNPACK takes the first (a LoRA product's scale), ExecuTorch's
    # portable kernel runs the second.
    if alpha != 1:
        product = add(aten.mul.Tensor, (product, alpha))
    if beta != 1:
        bias = add(aten.mul.Tensor, (bias, beta))
    return add(aten.add.Tensor, (bias, product))


def _split_addmm(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite aten.addmm(bias, a, b, beta, alpha) as beta * bias + alpha * mm(a, b): ExecuTorch's optimized
    CPU kernels have mm (a BLAS-style GEMM) but no addmm, whose portable kernel is a plain triple loop."""
    return _rewrite_nodes(graph_module, torch.ops.aten.addmm.default, _mm_plus_bias)


def _linear_if_transposed(node: torch.fx.Node, add: Callable[..., torch.fx.Node]) -> torch.fx.Node | None:
    left, right = node.args
    if not (isinstance(right, torch.fx.Node) and right.op == "call_function"
            and right.target == torch.ops.aten.permute.default and list(right.args[1]) == [1, 0]):
        return None
    return add(torch.ops.aten.linear.default, (left, right.args[0]))


def _linear_for_transposed_products(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite mm(a, permute(w, [1, 0])) as linear(a, w): ExecuTorch's edge dialect turns every permute into a
    permute_copy, which copied a whole weight matrix before each product (a quarter of a SmolLM2 block's
    backward), while its optimized linear kernel reads w as stored."""
    return _rewrite_nodes(graph_module, torch.ops.aten.mm.default, _linear_if_transposed)


def _same_as_input(node: torch.fx.Node, add: Callable[..., torch.fx.Node]) -> torch.fx.Node | None:
    source = node.args[1] if node.target == torch.ops.aten.copy.default else node.args[0]
    value, result = getattr(source, "meta", {}).get("val"), node.meta.get("val")
    # Only an operator's result: a method input passed through to an output would alias the two.
    if (not isinstance(source, torch.fx.Node) or source.op != "call_function" or value is None or result is None
            or value.shape != result.shape or value.dtype != result.dtype):
        return None
    if value.stride() == result.stride():
        return source
    if node.target == torch.ops.aten.copy.default and result.is_contiguous():
        # A permuted view copied into a contiguous buffer: a clone does that (XNNPACK's copy, where ExecuTorch's
        # own `copy` kernel goes an element at a time).
        return add(torch.ops.aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
    return None


# Operators of a functional graph that give their input unchanged when the shapes, dtypes and strides match: a
# copy into a same-shaped buffer (an in-place copy_, functionalised), an alias, an expand to the shape it has
# (from matmul's decomposition). ExecuTorch's kernels copy the whole tensor for each: three dozen copies a block
# backward.
_PASS_THROUGH_OPERATORS = (torch.ops.aten.copy.default, torch.ops.aten.alias.default, torch.ops.aten.expand.default)


def _drop_pass_through_copies(graph_module: torch.fx.GraphModule) -> int:
    """Replace each pass-through operator (_PASS_THROUGH_OPERATORS) by its input, and a copy of a strided view
    into a contiguous buffer by a clone."""
    return sum(_rewrite_nodes(graph_module, target, _same_as_input) for target in _PASS_THROUGH_OPERATORS)


def _dequantize_int8(node: torch.fx.Node, add: Callable[..., torch.fx.Node]) -> torch.fx.Node | None:
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if (value is None or value.dtype != torch.int8 or set(node.kwargs) - {"dtype", "layout", "device"}
            or node.kwargs.get("dtype") != torch.float32):
        return None
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed)

    return add(torch.ops.quantized_decomposed.dequantize_per_tensor.default, (source, 1.0, 0, -128, 127, torch.int8))


def _int8_conversions_as_dequantize(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite int8 -> float32 conversions as a dequantisation with scale 1 and zero point 0 (the same exact
    integers): XNNPACK runs that, vectorised and threaded, where ExecuTorch's own conversion goes one element at
    a time (the packed codes of every tile: edgetrain/export/mesp_graph.py, MatrixFormat.row_halves)."""
    return _rewrite_nodes(graph_module, torch.ops.aten._to_copy.default, _dequantize_int8)


def _traced_order_key(graph_module: torch.fx.GraphModule, node: torch.fx.Node, keys: dict) -> float:
    """Where `node` stood in the traced graph: to_edge numbers every operator in order (its debug handle); a
    delegate call stands where the first operator it runs stood."""
    from executorch.exir.delegate import executorch_call_delegate

    if node.op in ("placeholder", "get_attr"):
        return -1.0
    if node.target is operator.getitem:
        return keys[node.args[0]]
    if node.target is executorch_call_delegate:
        inner = getattr(graph_module, node.args[0].target).original_module.graph_module.graph.nodes
        handles = [n.meta["debug_handle"] for n in inner if n.op == "call_function" and "debug_handle" in n.meta]
        if handles:
            return float(min(handles))
    elif isinstance(node.meta.get("debug_handle"), int):
        return float(node.meta["debug_handle"])
    return max((keys[source] for source in node.all_input_nodes), default=-1.0)


def _restore_traced_order(graph_module: torch.fx.GraphModule) -> None:
    """Put a lowered method's operators back in the order they were traced in. Lowering to a delegate re-sorts
    the graph breadth-first, which hoists everything that depends only on the method's inputs (each slice of a
    packed table, its nibbles, the delegate calls on them) to the front, where all of them are alive at once:
    a SmolLM2 head's memory plan went from 53 to 223 MiB. This is a topological sort that always takes the
    ready operator traced first."""
    import heapq

    graph = graph_module.graph
    nodes = list(graph.nodes)
    keys: dict[torch.fx.Node, float] = {}
    for node in nodes:
        keys[node] = _traced_order_key(graph_module, node, keys)
    position = {node: index for index, node in enumerate(nodes)}
    waiting = {node: len(set(node.all_input_nodes)) for node in nodes}
    ready = [(keys[node], position[node], node) for node in nodes if not waiting[node]]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, _, node = heapq.heappop(ready)
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (keys[user], position[user], user))
    if len(ordered) != len(nodes):
        raise ExportError("internal: the lowered graph has a cycle")
    output = next(node for node in nodes if node.op == "output")
    for node in ordered:
        if node.op not in ("placeholder", "output"):
            output.prepend(node)
    graph.lint()
    graph_module.recompile()


def _program_operators(program) -> set[str]:
    """"aten::mm.out"-style names of every operator the serialised program calls."""
    names = set()
    for plan in program.executorch_program.execution_plan:
        for operator in plan.operators:
            names.add(f"{operator.name}.{operator.overload}" if operator.overload else operator.name)
    return names


def _check_runtime_has_kernels(program) -> None:
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    available = set(_get_operator_names())
    missing = sorted(op for op in _program_operators(program) if op not in available)
    if missing:
        raise ExportError(f"the ExecuTorch runtime has no kernel for operator(s) {', '.join(missing)} "
                          "used by this training program; change the model to avoid them or link a "
                          "kernel library that provides them")


# The integrity record the native runner checks (targets/executorch/runner.cpp): 16 bytes after the program,
# "EDGEPTE1", u32 CRC-32 of every byte before them, u32 0. A .pte has no checksum of its own, and ExecuTorch
# loads a flipped weight or operator argument without a word; it reads a .pte by the sizes in its own header,
# so it ignores these bytes.
PROGRAM_SEAL = b"EDGEPTE1"


def seal_program(data: bytes) -> bytes:
    """`data` (a .pte) with the checksum edgetrain_et_runner verifies before it loads a program."""
    return bytes(data) + PROGRAM_SEAL + struct.pack("<II", zlib.crc32(data), 0)


def export_executorch(model: nn.Module, batch: Batch, path: str | Path | None = None) -> bytes:
    """Export the joint forward-backward program of `model` (its trainable weights as set by requires_grad)
    for batches shaped like `batch`; write it to `path` (a .pte) when given and return its bytes."""
    _require_executorch()
    from executorch.exir import to_edge
    from torch._export.verifier import SpecViolationError
    from torch.export.experimental import _export_forward_backward

    trainable_names(model)
    if path is not None:
        # The program holds the model's weights as constants: a disk that cannot hold them is refused before
        # the lowering (tens of seconds to minutes) starts.
        check_free_space(path, tensor_bytes(model.parameters()), "the program")
    was_training = model.training
    model.train()
    module = LossModule(model)
    try:
        # The fused CPU attention kernels have no ExecuTorch training counterpart (their backward is not
        # Core ATen); under the math backend attention decomposes into bmm/softmax, which lower.
        with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH):
            warnings.simplefilter("ignore")
            try:
                exported = torch.export.export(module, (batch.inputs, batch.targets), strict=False)
            except Exception as exc:  # torch.export raises many types; all mean "cannot trace"
                raise ExportError(f"torch.export could not trace {type(model).__name__} for inputs "
                                  f"{tuple(batch.inputs.shape)}: {type(exc).__name__}: {exc}") from exc
            joint = _export_forward_backward(exported)
            _replace_empty_permuted(joint.graph_module)
            try:
                edge = to_edge(joint)
            except SpecViolationError as exc:
                op = _first_line_naming_operator(str(exc))
                raise ExportError(f"ExecuTorch cannot lower this training program: {op}") from exc
            program = edge.to_executorch()
    finally:
        model.train(was_training)
    _check_runtime_has_kernels(program)
    data = seal_program(program.buffer)
    if path is not None:
        atomic_write_bytes(data, path)
    return data


# What XNNPACK runs of a MeSP program: its matrix products (about 4x ExecuTorch's own mm here), and its tensor
# operators, since ExecuTorch's portable kernels index every element one by one (a permute_copy moved about 6 ns
# an element, a quarter of a SmolLM2 block's backward) where XNNPACK's are vectorised and run on its thread
# pool. What XNNPACK has no operator for (gathers, reductions other than mean, float16 -> float32 conversions)
# stays on ExecuTorch's kernels; int8 -> float32 conversions reach it as dequantisations
# (_int8_conversions_as_dequantize), and packed codes are read without integer masks (mesp_graph.MatrixFormat).
_XNNPACK_CONFIGS = ("AddmmConfig", "MMConfig", "LinearConfig", "BMMConfig", "AddConfig", "SubConfig", "MulConfig",
                    "DivConfig", "NegConfig", "PowConfig", "ExpConfig", "FloorConfig", "SigmoidConfig",
                    "ReciprocalSquareRootConfig", "MeanDimConfig", "PermuteConfig", "CatConfig", "SliceCopyConfig",
                    "CloneDimOrderConfig", "ToDimOrderCopyConfig", "DeQuantizedPerTensorConfig")


def _xnnpack_operators() -> list:
    """One delegate per operator (per_op_mode: a whole-graph partition refuses MeSP's pass-through outputs),
    products included although their weights are method inputs (XNNPACK's GEMM configs take a weight only when
    it is a constant unless forced)."""
    import executorch.backends.xnnpack.partition.config as configs
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner(configs=[getattr(configs, name) for name in _XNNPACK_CONFIGS], per_op_mode=True,
                               force_non_static_weights_for_f32_linear=True)]


@dataclass(frozen=True)
class Delegate:
    """How a program is lowered to one delegate: its partitioners, and the rewrites of the traced graphs that
    let it take more (each returns how many nodes it changed); `target` names it on the progress lines."""

    partitioners: Callable[[], list]
    rewrites: tuple[Callable[[torch.fx.GraphModule], int], ...] = ()
    target: str = "ExecuTorch's own kernels"


# --delegate name -> how a program is lowered ("none": ExecuTorch's own CPU kernels).
DELEGATES: Registry[Delegate] = Registry("ExecuTorch delegate")
DELEGATES.add("xnnpack", Delegate(_xnnpack_operators, (_int8_conversions_as_dequantize,), "XNNPACK"))
DELEGATES.add("none", Delegate(list))


def trace_for_lowering(module: nn.Module, example_inputs: tuple,
                       delegate: str = "xnnpack") -> "torch.export.ExportedProgram":
    """`module`'s forward graph as lower_methods lowers it: traced for `example_inputs`, decomposed to Core ATen,
    then rewritten for ExecuTorch's kernels (_replace_empty_permuted, _split_addmm,
    _linear_for_transposed_products, _drop_pass_through_copies) and for the delegate DELEGATES names. The
    same numbers as `module`, bit for bit."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        exported = torch.export.export(module, example_inputs, strict=False).run_decompositions()
        graph_module = exported.graph_module
        for rewrite in (_replace_empty_permuted, _split_addmm, _linear_for_transposed_products,
                        _drop_pass_through_copies, *DELEGATES.get(delegate).rewrites):
            rewrite(graph_module)
    return exported


def lower_methods(modules: dict[str, nn.Module], example_inputs: dict[str, tuple], delegate: str = "xnnpack") -> bytes:
    """One ExecuTorch program whose methods are the forward graphs of `modules` (name -> module), each traced
    for its example inputs (edgetrain/export/mesp_program.py: the pieces of a MeSP step), what the delegate
    DELEGATES names takes lowered to it, in the order traced (_restore_traced_order). Inference graphs: no joint
    forward-backward, so nothing here is experimental beyond the program format.

    Minutes for a real model (about 7 for SmolLM2 to XNNPACK), so it reports as it goes (edgetrain.utils.progress.
    stage_progress, INFO lines of this module's logger): which method it traces and lowers, and whenever 8 s pass
    without a line the time so far and an estimate of the rest from the graph nodes lowered."""
    _require_executorch()
    from torch._export.verifier import SpecViolationError

    lowering = DELEGATES.get(delegate)
    exported = _trace_methods(modules, example_inputs, delegate)
    nodes = {name: _operator_count(program) for name, program in exported.items()}
    try:
        with warnings.catch_warnings(), torch.no_grad(), stage_progress(
                f"lowering to {lowering.target}", sum(nodes.values()), unit="graph node", logger=_log) as progress:
            warnings.simplefilter("ignore")
            lowered = {}
            for number, (name, program) in enumerate(exported.items(), 1):
                progress.begin(f"{name} ({number} of {len(exported)})", nodes[name])
                lowered[name] = _lower_method(name, program, lowering.partitioners())
            progress.begin("writing the program")
            program = _executorch_program(lowered)
            _check_runtime_has_kernels(program)
            return program.buffer
    except SpecViolationError as exc:
        raise ExportError(f"ExecuTorch cannot lower this program: {_first_line_naming_operator(str(exc))}") from exc


def _trace_methods(modules: dict[str, nn.Module], example_inputs: dict[str, tuple],
                   delegate: str) -> dict[str, "torch.export.ExportedProgram"]:
    """trace_for_lowering for each module, a line as each begins (SmolLM2's block backward: tens of seconds)."""
    exported = {}
    with warnings.catch_warnings(), torch.no_grad(), stage_progress("tracing for ExecuTorch", logger=_log) as progress:
        warnings.simplefilter("ignore")
        for number, (name, module) in enumerate(modules.items(), 1):
            progress.begin(f"{name} ({number} of {len(modules)})")
            try:
                exported[name] = trace_for_lowering(module, example_inputs[name], delegate)
            except Exception as exc:  # torch.export raises many types; all mean "cannot trace"
                raise ExportError(f"torch.export could not trace the {name} program: {type(exc).__name__}: "
                                  f"{exc}") from exc
    return exported


def _operator_count(program: "torch.export.ExportedProgram") -> int:
    """The graph nodes that lowering works on (operator calls): what the progress estimate counts."""
    return sum(node.op == "call_function" for node in program.graph.nodes)


def _lower_method(name: str, exported: "torch.export.ExportedProgram",
                  partitioners: list) -> "torch.export.ExportedProgram":
    """One method in edge dialect, what `partitioners` take lowered to their delegate, in its traced order.
    to_edge_transform_and_lower decomposes and partitions each method of a program on its own; called for one
    method at a time it gives the same graphs, and progress can say which method the minutes go to."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # linear is not Core ATen, but the runtime's optimized kernels have it (see above).
    config = EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten.linear.default],
                               preserve_ops=[torch.ops.aten.linear.default])
    edge = to_edge_transform_and_lower({name: exported}, partitioner={name: partitioners}, compile_config=config)
    program = edge.exported_program(name)
    _restore_traced_order(program.graph_module)
    return program


def _executorch_program(lowered: dict[str, "torch.export.ExportedProgram"]):
    """The ExecuTorch program of methods lowered one by one (_lower_method), in the order given, emitted together
    as to_edge_transform_and_lower's own manager emits them: the bytes one call for every method writes (a test
    compares them)."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program import EdgeProgramManager

    # Each method was checked in its own lowering; its delegate calls are no edge-dialect operators, which is why
    # ExecuTorch's to_backend builds its manager without the check too.
    return EdgeProgramManager(lowered, compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch()


def load_program(data: bytes, where: str | Path, methods: tuple[str, ...]) -> object:
    """ExecuTorch's runtime module over a program's bytes (which the caller keeps alive), checked to have
    `methods`."""
    _require_executorch()
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    try:
        module = _load_for_executorch_from_buffer(data)
    except (RuntimeError, ValueError) as exc:
        raise ExportError(f"{where}: ExecuTorch cannot load the program (damaged, or not a .pte): {exc}") from exc
    missing = sorted(set(methods) - set(module.method_names()))
    if missing:
        raise ExportError(f"{where}: the program has no method(s) {', '.join(missing)}: it is not a MeSP program")
    return module


def _first_line_naming_operator(message: str) -> str:
    match = re.search(r"Operator torch\._ops\.(\S+) is not in Core ATen opset", message)
    if match:
        return (f"operator {match.group(1)} is not in the Core ATen opset ExecuTorch runs (it has no "
                "decomposition into it); change the model to avoid it")
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "unknown reason"


class ExecuTorchTrainer:
    """Trains an exported .pte in the ExecuTorch Python runtime with its SGD optimizer.

        trainer = ExecuTorchTrainer("head.pte", lr=0.1)
        loss = trainer.step(batch)              # forward + backward in the program, then SGD in place
        weights = trainer.parameters()          # {model parameter name: tensor}
    """

    runtime = "ExecuTorch"

    def __init__(self, program: str | Path | bytes, lr: float, batch: Batch | None = None) -> None:
        _require_executorch()
        from executorch.extension.training import _load_for_executorch_for_training_from_buffer

        # The runtime reads the program from this buffer without copying it: keep it alive as long as we are.
        self._program_bytes = Path(program).read_bytes() if isinstance(program, (str, Path)) else bytes(program)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "This API is experimental": known, and pinned for it
            self._module = _load_for_executorch_for_training_from_buffer(self._program_bytes)
        self.lr = lr
        self.signature = None if batch is None else BatchSignature.of(batch)
        self._optimizer = None
        self.steps_done = 0

    def step(self, batch: Batch) -> float:
        from executorch.extension.training import get_sgd_optimizer

        if self.signature is not None:
            self.signature.check(batch, self.runtime)
        try:
            outputs = self._module.forward_backward(METHOD, (batch.inputs.contiguous(), batch.targets.contiguous()))
        except RuntimeError as exc:
            raise ExportError(f"the ExecuTorch program refused batch {batch.index} (inputs "
                              f"{tuple(batch.inputs.shape)} {batch.inputs.dtype}): {exc}") from exc
        if self._optimizer is None:
            # The parameter tensors alias the program's weights: the optimizer updates them in place.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._optimizer = get_sgd_optimizer(self._module.named_parameters(), self.lr, 0, 0, 0, False)
        self._optimizer.step(self._module.named_gradients())
        self.steps_done += 1
        return float(outputs[0])

    def parameters(self) -> dict[str, torch.Tensor]:
        if self.steps_done == 0:
            raise ExportError("the ExecuTorch runtime exposes the parameters only after a first step")
        return {name: t.clone() for name, t in strip_prefix(self._module.named_parameters()).items()}
