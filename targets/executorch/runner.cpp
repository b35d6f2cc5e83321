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
//
// Exit status: 0 done, 1 internal error, 2 usage, 3 a bad, damaged or mismatched input file or batch,
// 4 an output that cannot be written (checked before training; a full disk at the save), 5 a non-finite step.
// Every refusal is one sentence on stderr naming the file or flag. Nothing is written but --save, once, after
// the last step (crash-safe: a kill at any moment leaves the earlier file or the whole new one), so a refused
// run writes nothing. Only regular files are read (a FIFO or directory in a file's place is refused without
// blocking), and --save may not be an input. Before the first step the program's checksum and layout (its
// extended header's sizes against the file's, then ExecuTorch's full flatbuffer check), its inputs against the batch
// file's tensors, its outputs against a training program's, and every batch's values (finite floats, no
// negative ids but the ignored target -100) are checked; an id past the vocabulary or a class past the
// model's is found by the program's own kernels when its batch comes (exit 3, naming the batch). A step is
// all or nothing: a non-finite loss, gradient or update stops the run with nothing saved. A .pte has no
// checksum of its own: edgetrain's export appends one, which is checked first (a program exported before it was
// is refused: export it again).
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include <executorch/extension/data_loader/buffer_data_loader.h>

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "runner_io.h"


using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::EValue;
using executorch::runtime::Error;

namespace {

using edgetrain::BatchFile;
using edgetrain::InputError;
using edgetrain::TensorSpec;

uint64_t read_u64(const std::string& bytes, size_t offset) {
  uint64_t value;
  std::memcpy(&value, bytes.data() + offset, 8);
  return value;
}

// A .pte has no checksum of its own, and ExecuTorch loads one with a flipped weight or operator argument (or
// aborts inside the runtime): edgetrain's export seals it with 16 bytes after it (edgetrain/export/executorch.py
// seal_program), "EDGEPTE1", u32 CRC-32 of every byte before them, u32 0. The program without them is returned.
std::string unseal_program(const std::string& path, std::string bytes) {
  constexpr size_t kSeal = 16;
  uint32_t crc = 0, zero = 1;
  if (bytes.size() >= kSeal) {
    std::memcpy(&crc, bytes.data() + bytes.size() - 8, 4);
    std::memcpy(&zero, bytes.data() + bytes.size() - 4, 4);
  }
  if (bytes.size() < kSeal || bytes.compare(bytes.size() - kSeal, 8, "EDGEPTE1") != 0 || zero != 0) {
    throw InputError(path + ": no edgetrain checksum at its end (" + std::to_string(bytes.size()) +
                     " bytes): truncated, extended, or not from `edgetrain export --runtime executorch` (export it again)");
  }
  bytes.resize(bytes.size() - kSeal);
  if (edgetrain::crc32(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) != crc) {
    throw InputError(path + ": the checksum does not match: the program is damaged");
  }
  return bytes;
}

// A .pte begins with the flatbuffer's root offset and its identifier ("ET" and two digits), then ExecuTorch's
// extended header: "eh00", u32 its length, u64 the flatbuffer's size, u64 where the segments (the weights)
// start, and from length 32 on, u64 their size. The runtime checks none of these against the file's own size
// (a truncated weights segment or bytes appended after it load), so they are checked here: the file must be
// exactly what its header describes.
void check_program_layout(const std::string& path, const std::string& bytes) {
  const auto digit = [&bytes](size_t i) { return bytes[i] >= '0' && bytes[i] <= '9'; };
  if (bytes.size() < 40 || bytes.compare(4, 2, "ET") != 0 || !digit(6) || !digit(7)) {
    throw InputError(path + ": not an ExecuTorch program (" + std::to_string(bytes.size()) +
                     " bytes, no .pte identifier)");
  }
  uint32_t header_length;
  std::memcpy(&header_length, bytes.data() + 12, 4);
  if (bytes.compare(8, 4, "eh00") != 0 || header_length < 24 || header_length > bytes.size() - 8) {
    throw InputError(path + ": the program's extended header is missing or damaged");
  }
  const uint64_t size = bytes.size(), program_size = read_u64(bytes, 16), segments_at = read_u64(bytes, 24);
  const uint64_t segments_size = header_length >= 32 ? read_u64(bytes, 32) : size - std::min(size, segments_at);
  const bool whole = segments_at == 0 ? program_size == size
                                      : program_size <= segments_at && segments_at <= size &&
                                            segments_size == size - segments_at;
  if (!whole) {
    throw InputError(path + ": the program is " + std::to_string(size) + " bytes, its header describes " +
                     std::to_string(segments_at == 0 ? program_size : segments_at + segments_size) +
                     ": truncated, extended or damaged");
  }
}

// A training program from `edgetrain export --runtime executorch`, loaded from the bytes that were checked (not
// the path again, which could be replaced meanwhile). Its parameter outputs alias its weights, which the
// BufferDataLoader leaves in `bytes_`: SGD writes them there.
class TrainingProgram {
 public:
  TrainingProgram(const std::string& path, std::string bytes)
      : path_(path), bytes_(std::move(bytes)),
        module_(std::make_unique<executorch::extension::BufferDataLoader>(bytes_.data(), bytes_.size())) {
    check_program_layout(path_, bytes_);
    // The full flatbuffer check: the program comes from the app's files, which can be anything.
    if (module_.load(executorch::runtime::Program::Verification::InternalConsistency) != Error::Ok) {
      throw InputError("ExecuTorch cannot load " + path_ + ": damaged, or not a .pte");
    }
    if (module_.load_method("forward") != Error::Ok) {
      throw InputError(path_ + ": ExecuTorch cannot load its method forward: damaged, or not a training program");
    }
    grad_start_ = index_of("__et_training_gradients_index_forward");
    param_start_ = index_of("__et_training_parameters_index_forward");
    const auto meta = module_.method_meta("forward");
    const int64_t outputs = meta.ok() ? static_cast<int64_t>(meta->num_outputs()) : 0;
    if (grad_start_ < 1 || param_start_ <= grad_start_ || outputs != 2 * param_start_ - grad_start_) {
      throw InputError(path_ + ": its gradient and parameter indices (" + std::to_string(grad_start_) + ", " +
                       std::to_string(param_start_) + ") do not fit its " + std::to_string(outputs) +
                       " outputs: damaged, or not a training program");
    }
    count_ = static_cast<size_t>(param_start_ - grad_start_);
    // The loss is a float32 scalar, each gradient a float32 tensor of its parameter's shape: the SGD loop
    // below reads them as such.
    const std::vector<int64_t> loss = output_sizes(*meta, 0);
    if (loss.size() > 1 || (loss.size() == 1 && loss[0] != 1)) throw InputError(path_ + ": its loss is not a scalar");
    for (size_t i = 0; i < count_; ++i) {
      if (output_sizes(*meta, static_cast<size_t>(grad_start_) + i) !=
          output_sizes(*meta, static_cast<size_t>(param_start_) + i)) {
        throw InputError(path_ + ": gradient " + std::to_string(i) + " is not of its parameter's shape: damaged");
      }
    }
    names_ = parameter_names();
  }

  // The batch file's two tensors against the program's own inputs.
  void expect_batches(const std::string& batches_path, const BatchFile& batches) {
    const auto meta = module_.method_meta("forward");
    std::string wanted, given;
    bool same = meta.ok() && meta->num_inputs() == batches.specs.size();
    for (size_t i = 0; i < batches.specs.size(); ++i) {
      const TensorSpec& spec = batches.specs[i];
      given += (i ? ", " : "") + edgetrain::describe_tensor(spec.type, spec.dims);
      if (!meta.ok() || i >= meta->num_inputs() || !meta->input_tensor_meta(i).ok()) {
        same = false;
        continue;
      }
      const auto info = meta->input_tensor_meta(i);
      const std::vector<int64_t> sizes(info->sizes().begin(), info->sizes().end());
      wanted += (i ? ", " : "") + edgetrain::describe_tensor(info->scalar_type(), sizes);
      same = same && info->scalar_type() == spec.type && sizes == spec.dims;
    }
    if (!same) {
      throw InputError(batches_path + ": the batches are " + given + ", " + path_ + " takes " +
                       (wanted.empty() ? "other inputs" : wanted) +
                       ": the batch shapes do not match the ones the program was exported for");
    }
  }

  // One forward-backward on `inputs`, then SGD (p <- p - lr * g, as torch.optim.SGD) on every parameter, all
  // or nothing: a non-finite loss, gradient or updated value changes no parameter. Returns the loss.
  float step(const std::vector<TensorPtr>& inputs, float lr, uint64_t batch, const std::string& batches_path) {
    auto outputs = module_.forward({EValue(*inputs[0]), EValue(*inputs[1])});
    if (!outputs.ok()) {
      // The shapes were checked before the first step: what the kernels refuse now is a value of the batch,
      // an embedding's id or a loss's class past the model's (their bounds are in the kernels, not the file).
      if (outputs.error() == Error::InvalidArgument) {
        throw InputError(batches_path + ": batch " + std::to_string(batch) + " is refused by " + path_ +
                         "'s kernels: a token id or class outside the ones it was exported for");
      }
      throw std::runtime_error("the program " + path_ + " failed on batch " + std::to_string(batch) +
                               " (ExecuTorch error " + std::to_string(static_cast<int>(outputs.error())) + ")");
    }
    const float loss = tensor(*outputs, 0, 1).const_data_ptr<float>()[0];
    if (!std::isfinite(loss)) throw edgetrain::NonFiniteError("batch " + std::to_string(batch) + ": the loss is not finite");
    std::vector<float*> params(count_);
    std::vector<const float*> grads(count_);
    std::vector<size_t> sizes(count_);
    for (size_t i = 0; i < count_; ++i) {
      Tensor param = tensor(*outputs, static_cast<size_t>(param_start_) + i, 0);
      sizes[i] = static_cast<size_t>(param.numel());
      params[i] = param.mutable_data_ptr<float>();
      grads[i] = tensor(*outputs, static_cast<size_t>(grad_start_) + i, sizes[i]).const_data_ptr<float>();
    }
    for (size_t i = 0; i < count_; ++i) {
      for (size_t j = 0; j < sizes[i]; ++j) {
        if (!std::isfinite(grads[i][j]) || !std::isfinite(std::fma(-lr, grads[i][j], params[i][j]))) {
          throw edgetrain::NonFiniteError("batch " + std::to_string(batch) + ": the " +
                                          (std::isfinite(grads[i][j]) ? "update" : "gradient") + " of " +
                                          names_[i] + " is not finite");
        }
      }
    }
    parameters_.clear();
    for (size_t i = 0; i < count_; ++i) {
      for (size_t j = 0; j < sizes[i]; ++j) params[i][j] = std::fma(-lr, grads[i][j], params[i][j]);
      parameters_.push_back(outputs->at(static_cast<size_t>(param_start_) + i).toTensor());
    }
    return loss;
  }

  // The parameters after the last step, as a safetensors file under the program's names.
  std::string parameters_file() const {
    std::vector<edgetrain::NamedFloats> named;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      const Tensor& t = parameters_[i];
      named.push_back({names_[i], std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                       t.const_data_ptr<float>(), static_cast<size_t>(t.numel())});
    }
    return edgetrain::safetensors_bytes(named);
  }

  size_t count() const { return count_; }

 private:
  int64_t index_of(const std::string& method) {
    auto result = module_.execute(method);
    if (!result.ok() || result->size() != 1 || !result->at(0).isInt()) {
      throw InputError(path_ + ": no method " + method +
                       ": not a training program from `edgetrain export --runtime executorch`");
    }
    return result->at(0).toInt();
  }

  std::vector<int64_t> output_sizes(const executorch::runtime::MethodMeta& meta, size_t index) const {
    const auto info = meta.output_tensor_meta(index);
    if (!info.ok() || info->scalar_type() != ScalarType::Float) {
      throw InputError(path_ + ": its output " + std::to_string(index) +
                       " is not a float32 tensor: damaged, or not a training program");
    }
    return std::vector<int64_t>(info->sizes().begin(), info->sizes().end());
  }

  // Output `index` of a step, a float32 tensor (of `numel` elements unless 0), as the method meta promised.
  const Tensor& tensor(const std::vector<EValue>& outputs, size_t index, size_t numel) const {
    if (index >= outputs.size() || !outputs[index].isTensor() ||
        outputs[index].toTensor().scalar_type() != ScalarType::Float ||
        (numel && static_cast<size_t>(outputs[index].toTensor().numel()) != numel)) {
      throw InputError(path_ + ": its output " + std::to_string(index) + " is not the float32 tensor it declares");
    }
    return outputs[index].toTensor();
  }

  // The parameters' names (their safetensors keys): printable, distinct, one each; param_<i> where the
  // program names none.
  std::vector<std::string> parameter_names() {
    std::vector<std::string> names;
    auto result = module_.execute("__et_training_fqn_forward");
    if (!result.ok()) {
      for (size_t i = 0; i < count_; ++i) names.push_back("param_" + std::to_string(i));
      return names;
    }
    for (const EValue& value : *result) {
      const std::string name = value.isString() ? std::string(value.toString()) : std::string();
      const bool printable = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
        return static_cast<unsigned char>(c) >= 0x20 && c != '"' && c != '\\' && c != 0x7f;
      });
      if (!printable) throw InputError(path_ + ": a parameter name is empty, not text or not printable: damaged");
      names.push_back(name);
    }
    if (names.size() != count_ || std::set<std::string>(names.begin(), names.end()).size() != count_) {
      throw InputError(path_ + ": it names " + std::to_string(names.size()) + " parameters (distinct or not) for its " +
                       std::to_string(count_) + ": damaged");
    }
    return names;
  }

  std::string path_;
  std::string bytes_;  // the program, and the weights SGD updates in place
  Module module_;
  int64_t grad_start_ = 0, param_start_ = 0;
  size_t count_ = 0;
  std::vector<std::string> names_;
  std::vector<Tensor> parameters_;
};

// Every value of every batch before the first step: floats finite, ids not negative (targets may be -100,
// the ignored position of edgetrain's losses). The ids' upper bounds are the program's kernels' to check.
void check_batch_values(const std::string& path, const BatchFile& batches) {
  for (uint64_t b = 0; b < batches.count; ++b) {
    const char* base = batches.data.data() + b * batches.batch_bytes;
    for (size_t slot = 0; slot < batches.specs.size(); ++slot) {
      const TensorSpec& spec = batches.specs[slot];
      for (size_t i = 0; i < spec.numel; ++i) {
        bool good;
        std::string value;
        if (spec.type == ScalarType::Float) {
          float x;
          std::memcpy(&x, base + 4 * i, 4);
          good = std::isfinite(x);
          value = edgetrain::number_text(x, 9);
        } else {
          int64_t id;
          std::memcpy(&id, base + 8 * i, 8);
          good = id >= 0 || (slot == 1 && id == -100);
          value = std::to_string(id);
        }
        if (!good) {
          throw InputError(path + ": batch " + std::to_string(b) + "'s " + (slot ? "targets" : "inputs") + " hold " +
                           value + (spec.type == ScalarType::Float ? ", not a finite number" : ", not an id"));
        }
      }
      base += spec.numel * spec.element_size;
    }
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: edgetrain_et_runner PROGRAM.pte BATCHES.bin [--lr LR] [--steps N] "
               "[--save PARAMS.safetensors]\n");
  return 2;
}

int run(int argc, char** argv) {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;
  if (!edgetrain::parse_command_line(argc, argv, {"--lr", "--steps", "--save"}, {"--save"}, positional, options)) {
    usage();
    return 0;
  }
  edgetrain::check_program_and_batches(positional);
  const double lr = options.count("--lr") ? edgetrain::number_flag("--lr", options["--lr"], 0, 1e6) : 0.1;
  const uint64_t steps = options.count("--steps") ? edgetrain::steps_flag("--steps", options["--steps"]) : 0;
  const std::string program_path = positional[0], batches_path = positional[1];
  const std::string save = options.count("--save") ? options["--save"] : "";
  if (!save.empty()) {
    edgetrain::check_outputs_apart({{"the program", program_path}, {"the batch file", batches_path}},
                                   {{"--save", save, "the parameters (--save)"}});
    edgetrain::check_writable(save, "the parameters");
  }

  executorch::runtime::runtime_init();
  const BatchFile batches = edgetrain::read_batch_file(batches_path);
  TrainingProgram program(program_path, unseal_program(program_path, edgetrain::read_regular(program_path, "program")));
  program.expect_batches(batches_path, batches);
  check_batch_values(batches_path, batches);
  const uint64_t total = edgetrain::steps_to_run(steps, batches_path, batches);
  std::printf("program %s: %zu trainable tensors, %" PRIu64 " batches, lr %g\n", program_path.c_str(),
              program.count(), total, lr);

  for (uint64_t step = 0; step < total; ++step) {
    char* base = const_cast<char*>(batches.data.data()) + step * batches.batch_bytes;
    std::vector<TensorPtr> inputs;
    for (const TensorSpec& spec : batches.specs) {
      inputs.push_back(make_tensor_ptr(std::vector<SizesType>(spec.dims.begin(), spec.dims.end()), base, spec.type));
      base += spec.numel * spec.element_size;
    }
    const float loss = program.step(inputs, static_cast<float>(lr), step, batches_path);
    std::printf("step %" PRIu64 " loss %.9g\n", step + 1, loss);
    std::fflush(stdout);
  }
  edgetrain::print_peak_memory();
  if (!save.empty()) {
    edgetrain::atomic_write(save, program.parameters_file());
    std::printf("saved %zu parameters to %s\n", program.count(), save.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return edgetrain::run_main("edgetrain_et_runner", [&] { return run(argc, argv); });
}
