#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU machine has minutes, not hours): the CUDA tests
# (mesp's compiled block programs among them), mesp's kernel launches eager and compiled against bp,
# asyncfgd's CUDA-streams benchmark and `edgetrain profile` on the torch-cuda backend.
# Runs from the repository root with the machine's own python3 (torch with CUDA, pytest) and edgetrain
# from the source tree; logs go to $OUT (or ./gpu-check) for the docs.
set -uo pipefail
out="${OUT:-gpu-check}"
mkdir -p "$out"
# .gpu_carry (optional, carried by the device call): pure-Python packages the machine lacks (gguf, yaml).
export PYTHONPATH="$PWD:$PWD/.gpu_carry${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
    2>&1 | tee "$out/device.log"
timeout 240 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs \
    tests/test_cuda.py tests/probes/test_probe_cuda.py tests/probes/test_probe_tensors.py tests/models/test_quantized.py \
    tests/models/test_load_model_backends.py tests/methods/test_mesp_compiled.py \
    tests/methods/test_asyncfgd.py::test_cuda_streams_give_the_reference_schedulers_weights \
    tests/promises/test_mutation_kills_asyncfgd.py::test_cuda_stream_workers_issue_each_modules_kernels_on_its_own_stream \
    2>&1 | tee "$out/pytest.log"
# K = 1, 2, 3 at the paper's batch 4 and at 32 (its appendix's larger batches: launches dominate less).
timeout 180 python3 tools/bench_fgd.py --only cuda --repeats 20 --cuda-batch-sizes 4,32 --json "$out/bench_fgd_cuda.json" \
    2>&1 | tee "$out/bench_fgd_cuda.log"
timeout 150 python3 -m edgetrain.cli profile --backend torch-cuda --model qwen2.5-0.5b --seq 256 --steps 3 \
    --methods bp,mebp,mezo,mesp --json "$out/profile_cuda.jsonl" 2>&1 | tee "$out/profile_cuda.log"
# The same shape with the frozen base packed in 4 bits and dequantised tile by tile on the GPU, against the
# fp32 base, side by side; five warm-up steps (a GPU's first steps choose kernels and grow the allocator).
timeout 240 python3 tools/bench_quantized.py --backend torch-cuda --warmup 5 --steps 3 --repeats 2 --gguf '' \
    --json "$out/bench_quantized_cuda.json" 2>&1 | tee "$out/bench_quantized_cuda.log"
# Issue 37's CUDA target: mesp <= 1.0x bp's step with <= 2,000 kernel launches (eager: ~17,000), compiled
# block programs replayed as CUDA graphs (edgetrain/methods/mesp/compiled.py); written before a GPU was lent.
timeout 240 python3 tools/bench_launches.py --device cuda --model qwen2.5-0.5b --seq 256 --arms bp,mesp,mesp:compiled \
    --warmup 3 --steps 5 --json "$out/bench_launches_cuda.json" 2>&1 | tee "$out/bench_launches_cuda.log"
