// edgetrain_mesp_runner: MeSP LoRA training of a decoder from a native program, no Python.
//
//   edgetrain_mesp_runner PROGRAM.pte BATCHES.bin [--weights PROGRAM.weights] [--steps N] [--lr 1e-3]
//       [--beta1 0.9] [--beta2 0.999] [--eps 1e-8] [--weight-decay 0.01]
//       [--checkpoint STATE.ckpt] [--save ADAPTER.safetensors]
//
// PROGRAM.pte and PROGRAM.weights come from `edgetrain export --method mesp` (edgetrain/export/mesp_program.py):
// the program's methods are the pieces of a step (embed, block_forward, block_backward, head, adamw), and the
// weights file holds the frozen base (packed as loaded), the RoPE tables, the adapters to start from and, as
// int64 index lists, which of its tensors each method takes. This runner maps the weights file (the kernel
// pages in what a step reads) and drives MeSP's schedule:
//
//   embed -> every block forward, keeping only block inputs -> head loss and dL/dhidden
//   -> every block backward from its stored input, last first -> AdamW on each block's adapter vector
//
// A step is all or nothing: a non-finite loss, gradient or update changes nothing (exit status 5). With
// --checkpoint the adapters, AdamW moments and step count are written after every step (crash-safe: a kill
// at any moment leaves the last whole checkpoint) and a run that finds one resumes from it, with the next
// batch, to the same adapters bit for bit. --save writes the trained adapter as edgetrain's adapter file
// (safetensors, LoRA config and checksum in its metadata), which `edgetrain export-adapter` converts.
//
// Prints "step N loss L" per step (L with 9 significant digits: a float32 exactly), and the time of the
// first step and of the others (after a first step that pages the weights in).
// Exit status: 0 done, 1 internal error, 2 usage, 3 a bad, damaged or mismatched input file or batch,
// 4 an output that cannot be written (checked before training), 5 a non-finite step.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include <sys/mman.h>
#include <sys/stat.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <map>

#include "runner_io.h"

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::EValue;
using edgetrain::InputError;

namespace {

constexpr int64_t kFormatVersion = 4;  // 2: int8 row_halves codes; 3: signed 8-bit codes; 4: wide codes, k-quant steps (edgetrain/export/mesp_graph.py)

struct NonFinite : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct WeightsTensor {
  std::string name;
  ScalarType type;
  std::vector<SizesType> sizes;
  const unsigned char* data;
  uint64_t nbytes;
};

size_t element_size(ScalarType type) {
  switch (type) {
    case ScalarType::Float: return 4;
    case ScalarType::Long: return 8;
    case ScalarType::Byte: return 1;
    case ScalarType::Char: return 1;
    case ScalarType::Half: return 2;
    default: return 0;
  }
}

// The weights file (edgetrain/export/weights_file.py), mapped read-only and checked against its CRC-32.
class WeightsFile {
 public:
  explicit WeightsFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw InputError("cannot open the weights file " + path + ": " + std::strerror(errno));
    struct stat info {};
    ::fstat(fd, &info);
    size_ = static_cast<size_t>(info.st_size);
    if (size_ < 24) {
      ::close(fd);
      throw InputError(path + ": " + std::to_string(size_) + " bytes is too short for a weights file");
    }
    void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (mapped == MAP_FAILED) throw InputError("cannot map " + path);
    base_ = static_cast<const unsigned char*>(mapped);
    if (std::memcmp(base_, "EDGEWTS1", 8) != 0) throw InputError(path + ": not an edgetrain weights file");
    if (edgetrain::crc32(base_ + 12, size_ - 12) != read<uint32_t>(8)) {
      throw InputError(path + ": the checksum does not match: the file is damaged or truncated");
    }
    // The pages the checksum read are clean file pages: tell the kernel it may drop them until a step reads them.
    ::madvise(const_cast<unsigned char*>(base_), size_, MADV_DONTNEED);
    const uint32_t count = read<uint32_t>(12);
    size_t offset = 24 + read<uint64_t>(16);
    for (uint32_t i = 0; i < count; ++i) {
      WeightsTensor t;
      const uint32_t name_length = read<uint32_t>(offset);
      need(offset + 4 + name_length);
      t.name.assign(reinterpret_cast<const char*>(base_ + offset + 4), name_length);
      offset += 4 + name_length;
      const uint32_t code = read<uint32_t>(offset), ndim = read<uint32_t>(offset + 4);
      offset += 8;
      static const ScalarType types[] = {ScalarType::Float, ScalarType::Long, ScalarType::Byte, ScalarType::Half,
                                         ScalarType::Char};
      if (code > 4 || ndim > 8) throw InputError(path_ + ": the header is damaged (tensor " + t.name + ")");
      t.type = types[code];
      uint64_t numel = 1;
      for (uint32_t d = 0; d < ndim; ++d) {
        const int64_t dim = read<int64_t>(offset + 8 * d);
        if (dim < 0) throw InputError(path_ + ": the header is damaged (tensor " + t.name + ")");
        t.sizes.push_back(static_cast<SizesType>(dim));
        numel *= static_cast<uint64_t>(dim);
      }
      offset += 8 * ndim;
      const uint64_t data_offset = read<uint64_t>(offset);
      t.nbytes = read<uint64_t>(offset + 8);
      offset += 16;
      if (t.nbytes != numel * element_size(t.type) || data_offset + t.nbytes > size_) {
        throw InputError(path_ + ": the header is damaged (tensor " + t.name + ")");
      }
      t.data = base_ + data_offset;
      index_[t.name] = tensors_.size();
      tensors_.push_back(t);
    }
  }
  ~WeightsFile() {
    if (base_) ::munmap(const_cast<unsigned char*>(base_), size_);
  }
  WeightsFile(const WeightsFile&) = delete;
  WeightsFile& operator=(const WeightsFile&) = delete;

  const WeightsTensor& get(const std::string& name) const {
    const auto found = index_.find(name);
    if (found == index_.end()) throw InputError(path_ + ": no tensor " + name + " (not a MeSP program's weights)");
    return tensors_[found->second];
  }
  const WeightsTensor& at(int64_t index) const {
    if (index < 0 || static_cast<size_t>(index) >= tensors_.size()) {
      throw InputError(path_ + ": an input list points past the file's tensors");
    }
    return tensors_[static_cast<size_t>(index)];
  }
  std::vector<int64_t> longs(const std::string& name) const {
    const WeightsTensor& t = get(name);
    if (t.type != ScalarType::Long) throw InputError(path_ + ": " + name + " is not int64");
    std::vector<int64_t> out(t.nbytes / 8);
    std::memcpy(out.data(), t.data, t.nbytes);
    return out;
  }
  std::string text(const std::string& name) const {
    const WeightsTensor& t = get(name);
    return std::string(reinterpret_cast<const char*>(t.data), t.nbytes);
  }
  // A tensor over the mapping, without a copy. The programs never write their inputs.
  TensorPtr tensor(const WeightsTensor& t) const {
    return make_tensor_ptr(std::vector<SizesType>(t.sizes), const_cast<unsigned char*>(t.data), t.type);
  }
  const std::string& path() const { return path_; }

 private:
  void need(size_t end) const {
    if (end > size_) throw InputError(path_ + ": the header is damaged (it runs past the end of the file)");
  }
  template <typename T>
  T read(size_t offset) const {
    need(offset + sizeof(T));
    T value;
    std::memcpy(&value, base_ + offset, sizeof(T));
    return value;
  }

  std::string path_;
  const unsigned char* base_ = nullptr;
  size_t size_ = 0;
  std::vector<WeightsTensor> tensors_;
  std::map<std::string, size_t> index_;
};

struct Shape {
  int64_t blocks, batch, seq, vocab, hidden, adapter_numel;
  uint32_t program_crc;
};

struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;

  // adamw's scalar input for update `step` (from 1): in double as torch.optim computes them, then float32.
  std::vector<float> scalars(uint64_t step) const {
    const double t = static_cast<double>(step);
    return {static_cast<float>(1 - lr * weight_decay), static_cast<float>(1 - beta1), static_cast<float>(beta2),
            static_cast<float>(1 - beta2), static_cast<float>(std::sqrt(1 - std::pow(beta2, t))),
            static_cast<float>(eps), static_cast<float>(-lr / (1 - std::pow(beta1, t)))};
  }
};

// What training has changed: per block the adapter vector and its two AdamW moments, and the step count.
struct State {
  uint64_t steps_done = 0;
  std::vector<std::vector<float>> adapters, exp_avg, exp_avg_sq;
};

// "EDGECKP1", u32 CRC-32 of the rest, u32 program crc, u64 steps done, u64 blocks, u64 adapter numel, then
// per block its adapters, exp_avg and exp_avg_sq (float32).
std::string checkpoint_bytes(const State& state, const Shape& shape) {
  std::string body;
  auto put = [&body](const void* p, size_t n) { body.append(static_cast<const char*>(p), n); };
  put(&shape.program_crc, 4);
  put(&state.steps_done, 8);
  const uint64_t blocks = static_cast<uint64_t>(shape.blocks), numel = static_cast<uint64_t>(shape.adapter_numel);
  put(&blocks, 8);
  put(&numel, 8);
  for (int64_t b = 0; b < shape.blocks; ++b) {
    for (const auto* v : {&state.adapters[b], &state.exp_avg[b], &state.exp_avg_sq[b]}) put(v->data(), 4 * v->size());
  }
  const uint32_t crc = edgetrain::crc32(reinterpret_cast<const unsigned char*>(body.data()), body.size());
  return std::string("EDGECKP1") + std::string(reinterpret_cast<const char*>(&crc), 4) + body;
}

bool load_checkpoint(const std::string& path, const Shape& shape, State& state) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t numel = static_cast<size_t>(shape.adapter_numel), blocks = static_cast<size_t>(shape.blocks);
  const size_t expected = 12 + 4 + 24 + blocks * 3 * 4 * numel;
  if (data.size() < 12 || data.compare(0, 8, "EDGECKP1") != 0) throw InputError(path + ": not a runner checkpoint");
  uint32_t crc, program_crc;
  std::memcpy(&crc, data.data() + 8, 4);
  if (data.size() != expected ||
      edgetrain::crc32(reinterpret_cast<const unsigned char*>(data.data()) + 12, data.size() - 12) != crc) {
    throw InputError(path + ": the checkpoint is damaged or truncated, or from a program of another shape");
  }
  std::memcpy(&program_crc, data.data() + 12, 4);
  if (program_crc != shape.program_crc) throw InputError(path + ": a checkpoint of another program");
  std::memcpy(&state.steps_done, data.data() + 16, 8);
  const char* p = data.data() + 40;
  for (size_t b = 0; b < blocks; ++b) {
    for (auto* v : {&state.adapters[b], &state.exp_avg[b], &state.exp_avg_sq[b]}) {
      std::memcpy(v->data(), p, 4 * numel);
      p += 4 * numel;
    }
  }
  return true;
}

bool all_finite(const float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(data[i])) return false;
  }
  return true;
}

class MeSPRunner {
 public:
  MeSPRunner(const std::string& program_path, const std::string& weights_path, AdamW adamw)
      // The five methods share one activation arena, sized for the largest (the head's): they run one at a time
      // and every output that outlives its call is copied out first (copy_out). Each its own arena cost the
      // SmolLM2 runner 60 MiB.
      : weights_(weights_path),
        module_(program_path, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, /*share_memory_arenas=*/true),
        adamw_(adamw) {
    const std::vector<int64_t> meta = weights_.longs("program.meta");
    if (meta.size() != 8 || meta[0] != kFormatVersion) {
      throw InputError(weights_path + ": not a MeSP program's weights file of format version " +
                       std::to_string(kFormatVersion));
    }
    shape_ = {meta[1], meta[2], meta[3], meta[4], meta[5], meta[6], static_cast<uint32_t>(meta[7])};
    std::ifstream program(program_path, std::ios::binary);
    if (!program) throw InputError("cannot open the program " + program_path);
    const std::string bytes((std::istreambuf_iterator<char>(program)), std::istreambuf_iterator<char>());
    if (edgetrain::crc32(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) != shape_.program_crc) {
      throw InputError(program_path + " is not the program " + weights_path +
                       " was written with (another model or shape, or a damaged file): export them again together");
    }
    if (module_.load() != executorch::runtime::Error::Ok) throw InputError("ExecuTorch cannot load " + program_path);
    for (const char* method : {"embed", "block_forward", "block_backward", "head", "adamw"}) {
      if (module_.load_method(method) != executorch::runtime::Error::Ok) {
        throw InputError(program_path + ": no method " + std::string(method) + ": not a MeSP program");
      }
    }
    embed_ = inputs("inputs.embed");
    head_ = inputs("inputs.head");
    for (int64_t b = 0; b < shape_.blocks; ++b) blocks_.push_back(inputs("inputs.block." + std::to_string(b)));
    cos_ = weights_.tensor(weights_.get("rope.cos"));
    sin_ = weights_.tensor(weights_.get("rope.sin"));
    const size_t numel = static_cast<size_t>(shape_.adapter_numel);
    for (int64_t b = 0; b < shape_.blocks; ++b) {
      const WeightsTensor& start = weights_.get("blocks." + std::to_string(b) + ".adapters");
      if (start.nbytes != 4 * numel) throw InputError(weights_path + ": block " + std::to_string(b) + "'s adapters");
      state_.adapters.emplace_back(numel);
      std::memcpy(state_.adapters.back().data(), start.data, 4 * numel);
      state_.exp_avg.emplace_back(numel, 0.0f);
      state_.exp_avg_sq.emplace_back(numel, 0.0f);
    }
    const size_t activations = static_cast<size_t>(shape_.batch * shape_.seq * shape_.hidden);
    stored_inputs_.assign(static_cast<size_t>(shape_.blocks) + 1, std::vector<float>(activations));
    grad_.resize(activations);
  }

  const Shape& shape() const { return shape_; }
  State& state() { return state_; }

  // One step on (inputs, targets) [batch, seq] int64; the loss before the update.
  float step(const int64_t* ids, const int64_t* targets, uint64_t batch_index) {
    const size_t tokens = static_cast<size_t>(shape_.batch * shape_.seq);
    for (size_t i = 0; i < tokens; ++i) {
      if (ids[i] < 0 || ids[i] >= shape_.vocab || (targets[i] != -100 && (targets[i] < 0 || targets[i] >= shape_.vocab))) {
        throw InputError("batch " + std::to_string(batch_index) + ": token id " +
                         std::to_string(ids[i] < 0 || ids[i] >= shape_.vocab ? ids[i] : targets[i]) +
                         " outside the vocabulary [0, " + std::to_string(shape_.vocab) + ")");
      }
    }
    const std::vector<SizesType> token_sizes = {static_cast<SizesType>(shape_.batch), static_cast<SizesType>(shape_.seq)};
    const std::vector<SizesType> hidden_sizes = {token_sizes[0], token_sizes[1], static_cast<SizesType>(shape_.hidden)};
    const std::vector<SizesType> vector_sizes = {static_cast<SizesType>(shape_.adapter_numel)};
    TensorPtr ids_tensor = make_tensor_ptr(token_sizes, const_cast<int64_t*>(ids), ScalarType::Long);
    TensorPtr targets_tensor = make_tensor_ptr(token_sizes, const_cast<int64_t*>(targets), ScalarType::Long);

    copy_out(run("embed", with(embed_, {EValue(*ids_tensor)})).at(0), stored_inputs_[0]);
    for (int64_t b = 0; b < shape_.blocks; ++b) {
      TensorPtr x = floats(stored_inputs_[b], hidden_sizes);
      TensorPtr adapters = floats(state_.adapters[b], vector_sizes);
      copy_out(run("block_forward", with(blocks_[b], {EValue(*x), EValue(*cos_), EValue(*sin_), EValue(*adapters)}))
                   .at(0), stored_inputs_[b + 1]);
    }
    TensorPtr final_hidden = floats(stored_inputs_[shape_.blocks], hidden_sizes);
    const auto head = run("head", with(head_, {EValue(*final_hidden), EValue(*targets_tensor)}));
    const float loss = head.at(0).toTensor().const_data_ptr<float>()[0];
    if (!std::isfinite(loss)) throw NonFinite("batch " + std::to_string(batch_index) + ": the loss is not finite");
    copy_out(head.at(1), grad_);

    std::vector<std::vector<float>> grads(static_cast<size_t>(shape_.blocks));
    for (int64_t b = shape_.blocks - 1; b >= 0; --b) {
      TensorPtr x = floats(stored_inputs_[b], hidden_sizes);
      TensorPtr grad_out = floats(grad_, hidden_sizes);
      TensorPtr adapters = floats(state_.adapters[b], vector_sizes);
      const auto out = run("block_backward", with(blocks_[b], {EValue(*x), EValue(*grad_out), EValue(*cos_),
                                                              EValue(*sin_), EValue(*adapters)}));
      grads[b].resize(static_cast<size_t>(shape_.adapter_numel));
      copy_out(out.at(1), grads[b]);
      if (!all_finite(grads[b].data(), grads[b].size())) {
        throw NonFinite("batch " + std::to_string(batch_index) + ": a non-finite gradient in block " + std::to_string(b));
      }
      copy_out(out.at(0), grad_);
    }

    std::vector<float> scalars = adamw_.scalars(state_.steps_done + 1);
    TensorPtr scalar_tensor = make_tensor_ptr(std::vector<SizesType>{7}, scalars.data(), ScalarType::Float);
    // All or nothing without a second copy of the state: every block's update is tried first and only
    // checked (the outputs live in the method's planned memory), then, all being finite, run again and kept.
    for (const bool keep : {false, true}) {
      for (int64_t b = 0; b < shape_.blocks; ++b) {
        TensorPtr p = floats(state_.adapters[b], vector_sizes), g = floats(grads[b], vector_sizes);
        TensorPtr m = floats(state_.exp_avg[b], vector_sizes), v = floats(state_.exp_avg_sq[b], vector_sizes);
        const auto out = run("adamw", {EValue(*p), EValue(*g), EValue(*m), EValue(*v), EValue(*scalar_tensor)});
        for (size_t i = 0; i < 3; ++i) {
          const Tensor& t = out.at(i).toTensor();
          if (!keep && !all_finite(t.const_data_ptr<float>(), static_cast<size_t>(t.numel()))) {
            throw NonFinite("batch " + std::to_string(batch_index) + ": the AdamW update of block " +
                            std::to_string(b) + " came out non-finite");
          }
        }
        if (keep) {
          copy_out(out.at(0), state_.adapters[b]);
          copy_out(out.at(1), state_.exp_avg[b]);
          copy_out(out.at(2), state_.exp_avg_sq[b]);
        }
      }
    }
    state_.steps_done += 1;
    return loss;
  }

  // edgetrain's adapter file: blocks.<i>.<module>.lora_A|B, the LoRA config and the checksum
  // (edgetrain.training.checkpoint.payload_sha256) in the metadata.
  std::string adapter_file() const {
    const std::vector<int64_t> layout = weights_.longs("adapters.layout");
    std::vector<std::string> names;
    std::stringstream lines(weights_.text("adapters.names"));
    for (std::string line; std::getline(lines, line);) names.push_back(line);
    if (layout.size() != 3 * names.size()) throw InputError(weights_.path() + ": adapters.layout and .names disagree");
    std::map<std::string, edgetrain::NamedFloats> sorted;  // the checksum reads them in sorted name order
    for (int64_t b = 0; b < shape_.blocks; ++b) {
      for (size_t i = 0; i < names.size(); ++i) {
        const int64_t offset = layout[3 * i], rows = layout[3 * i + 1], cols = layout[3 * i + 2];
        const std::string name = "blocks." + std::to_string(b) + "." + names[i];
        sorted[name] = {name, {rows, cols}, state_.adapters[b].data() + offset, static_cast<size_t>(rows * cols)};
      }
    }
    edgetrain::Sha256 digest;
    std::vector<edgetrain::NamedFloats> tensors;
    for (const auto& [name, t] : sorted) {
      digest.update(name);
      digest.update(std::string("torch.float32"));
      digest.update("(" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ")");
      digest.update(t.data, 4 * t.numel);
      tensors.push_back(t);
    }
    const std::string metadata = weights_.text("adapters.metadata");
    digest.update(std::string("\0metadata\0", 10));
    digest.update(metadata);
    const std::string with_checksum =
        metadata.substr(0, metadata.size() - 1) + ", \"edgetrain_sha256_v2\": \"" + digest.hex() + "\"}";
    return edgetrain::safetensors_bytes(tensors, with_checksum);
  }

 private:
  std::vector<EValue> with(const std::vector<TensorPtr>& frozen, std::vector<EValue> leading) const {
    for (const TensorPtr& t : frozen) leading.emplace_back(*t);
    return leading;
  }
  std::vector<TensorPtr> inputs(const std::string& list) const {
    std::vector<TensorPtr> out;
    for (int64_t index : weights_.longs(list)) out.push_back(weights_.tensor(weights_.at(index)));
    return out;
  }
  static TensorPtr floats(std::vector<float>& data, const std::vector<SizesType>& sizes) {
    return make_tensor_ptr(std::vector<SizesType>(sizes), data.data(), ScalarType::Float);
  }
  // Outputs live in the method's planned memory, which its next call reuses: copy what must outlive it.
  static void copy_out(const EValue& value, std::vector<float>& into) {
    const Tensor& t = value.toTensor();
    if (t.scalar_type() != ScalarType::Float || static_cast<size_t>(t.numel()) != into.size()) {
      throw std::runtime_error("a program output of an unexpected shape");
    }
    std::memcpy(into.data(), t.const_data_ptr<float>(), 4 * into.size());
  }
  std::vector<EValue> run(const std::string& method, const std::vector<EValue>& inputs) {
    auto result = module_.execute(method, inputs);
    if (!result.ok()) {
      throw std::runtime_error("method " + method + " failed (ExecuTorch error " +
                               std::to_string(static_cast<int>(result.error())) + ")");
    }
    return std::move(*result);
  }

  WeightsFile weights_;
  Module module_;
  AdamW adamw_;
  Shape shape_{};
  State state_;
  std::vector<TensorPtr> embed_, head_;
  std::vector<std::vector<TensorPtr>> blocks_;
  TensorPtr cos_, sin_;
  std::vector<std::vector<float>> stored_inputs_;  // block inputs, and the final hidden state last
  std::vector<float> grad_;
};

int usage() {
  std::fprintf(stderr,
               "usage: edgetrain_mesp_runner PROGRAM.pte BATCHES.bin [--weights PATH] [--steps N] [--lr LR] "
               "[--beta1 B1] [--beta2 B2] [--eps EPS] [--weight-decay WD] [--checkpoint PATH] "
               "[--save ADAPTER.safetensors]\n");
  return 2;
}

double number(const std::string& flag, const std::string& text, double low, double high) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !std::isfinite(value) || value < low || value > high) {
    throw std::invalid_argument(flag + " takes a number in [" + std::to_string(low) + ", " + std::to_string(high) +
                                "], not '" + text + "'");
  }
  return value;
}

int run(int argc, char** argv) {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage();
      return 0;
    }
    if (arg.rfind("--", 0) == 0) {
      static const char* known[] = {"--weights", "--steps", "--lr", "--beta1", "--beta2", "--eps", "--weight-decay",
                                    "--checkpoint", "--save"};
      if (std::find(std::begin(known), std::end(known), arg) == std::end(known) || i + 1 >= argc) return usage();
      options[arg] = argv[++i];
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) return usage();
  AdamW adamw;
  long steps = -1;
  try {
    if (options.count("--lr")) adamw.lr = number("--lr", options["--lr"], 0, 1e6);
    if (options.count("--beta1")) adamw.beta1 = number("--beta1", options["--beta1"], 0, 0.999999);
    if (options.count("--beta2")) adamw.beta2 = number("--beta2", options["--beta2"], 0, 0.999999999);
    if (options.count("--eps")) adamw.eps = number("--eps", options["--eps"], 0, 1);
    if (options.count("--weight-decay")) adamw.weight_decay = number("--weight-decay", options["--weight-decay"], 0, 1e6);
    if (options.count("--steps")) steps = static_cast<long>(number("--steps", options["--steps"], 0, 1e12));
  } catch (const std::invalid_argument& error) {
    std::fprintf(stderr, "edgetrain_mesp_runner: %s\n", error.what());
    return 2;
  }
  const std::string program = positional[0];
  std::string weights = options.count("--weights") ? options["--weights"] : program;
  if (!options.count("--weights")) {
    const size_t dot = weights.find_last_of('.'), slash = weights.find_last_of('/');
    weights = (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? weights.substr(0, dot) : weights) +
              ".weights";
  }

  if (options.count("--save")) edgetrain::check_writable(options["--save"], "the adapter");
  if (options.count("--checkpoint")) edgetrain::check_writable(options["--checkpoint"], "the checkpoint");
  executorch::runtime::runtime_init();
  edgetrain::BatchFile batches = edgetrain::read_batch_file(positional[1]);
  MeSPRunner runner(program, weights, adamw);
  const Shape& shape = runner.shape();
  for (size_t s = 0; s < 2; ++s) {
    const auto& spec = batches.specs[s];
    if (spec.type != ScalarType::Long || spec.dims.size() != 2 || spec.dims[0] != shape.batch || spec.dims[1] != shape.seq) {
      throw InputError(positional[1] + ": batches are not int64 [" + std::to_string(shape.batch) + ", " +
                       std::to_string(shape.seq) + "], the shape the program was exported for");
    }
  }
  const std::string checkpoint = options.count("--checkpoint") ? options["--checkpoint"] : "";
  if (!checkpoint.empty() && load_checkpoint(checkpoint, shape, runner.state())) {
    std::printf("resumed from %s after step %" PRIu64 "\n", checkpoint.c_str(), runner.state().steps_done);
  }
  const uint64_t total = steps < 0 ? batches.count : std::min<uint64_t>(static_cast<uint64_t>(steps), batches.count);
  std::printf("program %s: %" PRId64 " blocks, %" PRId64 " adapter weights a block, batches %" PRId64 " x %" PRId64
              ", %" PRIu64 " steps\n", program.c_str(), shape.blocks, shape.adapter_numel, shape.batch, shape.seq, total);
  double first_seconds = 0, total_seconds = 0;
  uint64_t timed = 0;
  for (uint64_t step = runner.state().steps_done; step < total; ++step) {
    const auto started = std::chrono::steady_clock::now();
    const int64_t* ids = reinterpret_cast<const int64_t*>(batches.data.data() + step * batches.batch_bytes);
    const float loss = runner.step(ids, ids + shape.batch * shape.seq, step);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    (timed++ ? total_seconds : first_seconds) += seconds;
    std::printf("step %" PRIu64 " loss %.9g\n", step + 1, loss);
    std::fflush(stdout);
    if (!checkpoint.empty()) edgetrain::atomic_write(checkpoint, checkpoint_bytes(runner.state(), shape));
  }
  if (timed > 1) {
    std::printf("timing: first step %.6f s, then %.6f s a step over %" PRIu64 " steps\n", first_seconds,
                total_seconds / static_cast<double>(timed - 1), timed - 1);
  }
  if (edgetrain::peak_resident_kb() >= 0) {
    std::printf("memory: peak resident %ld kB (VmHWM)\n", edgetrain::peak_resident_kb());
  }
  if (options.count("--save")) {
    edgetrain::atomic_write(options["--save"], runner.adapter_file());
    std::printf("saved the adapter to %s\n", options["--save"].c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const InputError& error) {
    std::fprintf(stderr, "edgetrain_mesp_runner: error: %s\n", error.what());
    return 3;
  } catch (const edgetrain::OutputError& error) {
    std::fprintf(stderr, "edgetrain_mesp_runner: error: %s\n", error.what());
    return 4;
  } catch (const NonFinite& error) {
    std::fprintf(stderr, "edgetrain_mesp_runner: error: %s; nothing was changed\n", error.what());
    return 5;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "edgetrain_mesp_runner: error: %s\n", error.what());
    return 1;
  }
}
