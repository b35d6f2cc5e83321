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
// batch, to the same adapters bit for bit; the checkpoint records the program, the batches it trained on and
// the AdamW settings, and one of another run is refused (never trained over). --save writes the trained adapter as edgetrain's adapter file
// (safetensors, LoRA config and checksum in its metadata), which `edgetrain export-adapter` converts.
//
// Prints "step N loss L" per step (L with 9 significant digits: a float32 exactly), and the time of the
// first step and of the others (after a first step that pages the weights in).
// Exit status: 0 done, 1 internal error, 2 usage, 3 a bad, damaged or mismatched input file or batch,
// 4 an output that cannot be written (checked before training), 5 a non-finite step. Every refusal is one
// sentence on stderr naming the file or flag, and comes before anything is written; only regular files are
// read (a FIFO or directory in a file's place is refused without blocking), and no output may be an input.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <map>
#include <set>

#include "runner_io.h"

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::EValue;
using edgetrain::InputError;
using edgetrain::NonFiniteError;

namespace {

// 2: int8 row_halves codes; 3: signed 8-bit codes; 4: wide codes, k-quant steps; 5: 2-, 3-, 5- and 6-bit codes in
// row_halves with a high_codes plane above 4 bits (edgetrain/export/mesp_graph.py, MatrixFormat)
constexpr int64_t kFormatVersion = 5;

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
    const int fd = edgetrain::open_regular(path, "weights file");
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
    const uint64_t manifest = read<uint64_t>(16);
    need(24, manifest);
    size_t offset = 24 + manifest;
    for (uint32_t i = 0; i < count; ++i) {
      WeightsTensor t;
      const uint32_t name_length = read<uint32_t>(offset);
      need(offset + 4, name_length);
      t.name.assign(reinterpret_cast<const char*>(base_ + offset + 4), name_length);
      offset += 4 + name_length;
      const uint32_t code = read<uint32_t>(offset), ndim = read<uint32_t>(offset + 4);
      offset += 8;
      static const ScalarType types[] = {ScalarType::Float, ScalarType::Long, ScalarType::Byte, ScalarType::Half,
                                         ScalarType::Char};
      if (code > 4 || ndim > 8) throw InputError(path_ + ": the header is damaged (tensor " + t.name + ")");
      t.type = types[code];
      // A tensor's elements fit in the file, so a dimension or product past its size is damage; checked before
      // multiplying so that no product wraps around to a small size over a huge shape.
      uint64_t numel = 1;
      for (uint32_t d = 0; d < ndim; ++d) {
        const int64_t dim = read<int64_t>(offset + 8 * d);
        if (dim < 0 || dim > INT32_MAX || (dim > 0 && numel > size_ / static_cast<uint64_t>(dim))) {
          throw InputError(path_ + ": the header is damaged (tensor " + t.name + " has a dimension of " +
                           std::to_string(dim) + ")");
        }
        t.sizes.push_back(static_cast<SizesType>(dim));
        numel *= static_cast<uint64_t>(dim);
      }
      offset += 8 * ndim;
      const uint64_t data_offset = read<uint64_t>(offset);
      t.nbytes = read<uint64_t>(offset + 8);
      offset += 16;
      if (t.nbytes != numel * element_size(t.type) || data_offset > size_ || t.nbytes > size_ - data_offset ||
          data_offset % element_size(t.type) != 0) {
        throw InputError(path_ + ": the header is damaged (tensor " + t.name + ": " + std::to_string(t.nbytes) +
                         " bytes at offset " + std::to_string(data_offset) + " of a " + std::to_string(size_) +
                         "-byte file)");
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
  // Whether [offset, offset + length) lies in the file, without forming a sum that could wrap.
  void need(uint64_t offset, uint64_t length) const {
    if (offset > size_ || length > size_ - offset) {
      throw InputError(path_ + ": the header is damaged (it runs past the end of the file)");
    }
  }
  template <typename T>
  T read(size_t offset) const {
    need(offset, sizeof(T));
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

// What training has changed: per block the adapter vector and its two AdamW moments, the step count, and the
// CRC-32 of the batches it trained on (in order).
struct State {
  uint64_t steps_done = 0;
  uint32_t batches_crc = 0;
  std::vector<std::vector<float>> adapters, exp_avg, exp_avg_sq;
};

constexpr size_t kCheckpointHeader = 12 + 4 + 4 + 24 + 5 * 8;

// "EDGECKP2", u32 CRC-32 of the rest, u32 program crc, u32 CRC-32 of the batches trained on, u64 steps done,
// u64 blocks, u64 adapter numel, f64 lr, beta1, beta2, eps, weight decay, then per block its adapters, exp_avg
// and exp_avg_sq (float32). A resume is bit for bit only on the same program, batches and settings, so all
// three are recorded and checked.
std::string checkpoint_bytes(const State& state, const Shape& shape, const AdamW& adamw) {
  std::string body;
  auto put = [&body](const void* p, size_t n) { body.append(static_cast<const char*>(p), n); };
  put(&shape.program_crc, 4);
  put(&state.batches_crc, 4);
  put(&state.steps_done, 8);
  const uint64_t blocks = static_cast<uint64_t>(shape.blocks), numel = static_cast<uint64_t>(shape.adapter_numel);
  put(&blocks, 8);
  put(&numel, 8);
  for (const double* setting : {&adamw.lr, &adamw.beta1, &adamw.beta2, &adamw.eps, &adamw.weight_decay}) {
    put(setting, 8);
  }
  for (int64_t b = 0; b < shape.blocks; ++b) {
    for (const auto* v : {&state.adapters[b], &state.exp_avg[b], &state.exp_avg_sq[b]}) put(v->data(), 4 * v->size());
  }
  const uint32_t crc = edgetrain::crc32(reinterpret_cast<const unsigned char*>(body.data()), body.size());
  return std::string("EDGECKP2") + std::string(reinterpret_cast<const char*>(&crc), 4) + body;
}

uint32_t batches_crc(const edgetrain::BatchFile& batches, uint64_t count) {
  return edgetrain::crc32(reinterpret_cast<const unsigned char*>(batches.data.data()), count * batches.batch_bytes);
}

// False where there is no checkpoint yet (a first run). Anything else that is not this run's own checkpoint is
// refused, never trained over: the file is left as it is.
bool load_checkpoint(const std::string& path, const std::string& batches_path, const edgetrain::BatchFile& batches,
                     const Shape& shape, const AdamW& adamw, State& state) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0 && errno == ENOENT) return false;
  const std::string data = edgetrain::read_regular(
      path, "checkpoint", kCheckpointHeader + static_cast<uint64_t>(shape.blocks) * 12 * static_cast<uint64_t>(shape.adapter_numel));
  if (data.size() >= 8 && data.compare(0, 8, "EDGECKP1") == 0) {
    throw InputError(path + ": a checkpoint of an older edgetrain_mesp_runner, which did not record the batches and "
                     "AdamW settings it trained with: it cannot be resumed bit for bit (remove it to start over)");
  }
  if (data.size() < 12 || data.compare(0, 8, "EDGECKP2") != 0) throw InputError(path + ": not a runner checkpoint");
  uint32_t crc, program_crc, trained_crc;
  std::memcpy(&crc, data.data() + 8, 4);
  if (data.size() < kCheckpointHeader ||
      edgetrain::crc32(reinterpret_cast<const unsigned char*>(data.data()) + 12, data.size() - 12) != crc) {
    throw InputError(path + ": the checkpoint is damaged or truncated (its checksum does not match)");
  }
  std::memcpy(&program_crc, data.data() + 12, 4);
  if (program_crc != shape.program_crc) throw InputError(path + ": a checkpoint of another program");
  std::memcpy(&trained_crc, data.data() + 16, 4);
  uint64_t steps_done, blocks, numel;
  std::memcpy(&steps_done, data.data() + 20, 8);
  std::memcpy(&blocks, data.data() + 28, 8);
  std::memcpy(&numel, data.data() + 36, 8);
  const uint64_t want_blocks = static_cast<uint64_t>(shape.blocks), want_numel = static_cast<uint64_t>(shape.adapter_numel);
  if (blocks != want_blocks || numel != want_numel || data.size() != kCheckpointHeader + want_blocks * 3 * 4 * want_numel) {
    throw InputError(path + ": the checkpoint's sizes are not its program's (" + std::to_string(data.size()) +
                     " bytes): damaged, or written by another program");
  }
  if (steps_done > batches.count) {
    throw InputError(path + ": the checkpoint is after step " + std::to_string(steps_done) + ", but " + batches_path +
                     " holds " + std::to_string(batches.count) + " batches: it trained on other batches");
  }
  if (batches_crc(batches, steps_done) != trained_crc) {
    throw InputError(path + ": the checkpoint trained on other batches than the first " + std::to_string(steps_done) +
                     " of " + batches_path);
  }
  const char* names[] = {"--lr", "--beta1", "--beta2", "--eps", "--weight-decay"};
  const double wanted[] = {adamw.lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay};
  for (size_t i = 0; i < 5; ++i) {
    double recorded;
    std::memcpy(&recorded, data.data() + 44 + 8 * i, 8);
    if (std::memcmp(&recorded, &wanted[i], 8) != 0) {
      throw InputError(path + ": the checkpoint was trained with " + names[i] + " " +
                       edgetrain::number_text(recorded) + ", not " + edgetrain::number_text(wanted[i]) +
                       ": resume with the same settings (or remove it to start over)");
    }
  }
  std::vector<std::vector<float>> adapters(blocks), exp_avg(blocks), exp_avg_sq(blocks);
  const char* p = data.data() + kCheckpointHeader;
  for (size_t b = 0; b < blocks; ++b) {
    for (auto* v : {&adapters[b], &exp_avg[b], &exp_avg_sq[b]}) {
      v->resize(numel);
      std::memcpy(v->data(), p, 4 * numel);
      p += 4 * numel;
      for (float x : *v) {
        // A second moment is a mean of squares: negative, like non-finite, is damage.
        if (!std::isfinite(x) || (v == &exp_avg_sq[b] && x < 0)) {
          throw InputError(path + ": the checkpoint holds a non-finite or impossible value (block " +
                           std::to_string(b) + "): damaged");
        }
      }
    }
  }
  state.steps_done = steps_done;
  state.batches_crc = trained_crc;
  state.adapters = std::move(adapters);
  state.exp_avg = std::move(exp_avg);
  state.exp_avg_sq = std::move(exp_avg_sq);
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
      : program_path_(program_path),
        weights_(weights_path),
        module_(program_path, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, /*share_memory_arenas=*/true),
        adamw_(adamw) {
    const std::vector<int64_t> meta = weights_.longs("program.meta");
    if (meta.size() != 8 || meta[0] != kFormatVersion) {
      // An export from another edgetrain holds its codes in another layout: the program would misread them.
      throw InputError(weights_path + ": not a MeSP program's weights file of format version " +
                       std::to_string(kFormatVersion) +
                       (meta.empty() ? std::string()
                                     : " (it says " + std::to_string(meta[0]) + "): export it again with this edgetrain"));
    }
    for (size_t i = 1; i < 7; ++i) {
      if (meta[i] < 1 || meta[i] > INT32_MAX) {
        throw InputError(weights_path + ": program.meta is damaged (a size of " + std::to_string(meta[i]) + ")");
      }
    }
    if (meta[7] < 0 || meta[7] > UINT32_MAX) throw InputError(weights_path + ": program.meta is damaged");
    shape_ = {meta[1], meta[2], meta[3], meta[4], meta[5], meta[6], static_cast<uint32_t>(meta[7])};
    const std::string bytes = edgetrain::read_regular(program_path, "program");
    if (edgetrain::crc32(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) != shape_.program_crc) {
      throw InputError(program_path + " is not the program " + weights_path +
                       " was written with (another model or shape, or a damaged file): export them again together");
    }
    // The full flatbuffer check: the program is read from the app's files, which can be anything.
    if (module_.load(executorch::runtime::Program::Verification::InternalConsistency) !=
        executorch::runtime::Error::Ok) {
      throw InputError("ExecuTorch cannot load " + program_path + ": damaged, or not a .pte");
    }
    for (const char* method : {"embed", "block_forward", "block_backward", "head", "adamw"}) {
      if (module_.load_method(method) != executorch::runtime::Error::Ok) {
        throw InputError(program_path + ": no method " + std::string(method) + ": not a MeSP program");
      }
    }
    // Sizes are allocated from program.meta below: they must be the program's own first.
    const SizesType batch = static_cast<SizesType>(shape_.batch), seq = static_cast<SizesType>(shape_.seq);
    expect_input("embed", 0, ScalarType::Long, {batch, seq});
    expect_input("block_forward", 0, ScalarType::Float, {batch, seq, static_cast<SizesType>(shape_.hidden)});
    expect_input("block_forward", 3, ScalarType::Float, {static_cast<SizesType>(shape_.adapter_numel)});
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

  // A batch's inputs then targets, [batch, seq] int64 each: ids in the vocabulary, targets too or -100.
  void check_batch(const int64_t* ids, uint64_t batch_index, const std::string& path) const {
    const size_t tokens = static_cast<size_t>(shape_.batch * shape_.seq);
    const int64_t* targets = ids + tokens;
    for (size_t i = 0; i < tokens; ++i) {
      if (ids[i] < 0 || ids[i] >= shape_.vocab || (targets[i] != -100 && (targets[i] < 0 || targets[i] >= shape_.vocab))) {
        throw InputError(path + ": batch " + std::to_string(batch_index) + ": token id " +
                         std::to_string(ids[i] < 0 || ids[i] >= shape_.vocab ? ids[i] : targets[i]) +
                         " outside the vocabulary [0, " + std::to_string(shape_.vocab) + ")");
      }
    }
  }

  // One step on (inputs, targets) [batch, seq] int64, checked by check_batch; the loss before the update.
  float step(const int64_t* ids, const int64_t* targets, uint64_t batch_index) {
    const std::vector<SizesType> token_sizes = {static_cast<SizesType>(shape_.batch), static_cast<SizesType>(shape_.seq)};
    const std::vector<SizesType> hidden_sizes = {token_sizes[0], token_sizes[1], static_cast<SizesType>(shape_.hidden)};
    const std::vector<SizesType> vector_sizes = {static_cast<SizesType>(shape_.adapter_numel)};
    TensorPtr ids_tensor = make_tensor_ptr(token_sizes, const_cast<int64_t*>(ids), ScalarType::Long);
    TensorPtr targets_tensor = make_tensor_ptr(token_sizes, const_cast<int64_t*>(targets), ScalarType::Long);

    copy_out(nth(run("embed", with(embed_, {EValue(*ids_tensor)})), 0), stored_inputs_[0]);
    for (int64_t b = 0; b < shape_.blocks; ++b) {
      TensorPtr x = floats(stored_inputs_[b], hidden_sizes);
      TensorPtr adapters = floats(state_.adapters[b], vector_sizes);
      copy_out(nth(run("block_forward", with(blocks_[b], {EValue(*x), EValue(*cos_), EValue(*sin_), EValue(*adapters)})),
                   0), stored_inputs_[b + 1]);
    }
    TensorPtr final_hidden = floats(stored_inputs_[shape_.blocks], hidden_sizes);
    const auto head = run("head", with(head_, {EValue(*final_hidden), EValue(*targets_tensor)}));
    const float loss = output(nth(head, 0), 1).const_data_ptr<float>()[0];
    if (!std::isfinite(loss)) throw NonFiniteError("batch " + std::to_string(batch_index) + ": the loss is not finite");
    copy_out(nth(head, 1), grad_);

    std::vector<std::vector<float>> grads(static_cast<size_t>(shape_.blocks));
    for (int64_t b = shape_.blocks - 1; b >= 0; --b) {
      TensorPtr x = floats(stored_inputs_[b], hidden_sizes);
      TensorPtr grad_out = floats(grad_, hidden_sizes);
      TensorPtr adapters = floats(state_.adapters[b], vector_sizes);
      const auto out = run("block_backward", with(blocks_[b], {EValue(*x), EValue(*grad_out), EValue(*cos_),
                                                              EValue(*sin_), EValue(*adapters)}));
      grads[b].resize(static_cast<size_t>(shape_.adapter_numel));
      copy_out(nth(out, 1), grads[b]);
      if (!all_finite(grads[b].data(), grads[b].size())) {
        throw NonFiniteError("batch " + std::to_string(batch_index) + ": a non-finite gradient in block " +
                             std::to_string(b));
      }
      copy_out(nth(out, 0), grad_);
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
          const Tensor& t = output(nth(out, i), static_cast<size_t>(shape_.adapter_numel));
          if (!keep && !all_finite(t.const_data_ptr<float>(), static_cast<size_t>(t.numel()))) {
            throw NonFiniteError("batch " + std::to_string(batch_index) + ": the AdamW update of block " +
                            std::to_string(b) + " came out non-finite");
          }
        }
        if (keep) {
          copy_out(nth(out, 0), state_.adapters[b]);
          copy_out(nth(out, 1), state_.exp_avg[b]);
          copy_out(nth(out, 2), state_.exp_avg_sq[b]);
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
    if (names.empty() || layout.size() != 3 * names.size()) {
      throw InputError(weights_.path() + ": adapters.layout and .names disagree");
    }
    // The slices are read out of each block's adapter vector: each must lie inside it, apart from the others,
    // under a name of its own that the adapter file's JSON header can hold as it is.
    const int64_t numel = shape_.adapter_numel;
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t offset = layout[3 * i], rows = layout[3 * i + 1], cols = layout[3 * i + 2];
      const bool plain = !names[i].empty() && std::all_of(names[i].begin(), names[i].end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
      });
      if (!plain || offset < 0 || rows < 1 || cols < 1 || rows > numel || cols > numel / rows ||
          offset > numel - rows * cols) {
        throw InputError(weights_.path() + ": adapters.layout or .names is damaged (entry " + std::to_string(i) + ")");
      }
      spans.push_back({offset, offset + rows * cols});
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].first < spans[i - 1].second) throw InputError(weights_.path() + ": adapters.layout overlaps itself");
    }
    if (std::set<std::string>(names.begin(), names.end()).size() != names.size()) {
      throw InputError(weights_.path() + ": adapters.names names a slice twice");
    }
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
    if (metadata.size() < 2 || metadata.front() != '{' || metadata.back() != '}') {
      throw InputError(weights_.path() + ": adapters.metadata is not a JSON object");
    }
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
  void copy_out(const EValue& value, std::vector<float>& into) const {
    const Tensor& t = output(value, into.size());
    std::memcpy(into.data(), t.const_data_ptr<float>(), 4 * into.size());
  }
  const Tensor& output(const EValue& value, size_t numel) const {
    if (!value.isTensor() || value.toTensor().scalar_type() != ScalarType::Float ||
        static_cast<size_t>(value.toTensor().numel()) != numel) {
      throw InputError(program_path_ + ": a method's output is not the float32 tensor of " + std::to_string(numel) +
                       " elements " + weights_.path() + " describes: the files do not belong together");
    }
    return value.toTensor();
  }
  static const EValue& nth(const std::vector<EValue>& outputs, size_t index) {
    if (index >= outputs.size()) throw InputError("a method returned fewer outputs than a MeSP program's");
    return outputs[index];
  }
  // The program's own input `index` of `method` against what the weights file makes of it.
  void expect_input(const std::string& method, size_t index, ScalarType type, const std::vector<SizesType>& sizes) {
    const auto meta = module_.method_meta(method);
    if (!meta.ok() || index >= meta->num_inputs()) {
      throw InputError(program_path_ + ": method " + method + " takes fewer inputs than " + weights_.path() +
                       " gives it: the files do not belong together");
    }
    const auto info = meta->input_tensor_meta(index);
    if (!info.ok()) {
      throw InputError(program_path_ + ": method " + method + "'s input " + std::to_string(index) +
                       " is not a tensor: not a MeSP program");
    }
    const std::vector<SizesType> wanted(info->sizes().begin(), info->sizes().end());
    if (info->scalar_type() != type || wanted != sizes) {
      throw InputError(weights_.path() + " does not fit " + program_path_ + ": method " + method + "'s input " +
                       std::to_string(index) + " is " + edgetrain::describe_tensor(type, sizes) +
                       ", the program takes " + edgetrain::describe_tensor(info->scalar_type(), wanted));
    }
  }
  std::vector<EValue> run(const std::string& method, const std::vector<EValue>& inputs) {
    // Every input is checked against the program before the runtime reads it: a tensor of the weights file
    // with another shape or type would otherwise be read past its end.
    const auto meta = module_.method_meta(method);
    if (!meta.ok() || meta->num_inputs() != inputs.size()) {
      throw InputError(weights_.path() + " does not fit " + program_path_ + ": method " + method + " takes " +
                       (meta.ok() ? std::to_string(meta->num_inputs()) : "other") + " inputs, the file gives " +
                       std::to_string(inputs.size()));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& t = inputs[i].toTensor();
      expect_input(method, i, t.scalar_type(), std::vector<SizesType>(t.sizes().begin(), t.sizes().end()));
    }
    auto result = module_.execute(method, inputs);
    if (!result.ok()) {
      throw std::runtime_error("method " + method + " failed (ExecuTorch error " +
                               std::to_string(static_cast<int>(result.error())) + ")");
    }
    return std::move(*result);
  }

  std::string program_path_;
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

int run(int argc, char** argv) {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;
  if (!edgetrain::parse_command_line(argc, argv, {"--weights", "--steps", "--lr", "--beta1", "--beta2", "--eps",
                                                  "--weight-decay", "--checkpoint", "--save"},
                                     {}, positional, options)) {
    usage();
    return 0;
  }
  // A wrong argument count is named before an empty path, as this runner always did: so the paths are checked
  // here, not by parse_command_line.
  edgetrain::check_program_and_batches(positional);
  edgetrain::check_path_flags(options, {"--weights", "--checkpoint", "--save"});
  AdamW adamw;
  uint64_t steps = 0;  // 0: every batch
  if (options.count("--lr")) adamw.lr = edgetrain::number_flag("--lr", options["--lr"], 0, 1e6);
  if (options.count("--beta1")) adamw.beta1 = edgetrain::number_flag("--beta1", options["--beta1"], 0, 0.999999);
  if (options.count("--beta2")) adamw.beta2 = edgetrain::number_flag("--beta2", options["--beta2"], 0, 0.999999999);
  // eps 0 divides by zero wherever a gradient is exactly zero (every LoRA A at the first step).
  if (options.count("--eps")) adamw.eps = edgetrain::number_flag("--eps", options["--eps"], 0, 1, /*low_open=*/true);
  if (options.count("--weight-decay")) {
    adamw.weight_decay = edgetrain::number_flag("--weight-decay", options["--weight-decay"], 0, 1e6);
  }
  if (options.count("--steps")) steps = edgetrain::steps_flag("--steps", options["--steps"]);
  const std::string program = positional[0];
  std::string weights = options.count("--weights") ? options["--weights"] : program;
  if (!options.count("--weights")) {
    const size_t dot = weights.find_last_of('.'), slash = weights.find_last_of('/');
    weights = (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? weights.substr(0, dot) : weights) +
              ".weights";
  }
  const std::string checkpoint = options.count("--checkpoint") ? options["--checkpoint"] : "";
  const std::string save = options.count("--save") ? options["--save"] : "";

  std::vector<edgetrain::OutputPath> outputs;
  if (!checkpoint.empty()) outputs.push_back({"--checkpoint", checkpoint, "the checkpoint"});
  if (!save.empty()) outputs.push_back({"--save", save, "the adapter (--save)"});
  edgetrain::check_outputs_apart({{"the program", program}, {"the weights file", weights},
                                  {"the batch file", positional[1]}}, outputs);

  if (!save.empty()) edgetrain::check_writable(save, "the adapter");
  if (!checkpoint.empty()) edgetrain::check_writable(checkpoint, "the checkpoint");
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
  // Every batch is checked before the first step: a bad one late in the file refuses the run before anything
  // is written, not after some steps' checkpoints.
  for (uint64_t b = 0; b < batches.count; ++b) {
    runner.check_batch(reinterpret_cast<const int64_t*>(batches.data.data() + b * batches.batch_bytes), b,
                       positional[1]);
  }
  const uint64_t total = edgetrain::steps_to_run(steps, positional[1], batches);
  // The adapter file is put together once before training, so that one the weights file cannot describe is
  // refused before the steps, not after them.
  if (!save.empty()) runner.adapter_file();
  if (!checkpoint.empty() && load_checkpoint(checkpoint, positional[1], batches, shape, adamw, runner.state())) {
    std::printf("resumed from %s after step %" PRIu64 "\n", checkpoint.c_str(), runner.state().steps_done);
  }
  if (runner.state().steps_done > total) {
    throw InputError(checkpoint + ": the checkpoint is after step " + std::to_string(runner.state().steps_done) +
                     ", past --steps " + std::to_string(total) + ": its adapter is not the one asked for");
  }
  std::printf("program %s: %" PRId64 " blocks, %" PRId64 " adapter weights a block, batches %" PRId64 " x %" PRId64
              ", %" PRIu64 " steps\n", program.c_str(), shape.blocks, shape.adapter_numel, shape.batch, shape.seq, total);
  double first_seconds = 0, total_seconds = 0;
  uint64_t timed = 0;
  for (uint64_t step = runner.state().steps_done; step < total; ++step) {
    const auto started = std::chrono::steady_clock::now();
    const int64_t* ids = reinterpret_cast<const int64_t*>(batches.data.data() + step * batches.batch_bytes);
    const float loss = runner.step(ids, ids + shape.batch * shape.seq, step);
    runner.state().batches_crc = edgetrain::crc32(reinterpret_cast<const unsigned char*>(ids), batches.batch_bytes,
                                                  runner.state().batches_crc);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    (timed++ ? total_seconds : first_seconds) += seconds;
    std::printf("step %" PRIu64 " loss %.9g\n", step + 1, loss);
    std::fflush(stdout);
    if (!checkpoint.empty()) edgetrain::atomic_write(checkpoint, checkpoint_bytes(runner.state(), shape, adamw));
  }
  if (timed > 1) {
    std::printf("timing: first step %.6f s, then %.6f s a step over %" PRIu64 " steps\n", first_seconds,
                total_seconds / static_cast<double>(timed - 1), timed - 1);
  }
  edgetrain::print_peak_memory();
  if (!save.empty()) {
    edgetrain::atomic_write(save, runner.adapter_file());
    std::printf("saved the adapter to %s\n", save.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Earlier steps' checkpoints stand after a non-finite step: what it refuses is only its own change.
  return edgetrain::run_main("edgetrain_mesp_runner", [&] { return run(argc, argv); }, "nothing was changed");
}
