// edgetrain_et_runner: train an exported ExecuTorch training program (.pte) without Python.
//
//   edgetrain_et_runner PROGRAM.pte BATCHES.bin [--lr 0.1] [--steps N] [--save PARAMS.safetensors]
//
// PROGRAM.pte comes from `edgetrain export --runtime executorch`: its `forward(inputs, targets)` is the
// joint forward-backward program and returns [loss, gradients..., parameters...]. The methods
// __et_training_gradients_index_forward / __et_training_parameters_index_forward say where the gradients
// and the parameters start, __et_training_fqn_forward names them. The parameter outputs alias the
// program's weights, so SGD writes them in place: p <- p - lr * g, as torch.optim.SGD does.
//
// BATCHES.bin is the batch stream file of edgetrain/export/stream_file.py: "EDGEBAT1", u32 tensors per
// batch, per tensor (u32 dtype: 0 float32 / 1 int64, u32 ndim, i64 dims), u64 batches, then the data.
//
// Prints "step N loss L" per step (L with 9 significant digits: a float32 exactly) and writes the
// trained parameters to a safetensors file.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include "runner_io.h"

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::EValue;

namespace {

using edgetrain::BatchFile;
using edgetrain::TensorSpec;
using edgetrain::read_batch_file;

int64_t index_of(Module& module, const std::string& method) {
  auto result = module.execute(method);
  if (!result.ok() || result->empty() || !result->at(0).isInt()) {
    throw std::runtime_error("the program has no method " + method +
                             ": is it a training program from `edgetrain export --runtime executorch`?");
  }
  return result->at(0).toInt();
}

std::vector<std::string> parameter_names(Module& module, size_t expected) {
  std::vector<std::string> names;
  auto result = module.execute("__et_training_fqn_forward");
  if (result.ok()) {
    for (const EValue& value : *result) {
      if (value.isString()) names.emplace_back(value.toString());
    }
  }
  for (size_t i = names.size(); i < expected; ++i) names.push_back("param_" + std::to_string(i));
  return names;
}

int usage() {
  std::fprintf(stderr,
               "usage: edgetrain_et_runner PROGRAM.pte BATCHES.bin [--lr LR] [--steps N] "
               "[--save PARAMS.safetensors]\n");
  return 2;
}

int run(int argc, char** argv) {
  std::vector<std::string> positional;
  double lr = 0.1;
  long steps = -1;
  std::string save_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--lr" || arg == "--steps" || arg == "--save") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--lr") lr = std::stod(value);
      if (arg == "--steps") steps = std::stol(value);
      if (arg == "--save") save_path = value;
    } else if (arg == "-h" || arg == "--help") {
      usage();
      return 0;
    } else if (!arg.empty() && arg[0] == '-') {
      return usage();
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) return usage();

  executorch::runtime::runtime_init();
  BatchFile batches = read_batch_file(positional[1]);
  const uint64_t total = steps < 0 ? batches.count : std::min<uint64_t>(steps, batches.count);

  Module module(positional[0]);
  const auto load_error = module.load();
  if (load_error != executorch::runtime::Error::Ok) {
    throw std::runtime_error("cannot load " + positional[0] + " (error " +
                             std::to_string(static_cast<int>(load_error)) + ")");
  }
  const int64_t grad_start = index_of(module, "__et_training_gradients_index_forward");
  const int64_t param_start = index_of(module, "__et_training_parameters_index_forward");
  const size_t count = static_cast<size_t>(param_start - grad_start);
  const std::vector<std::string> names = parameter_names(module, count);
  const float step_size = static_cast<float>(lr);
  std::printf("program %s: %zu trainable tensors, %" PRIu64 " batches, lr %g\n", positional[0].c_str(), count,
              total, lr);

  std::vector<Tensor> parameters;
  for (uint64_t step = 0; step < total; ++step) {
    char* base = batches.data.data() + step * batches.batch_bytes;
    std::vector<TensorPtr> inputs;
    for (const TensorSpec& spec : batches.specs) {
      std::vector<executorch::aten::SizesType> sizes(spec.dims.begin(), spec.dims.end());
      inputs.push_back(make_tensor_ptr(std::move(sizes), base, spec.type));
      base += spec.numel * spec.element_size;
    }
    auto outputs = module.forward({EValue(*inputs[0]), EValue(*inputs[1])});
    if (!outputs.ok()) {
      throw std::runtime_error("forward failed on batch " + std::to_string(step) + " (error " +
                               std::to_string(static_cast<int>(outputs.error())) +
                               "): do the batch shapes match the ones the program was exported for?");
    }
    const float loss = outputs->at(0).toTensor().const_data_ptr<float>()[0];
    parameters.clear();
    for (size_t i = 0; i < count; ++i) {
      const Tensor& grad = outputs->at(grad_start + i).toTensor();
      Tensor param = outputs->at(param_start + i).toTensor();
      if (param.scalar_type() != ScalarType::Float || grad.numel() != param.numel()) {
        throw std::runtime_error("parameter " + names[i] + " is not a float32 tensor matching its gradient");
      }
      float* p = param.mutable_data_ptr<float>();
      const float* g = grad.const_data_ptr<float>();
      for (ssize_t j = 0; j < param.numel(); ++j) p[j] = std::fma(-step_size, g[j], p[j]);
      parameters.push_back(param);
    }
    std::printf("step %" PRIu64 " loss %.9g\n", step + 1, loss);
  }
  if (edgetrain::peak_resident_kb() >= 0) {
    std::printf("memory: peak resident %ld kB (VmHWM)\n", edgetrain::peak_resident_kb());
  }
  if (!save_path.empty()) {
    if (parameters.empty()) throw std::runtime_error("no step was run: nothing to save");
    std::vector<edgetrain::NamedFloats> named;
    for (size_t i = 0; i < parameters.size(); ++i) {
      const Tensor& t = parameters[i];
      named.push_back({names[i], std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                       t.const_data_ptr<float>(), static_cast<size_t>(t.numel())});
    }
    edgetrain::atomic_write(save_path, edgetrain::safetensors_bytes(named));
    std::printf("saved %zu parameters to %s\n", parameters.size(), save_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "edgetrain_et_runner: error: %s\n", error.what());
    return 1;
  }
}
