/* One pass from a packed matrix's rows to dense float32 rows: edgetrain.models.quantized's dequantisation
 * (PackedMatrix._dequantize_packed) in the same arithmetic, without its several passes of torch kernels.
 *
 * A row's code of column c is its low-plane value (low_bits of 2, 4 or 8, 8 / low_bits values a byte,
 * column (8 / k) i + t in bits [k t, k (t + 1)) of byte i) plus its high-plane value (high_bits of 0, 1 or 2,
 * the same packing) shifted left by low_bits (edgetrain/models/gguf/packed_rows.py). Then, per group of
 * group_size columns with its scale s and bias b (each block's stored f16 or float32 value as float32, times
 * the group's integer step where the format has steps: exact products):
 *
 *     codebook given:  w = codebook[code] * s
 *     otherwise:       w = (float)(code + offset) * s,  then + b (bias_sign 1) or - b (bias_sign -1)
 *
 * each operation rounded to float32 on its own, as torch's mul_ and add_ round: this file is compiled with
 * -ffp-contract=off so that no multiply and add fuse into one rounding. The integers are exact in float32.
 *
 * Only edgetrain/models/tile_kernel.py calls it: it checks every shape, dtype and address first (this file
 * trusts them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Column (8 / bits) i + t of a plane is in bits [bits t, bits (t + 1)) of byte i. A 1- or 2-bit plane is
 * spread through a table of each byte's 8 or 4 values, already shifted: one load and one store (or an or,
 * for a high plane) a byte, where shifting and masking each value cost a few instructions. */
static void spread_table(int bits, int shift, uint8_t table[256][8]) {
  const int per_byte = 8 / bits;
  for (int byte = 0; byte < 256; ++byte) {
    for (int t = 0; t < 8; ++t) {
      table[byte][t] = t < per_byte ? (uint8_t)(((byte >> (bits * t)) & ((1 << bits) - 1)) << shift) : 0;
    }
  }
}

static void unpack_plane(const uint8_t* restrict plane, int bits, int cols, const uint8_t table[256][8], int high,
                         uint8_t* restrict codes) {
  if (bits == 8) {
    memcpy(codes, plane, (size_t)cols);
    return;
  }
  const int per_byte = 8 / bits;
  const int bytes = cols / per_byte;
  for (int i = 0; i < bytes; ++i) {
    uint8_t* restrict slot = codes + (size_t)i * per_byte;
    const uint8_t* values = table[plane[i]];
    if (high) {
      for (int t = 0; t < per_byte; ++t) slot[t] |= values[t];
    } else {
      for (int t = 0; t < per_byte; ++t) slot[t] = values[t];
    }
  }
}

static void unpack_nibbles(const uint8_t* restrict plane, int cols, uint8_t* restrict codes) {
  for (int i = 0; i < cols / 2; ++i) {
    codes[2 * i] = plane[i] & 15;
    codes[2 * i + 1] = plane[i] >> 4;
  }
}

/* An IEEE half's bits as the float32 it equals (every half is exact in float32; NaNs keep their payload). */
static float half_to_float(uint16_t half) {
  const uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
  uint32_t exponent = (half >> 10) & 0x1Fu, mantissa = half & 0x3FFu, bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

/* Per-group scales (or biases) of one row: each stored value (half or float) a block, times the group's
 * integer step where there are steps, as torch's `stored.to(float32).repeat_interleave(...).mul_(steps)`. */
typedef struct {
  const void* stored;
  int half;             /* stored as IEEE halves, else float32 */
  const int8_t* signed_steps;
  const uint8_t* unsigned_steps;
} GroupValues;

static void group_values(GroupValues values, size_t row, int groups, int block_groups, float* restrict out) {
  const int blocks = groups / block_groups;
  for (int g = 0; g < groups; ++g) {
    const size_t stored = row * (size_t)blocks + (size_t)(g / block_groups);
    float value = values.half ? half_to_float(((const uint16_t*)values.stored)[stored])
                              : ((const float*)values.stored)[stored];
    const size_t step = row * (size_t)groups + (size_t)g;
    if (values.signed_steps != NULL) value = value * (float)values.signed_steps[step];
    if (values.unsigned_steps != NULL) value = value * (float)values.unsigned_steps[step];
    out[g] = value;
  }
}

static void scale_row(const uint8_t* restrict codes, int cols, int group_size, int offset,
                      const float* restrict scales, const float* restrict biases, int bias_sign,
                      const float* restrict codebook, float* restrict out) {
  const int groups = cols / group_size;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* group_codes = codes + g * group_size;
    float* group_out = out + g * group_size;
    const float scale = scales[g];
    if (codebook != NULL) {
      for (int j = 0; j < group_size; ++j) group_out[j] = codebook[group_codes[j]] * scale;
    } else if (biases == NULL) {
      for (int j = 0; j < group_size; ++j) group_out[j] = (float)((int)group_codes[j] + offset) * scale;
    } else if (bias_sign > 0) {
      const float bias = biases[g];
      for (int j = 0; j < group_size; ++j) {
        const float scaled = (float)((int)group_codes[j] + offset) * scale;
        group_out[j] = scaled + bias;
      }
    } else {
      const float bias = biases[g];
      for (int j = 0; j < group_size; ++j) {
        const float scaled = (float)((int)group_codes[j] + offset) * scale;
        group_out[j] = scaled - bias;
      }
    }
  }
}

static void scale_nibbles(const uint8_t* restrict plane, int cols, int group_size, int offset,
                          const float* restrict scales, const float* restrict biases, int bias_sign,
                          float* restrict out) {
  const int groups = cols / group_size, half_group = group_size / 2;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* bytes = plane + g * half_group;
    float* restrict group_out = out + g * group_size;
    const float scale = scales[g];
    // x - b is x + (-b) exactly: negating a float is exact.
    const float bias = biases == NULL ? 0.0f : (bias_sign > 0 ? biases[g] : -biases[g]);
    for (int j = 0; j < half_group; ++j) {
      const float low = (float)((int)(bytes[j] & 15) + offset) * scale;
      const float high = (float)((int)(bytes[j] >> 4) + offset) * scale;
      // Adding a zero bias would turn a -0 product into +0: the symmetric formats add none.
      group_out[2 * j] = biases == NULL ? low : low + bias;
      group_out[2 * j + 1] = biases == NULL ? high : high + bias;
    }
  }
}

static const void* address(unsigned long long value) { return (const void*)(uintptr_t)value; }

/* Rows [first, last) of the tile, with this thread's own scratch of `cols` codes and 2 * groups floats. */
typedef struct {
  float* out;
  const uint8_t* low;
  const uint8_t* high;
  const float* codebook;
  GroupValues scales, biases;
  int low_bits, high_bits, cols, group_size, offset, block_groups, bias_sign;
  size_t low_row, high_row;
} Tile;

static int dequantize_range(const Tile* tile, size_t first, size_t last) {
  const int cols = tile->cols, groups = cols / tile->group_size;
  uint8_t* codes = (uint8_t*)malloc((size_t)cols);
  float* row_scales = (float*)malloc(2 * sizeof(float) * (size_t)groups);
  if (codes == NULL || row_scales == NULL) {
    free(codes);
    free(row_scales);
    return 0;
  }
  float* row_biases = row_scales + groups;
  const int has_biases = tile->biases.stored != NULL;
  uint8_t low_table[256][8], high_table[256][8];
  if (tile->low_bits == 2) spread_table(tile->low_bits, 0, low_table);
  if (tile->high_bits) spread_table(tile->high_bits, tile->low_bits, high_table);
  for (size_t r = first; r < last; ++r) {
    float* out = tile->out + r * (size_t)cols;
    group_values(tile->scales, r, groups, tile->block_groups, row_scales);
    if (has_biases) group_values(tile->biases, r, groups, tile->block_groups, row_biases);
    if (tile->low_bits == 4 && !tile->high_bits && tile->codebook == NULL) {  // the common 4-bit formats: from the bytes
      scale_nibbles(tile->low + r * tile->low_row, cols, tile->group_size, tile->offset, row_scales,
                    has_biases ? row_biases : NULL, tile->bias_sign, out);
      continue;
    }
    if (tile->low_bits == 4) {
      unpack_nibbles(tile->low + r * tile->low_row, cols, codes);
    } else {
      unpack_plane(tile->low + r * tile->low_row, tile->low_bits, cols, low_table, 0, codes);
    }
    if (tile->high_bits) unpack_plane(tile->high + r * tile->high_row, tile->high_bits, cols, high_table, 1, codes);
    scale_row(codes, cols, tile->group_size, tile->offset, row_scales, has_biases ? row_biases : NULL,
              tile->bias_sign, tile->codebook, out);
  }
  free(codes);
  free(row_scales);
  return 1;
}

static PyObject* dequantize_rows(PyObject* self, PyObject* args) {
  unsigned long long out_address, low_address, high_address, scales_address, scale_steps_address, biases_address,
      bias_steps_address, codebook_address;
  int low_bits, high_bits, rows, cols, group_size, offset, half, block_groups, bias_sign, threads;
  if (!PyArg_ParseTuple(args, "KKiKiiiiiKiiKKKiKi", &out_address, &low_address, &low_bits, &high_address,
                        &high_bits, &rows, &cols, &group_size, &offset, &scales_address, &half, &block_groups,
                        &scale_steps_address, &biases_address, &bias_steps_address, &bias_sign,
                        &codebook_address, &threads)) {
    return NULL;
  }
  const Tile tile = {(float*)(uintptr_t)out_address, address(low_address), address(high_address),
                     address(codebook_address),
                     {address(scales_address), half, address(scale_steps_address), NULL},
                     {address(biases_address), half, NULL, address(bias_steps_address)},
                     low_bits, high_bits, cols, group_size, offset, block_groups, bias_sign,
                     (size_t)cols * low_bits / 8, (size_t)cols * high_bits / 8};
  int done = 1;
  Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
  /* Each thread a contiguous share of the rows. The product that reads the tile next splits its output columns
   * (the tile's rows) the same way between the same threads, so each core mostly reads rows it wrote. With the
   * OpenMP runtime torch loaded (libgomp.so.1, one per process), its idle pool threads take the shares. */
  if (threads > 1 && rows > 1) {
    if (threads > rows) threads = rows;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : failed)
    {
      const int index = omp_get_thread_num(), count = omp_get_num_threads();
      const size_t first = (size_t)rows * index / count, last = (size_t)rows * (index + 1) / count;
      failed += !dequantize_range(&tile, first, last);
    }
    done = failed == 0;
  } else {
    done = dequantize_range(&tile, 0, (size_t)rows);
  }
#else
  (void)threads;
  done = dequantize_range(&tile, 0, (size_t)rows);
#endif
  Py_END_ALLOW_THREADS
  if (!done) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

static PyObject* parallel(PyObject* self, PyObject* unused) {
#ifdef _OPENMP
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"dequantize_rows", dequantize_rows, METH_VARARGS,
     "dequantize_rows(out, low, low_bits, high, high_bits, rows, cols, group_size, offset, scales, half, "
     "block_groups, scale_steps, biases, bias_steps, bias_sign, codebook, threads): addresses as integers (0 for "
     "none); see edgetrain/models/tile_kernel.py"},
    {"parallel", parallel, METH_NOARGS, "whether this build shares a tile's rows between threads (OpenMP)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tile_kernel",
                                    "Dequantising a packed matrix's rows in one pass (edgetrain/models/tile_kernel.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__tile_kernel(void) { return PyModule_Create(&module); }
