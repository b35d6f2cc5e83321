// What the native runners share, so that each is written once: the files they read and write (edgetrain's batch
// stream file, safetensors output, crash-safe replacement, the two checksums the formats use: CRC-32 as zlib
// computes it, SHA-256), their command line and output checks, and their exit statuses (run_main).
#pragma once

#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace edgetrain {

// A bad input file or batch: the runners exit with status 3 and name the file.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An output that cannot be written (a missing or read-only directory, a full disk): exit status 4.
struct OutputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A refused command line: one sentence naming the flag or argument, exit status 2.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A step whose loss, gradients or update are not finite: nothing of it is kept, exit status 5.
struct NonFiniteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TensorSpec {
  executorch::aten::ScalarType type;
  std::vector<int64_t> dims;
  size_t element_size;
  size_t numel;
};

struct BatchFile {
  std::vector<TensorSpec> specs;
  uint64_t count = 0;
  std::vector<char> data;  // every batch, back to back
  size_t batch_bytes = 0;
};

inline std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// A descriptor of `path`, refused unless it is (or links to) a regular file. O_NONBLOCK: opening a FIFO for
// reading would otherwise wait forever for a writer; fstat then refuses it. ENOENT is returned as -1 where
// `missing_ok` (a checkpoint not written yet); every other failure names the file.
inline int open_regular(const std::string& path, const std::string& what, bool missing_ok = false) {
  if (path.empty()) throw InputError("the " + what + " path is empty");
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (missing_ok && error == ENOENT) return -1;
    throw InputError("cannot open the " + what + " " + path + ": " + std::strerror(error));
  }
  struct stat info {};
  const bool known = ::fstat(fd, &info) == 0;
  if (!known || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw InputError(path + ": the " + what + " is " + (known ? file_kind(info.st_mode) : "unreadable") +
                     ", not a regular file");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

// The whole of a regular file (see open_regular), read through one descriptor.
// `limit`: a file larger than any the caller reads is refused before it is read.
inline std::string read_regular(const std::string& path, const std::string& what, uint64_t limit = UINT64_MAX) {
  const int fd = open_regular(path, what);
  struct stat info {};
  if (::fstat(fd, &info) == 0 && static_cast<uint64_t>(info.st_size) > limit) {
    ::close(fd);
    throw InputError(path + ": the " + what + " is " + std::to_string(info.st_size) + " bytes, more than " +
                     std::to_string(limit) + ": damaged, or not this run's");
  }
  std::string data;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      throw InputError("cannot read the " + what + " " + path + ": " + std::strerror(error));
    }
    if (n == 0) break;
    data.append(chunk, static_cast<size_t>(n));
  }
  ::close(fd);
  return data;
}

// "EDGEBAT1", u32 tensors per batch, per tensor (u32 dtype 0 float32 / 1 int64, u32 ndim, i64 dims),
// u64 batches, then the data (edgetrain/export/stream_file.py). Every count in the header is checked against
// the bytes the file holds before it sizes anything: the file must hold exactly its batches.
inline BatchFile read_batch_file(const std::string& path) {
  const std::string bytes = read_regular(path, "batch file");
  size_t offset = 0;
  auto take = [&](void* out, size_t n) {
    if (bytes.size() - offset < n) {
      throw InputError(path + ": the batch file's header is truncated (" + std::to_string(bytes.size()) + " bytes)");
    }
    std::memcpy(out, bytes.data() + offset, n);
    offset += n;
  };
  char magic[8];
  if (bytes.size() < 8 || std::memcmp(bytes.data(), "EDGEBAT1", 8) != 0) {
    throw InputError(path + ": not an edgetrain batch file (magic EDGEBAT1 missing)");
  }
  take(magic, 8);
  BatchFile file;
  uint32_t slots = 0;
  take(&slots, 4);
  if (slots != 2) {
    throw InputError(path + ": the header says " + std::to_string(slots) +
                     " tensors per batch; a batch file holds 2 (inputs, targets)");
  }
  for (uint32_t s = 0; s < slots; ++s) {
    TensorSpec spec;
    uint32_t code = 0, ndim = 0;
    take(&code, 4);
    take(&ndim, 4);
    if (code == 0) {
      spec.type = executorch::aten::ScalarType::Float;
      spec.element_size = 4;
    } else if (code == 1) {
      spec.type = executorch::aten::ScalarType::Long;
      spec.element_size = 8;
    } else {
      throw InputError(path + ": the header names an unknown dtype code " + std::to_string(code));
    }
    if (ndim > 8) throw InputError(path + ": the header gives a tensor " + std::to_string(ndim) + " dimensions");
    spec.numel = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      int64_t dim = 0;
      take(&dim, 8);
      // No batch is larger than the file: a product past its size is damage (and would overflow).
      if (dim < 0 || (dim > 0 && spec.numel > bytes.size() / static_cast<uint64_t>(dim))) {
        throw InputError(path + ": the header gives a dimension of " + std::to_string(dim) +
                         ", more than the file holds");
      }
      spec.dims.push_back(dim);
      spec.numel *= static_cast<size_t>(dim);
    }
    file.batch_bytes += spec.numel * spec.element_size;
    file.specs.push_back(spec);
  }
  take(&file.count, 8);
  const uint64_t available = bytes.size() - offset;
  if (file.batch_bytes == 0) throw InputError(path + ": the header describes empty batches");
  if (file.count == 0) throw InputError(path + ": the batch file holds no batches");
  if (available / file.batch_bytes < file.count) {
    throw InputError(path + ": truncated: the header announces " + std::to_string(file.count) + " batches of " +
                     std::to_string(file.batch_bytes) + " bytes, the file holds " + std::to_string(available));
  }
  if (available != file.count * file.batch_bytes) {
    throw InputError(path + ": " + std::to_string(available - file.count * file.batch_bytes) +
                     " bytes past the " + std::to_string(file.count) + " batches its header announces: damaged");
  }
  file.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(offset), bytes.end());
  return file;
}

// The process's peak resident set in kB (Linux's VmHWM: the kernel's own high-water mark, file pages of the
// mapped weights included), or -1 where /proc is not there.
inline long peak_resident_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// After the steps: the peak resident set, where the kernel says it.
inline void print_peak_memory() {
  if (peak_resident_kb() >= 0) std::printf("memory: peak resident %ld kB (VmHWM)\n", peak_resident_kb());
}

// "Float [2, 16]": a tensor's type and sizes, as a refusal names what was given and what was wanted.
template <typename Size>
std::string describe_tensor(executorch::aten::ScalarType type, const std::vector<Size>& sizes) {
  std::string text = std::string(executorch::runtime::toString(type)) + " [";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

inline std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

inline std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash + 1);
}

// Bytes free to this process on the file system holding `path`'s directory; -1 where it cannot be read.
inline long long free_bytes(const std::string& path) {
  struct statvfs stats;
  if (::statvfs(directory_of(path).c_str(), &stats) != 0) return -1;
  return static_cast<long long>(stats.f_bavail) * static_cast<long long>(stats.f_frsize);
}

// A full disk said as such (edgetrain.files.space's words): the path, what it needed, what is free.
inline OutputError no_space(const std::string& path, size_t needed) {
  const long long free = free_bytes(path);
  std::string message = "no space left on the device to write " + path + ": it needs " + std::to_string(needed) +
                        " bytes";
  if (free >= 0) message += ", " + std::to_string(free) + " bytes free in " + directory_of(path);
  return OutputError(message + "; nothing already there was changed (free some space and run it again)");
}

inline bool disk_full(int error) { return error == ENOSPC || error == EDQUOT; }

// Replace `path` by `bytes`: written to a temporary beside it, flushed to disk, renamed over it, so a kill at
// any moment leaves the old file or the whole new one. A disk without room for them is refused before anything
// is written; one that fills meanwhile (another writer) removes the temporary and says so.
inline void atomic_write(const std::string& path, const std::string& bytes) {
  const long long free = free_bytes(path);
  if (free >= 0 && static_cast<unsigned long long>(free) < bytes.size()) throw no_space(path, bytes.size());
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    if (disk_full(errno)) throw no_space(path, bytes.size());
    throw OutputError("cannot write " + tmp + ": " + std::strerror(errno));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      if (disk_full(error)) throw no_space(path, bytes.size());
      throw OutputError("cannot write " + tmp + ": " + std::strerror(error));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    if (disk_full(error)) throw no_space(path, bytes.size());
    throw OutputError("cannot flush " + tmp + ": " + std::strerror(error));
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw OutputError("cannot flush " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw OutputError("cannot rename " + tmp + " to " + path);
  }
  const int dir = ::open(directory_of(path).c_str(), O_RDONLY);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

// Fail before any work when `path` could not be written later: an existing path must be a regular file (a
// directory or FIFO in its place is not replaced), and its temporary is created and removed again.
inline void check_writable(const std::string& path, const std::string& what) {
  if (path.empty()) throw OutputError("the " + what + " path is empty");
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode)) {
    throw OutputError("cannot write " + what + " " + path + ": it is " + file_kind(info.st_mode) +
                      ", not a regular file");
  }
  const std::string tmp = path + ".tmp";
  if (::lstat(tmp.c_str(), &info) == 0 && !S_ISREG(info.st_mode)) {
    throw OutputError("cannot write " + what + " " + path + ": its temporary " + tmp + " is " +
                      file_kind(info.st_mode));
  }
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK, 0644);
  if (fd < 0) throw OutputError("cannot write " + what + " " + path + ": " + std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

// Who a path names, for telling two paths apart: device and inode where it exists (symbolic and hard links
// alike), else its resolved directory and name.
inline std::string file_identity(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    return "inode " + std::to_string(info.st_dev) + ":" + std::to_string(info.st_ino);
  }
  const size_t slash = path.find_last_of('/');
  const std::string directory = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  char resolved[PATH_MAX];
  if (::realpath(directory.c_str(), resolved) == nullptr) return "path " + path;
  const std::string prefix = std::string(resolved) == "/" ? "" : std::string(resolved);
  return "path " + prefix + "/" + path.substr(slash == std::string::npos ? 0 : slash + 1);
}

// `value` with `digits` significant digits (17 by default: two settings that print alike are the same double).
inline std::string number_text(double value, int digits = 17) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.*g", digits, value);
  return text;
}

// A finite number in [low, high] (or (low, high] where `low_open`), written in full: "1e309", "nan", "", "1x",
// " 1" and the like are refused, not read as something else.
inline double number_flag(const std::string& flag, const std::string& text, double low, double high,
                          bool low_open = false) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || used != text.size() ||
      !std::isfinite(value) || value < low || (low_open && value == low) || value > high) {
    throw UsageError(flag + " takes a number in " + (low_open ? "(" : "[") + number_text(low, 9) + ", " +
                     number_text(high, 9) + "], not '" + text + "'");
  }
  return value;
}

// A step count: digits only ("1.5", "1e3", "-1", "+1" refused), at least 1, and no more than a uint64 holds.
inline uint64_t steps_flag(const std::string& flag, const std::string& text) {
  const bool digits = !text.empty() && text.size() <= 19 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  const uint64_t value = digits ? std::stoull(text) : 0;
  if (!digits || value == 0) throw UsageError(flag + " takes a whole number of steps from 1, not '" + text + "'");
  return value;
}

// An empty path given to one of `path_flags` is refused: "" is no file, and would not be read as the default.
inline void check_path_flags(const std::map<std::string, std::string>& options,
                             const std::vector<std::string>& path_flags) {
  for (const std::string& flag : path_flags) {
    const auto given = options.find(flag);
    if (given != options.end() && given->second.empty()) throw UsageError(flag + " needs a path, not ''");
  }
}

// A runner's command line: `positional` arguments and `--flag value` pairs of the `known` flags, each at most
// once. False where -h/--help asked for the usage. An unknown flag, a flag without its value (or whose value is
// itself a flag: "--save --lr 1e-3" forgot the path), a flag given twice, and an empty path of `path_flags`
// (check_path_flags) are refused.
inline bool parse_command_line(int argc, char** argv, const std::vector<std::string>& known,
                               const std::vector<std::string>& path_flags, std::vector<std::string>& positional,
                               std::map<std::string, std::string>& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") return false;
    if (arg.size() > 1 && arg[0] == '-') {
      if (std::find(known.begin(), known.end(), arg) == known.end()) throw UsageError("unknown option '" + arg + "'");
      if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0) throw UsageError(arg + " needs a value");
      if (options.count(arg)) throw UsageError(arg + " is given twice ('" + options[arg] + "', '" + argv[i + 1] + "')");
      options[arg] = argv[++i];
    } else {
      positional.push_back(arg);
    }
  }
  check_path_flags(options, path_flags);
  return true;
}

// The program and the batch file, in that order: a third argument is a mistyped flag or path, never ignored.
inline void check_program_and_batches(const std::vector<std::string>& positional) {
  if (positional.size() != 2) {
    throw UsageError("takes PROGRAM.pte and BATCHES.bin, not " + std::to_string(positional.size()) + " arguments");
  }
}

// The steps to run: every batch where --steps was not given (0), else --steps, which the file must hold.
inline uint64_t steps_to_run(uint64_t steps, const std::string& batches_path, const BatchFile& batches) {
  if (steps > batches.count) {
    throw InputError(batches_path + " holds " + std::to_string(batches.count) + " batches, fewer than --steps " +
                     std::to_string(steps));
  }
  return steps == 0 ? batches.count : steps;
}

// An output of a run: its flag, its path, and what a refusal calls it when another output would land on it.
struct OutputPath {
  std::string flag, path, what;
};

// No output may land on another file of the run: an input, another output, or their temporaries (atomic_write
// goes through PATH.tmp). Inputs are (what, path) pairs. Refused as usage (status 2).
inline void check_outputs_apart(const std::vector<std::pair<std::string, std::string>>& inputs,
                                const std::vector<OutputPath>& outputs) {
  for (const OutputPath& output : outputs) {
    for (const std::string& written : {output.path, output.path + ".tmp"}) {
      auto others = inputs;
      for (const OutputPath& other : outputs) {
        if (other.flag != output.flag) others.push_back({other.what, other.path});
      }
      for (const auto& [what, other] : others) {
        if (file_identity(written) == file_identity(other)) {
          throw UsageError(output.flag + " " + output.path + " would write over " + what + " " + other +
                           ": give the outputs paths of their own");
        }
      }
    }
  }
}

// main() of a runner: the refusals above as exit statuses, each one sentence on stderr naming the runner.
// 2 usage, 3 a bad input file or batch, 4 an output that cannot be written, 5 a non-finite step (said with
// `non_finite_outcome`: what a runner that writes along the way kept differs from one that writes at the end),
// 1 anything else (an internal error).
inline int run_main(const char* runner, const std::function<int()>& run,
                    const char* non_finite_outcome = "nothing was written") {
  // A reader that closes the pipe of "step N" lines must not kill the run before what it writes is whole.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return run();
  } catch (const UsageError& error) {
    std::fprintf(stderr, "%s: error: %s (--help for the usage)\n", runner, error.what());
    return 2;
  } catch (const InputError& error) {
    std::fprintf(stderr, "%s: error: %s\n", runner, error.what());
    return 3;
  } catch (const OutputError& error) {
    std::fprintf(stderr, "%s: error: %s\n", runner, error.what());
    return 4;
  } catch (const NonFiniteError& error) {
    std::fprintf(stderr, "%s: error: %s; %s\n", runner, error.what(), non_finite_outcome);
    return 5;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s: error: %s\n", runner, error.what());
    return 1;
  }
}

struct NamedFloats {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;
  size_t numel;
};

// A safetensors file of float32 tensors: u64 header length, JSON header (padded to 8 bytes), the data.
// `metadata_json`, when given, is the "__metadata__" object's JSON text.
inline std::string safetensors_bytes(const std::vector<NamedFloats>& tensors, const std::string& metadata_json = "") {
  std::ostringstream header;
  header << "{";
  if (!metadata_json.empty()) header << "\"__metadata__\":" << metadata_json << (tensors.empty() ? "" : ",");
  size_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedFloats& t = tensors[i];
    header << (i ? "," : "") << "\"" << json_escape(t.name) << "\":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) header << (d ? "," : "") << t.shape[d];
    header << "],\"data_offsets\":[" << offset << "," << offset + 4 * t.numel << "]}";
    offset += 4 * t.numel;
  }
  header << "}";
  std::string text = header.str();
  while (text.size() % 8) text.push_back(' ');  // the format pads the header to 8 bytes
  std::string out;
  const uint64_t length = text.size();
  out.append(reinterpret_cast<const char*>(&length), sizeof(length));
  out += text;
  for (const NamedFloats& t : tensors) out.append(reinterpret_cast<const char*>(t.data), 4 * t.numel);
  return out;
}

inline uint32_t crc32(const unsigned char* data, size_t size, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// SHA-256 (FIPS 180-4), for the checksum edgetrain's adapter files carry.
class Sha256 {
 public:
  void update(const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    length_ += size;
    while (size) {
      const size_t take = std::min(size, size_t{64} - buffered_);
      std::memcpy(buffer_ + buffered_, bytes, take);
      buffered_ += take;
      bytes += take;
      size -= take;
      if (buffered_ == 64) {
        block(buffer_);
        buffered_ = 0;
      }
    }
  }
  void update(const std::string& text) { update(text.data(), text.size()); }

  std::string hex() {
    const uint64_t bits = length_ * 8;
    const unsigned char one = 0x80, zero = 0;
    update(&one, 1);
    while (buffered_ != 56) update(&zero, 1);
    unsigned char tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(tail, 8);
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (uint32_t word : state_) {
      for (int i = 28; i >= 0; i -= 4) out.push_back(digits[(word >> i) & 0xF]);
    }
    return out;
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void block(const unsigned char* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t{p[4 * i]} << 24) | (uint32_t{p[4 * i + 1]} << 16) | (uint32_t{p[4 * i + 2]} << 8) | p[4 * i + 3];
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char buffer_[64] = {};
  size_t buffered_ = 0;
  uint64_t length_ = 0;
};

}  // namespace edgetrain
