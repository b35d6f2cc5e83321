#!/usr/bin/env python3
"""MeSP inside the app, measured: the native runners' peak memory and step time against torch's `mesp`, side by
side in one run (issue 35's targets). Every arm trains the same model on the same batches in a fresh process:

  torch mesp       Learner(method="mesp", optimizer="adamw") on the model as loaded (a GGUF's blocks packed), in
                   a fresh interpreter; its peak above that interpreter's own floor with torch and edgetrain
                   imported (the runtime an app would not carry)
  runner, packed   edgetrain_mesp_runner on `export --method mesp` of the same model (its products and tensor
                   operators on XNNPACK, the default): the process's whole peak (its runtime included, the mapped
                   weights file's resident pages included)
  packed, no XNNPACK  the same, `--delegate none`: everything on ExecuTorch's own CPU kernels
  runner, fp32     the same program exported from the dequantised model (the frozen weights dense)
  joint graph      edgetrain_et_runner on today's `edgetrain export` (one forward-backward program, fp32
                   weights, SGD); --skip-joint leaves it out (its export of a 30-block model is long)

Peaks are the kernel's high-water mark of each process as it reports it (VmHWM; wait4's ru_maxrss would count
the forked copy of this process before exec). Step times are the median
of the steps after the first (which pages the weights in); the runners report their own. torch runs its
default intra-op threads (printed); the runners run ExecuTorch's kernels on one thread and XNNPACK on its pool.
The two arms the step target compares (torch mesp, runner packed) run --repeats times each, alternating, after
every export: on a shared machine one process's step time moved by up to 40% between identical runs, and
alternation spreads whatever else the machine is doing over both. Their rows are the medians of the repeats
(each repeat is printed).

  .venv/bin/python tools/bench_export.py --model ~/.cache/edgetrain/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
  .venv/bin/python tools/bench_export.py --model tiny --seq 32 --steps 3 --repeats 1   # a quick look
  --work DIR keeps the exports: a second run with the same flags measures again without exporting again
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20

# Runs in the child: argv[1] a JSON of options; prints one JSON line.
_TORCH_CHILD = """
import json, statistics, sys, time
import torch, edgetrain, edgetrain.training.learner
from edgetrain.probes import linux
def hwm():
    return linux._read_kb_field(linux.Path("/proc/self/status"), "VmHWM") or 0
floor = hwm()
options = json.loads(sys.argv[1])
from edgetrain.export import make_trainable, read_batch_file
model = make_trainable(edgetrain.load_model(options["model"]), "lora", rank=options["rank"])
if options["layers"]:
    del model.blocks[options["layers"]:]
learner = edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-3, probe=False)
times = []
for batch in read_batch_file(options["batches"]):
    start = time.perf_counter()
    learner.step(batch)
    times.append(time.perf_counter() - start)
print(json.dumps({"peak_bytes": hwm(), "floor_bytes": floor, "step_seconds": statistics.median(times[1:]),
                  "threads": torch.get_num_threads()}))
"""


def run(command: Sequence[str]) -> str:
    """The stdout of a child that must succeed. Its peak comes from what it reports of itself (VmHWM): wait4's
    ru_maxrss would count the forked copy of this process before exec."""
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command[:3]))} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def runner_peak_bytes(output: str) -> int:
    match = re.search(r"memory: peak resident (\d+) kB", output)
    if match is None:
        raise SystemExit(f"the runner printed no peak (not Linux?):\n{output[-500:]}")
    return int(match.group(1)) * 1024


def runner_step_seconds(output: str) -> float:
    match = re.search(r"then ([0-9.]+) s a step", output)
    if match is None:
        raise SystemExit(f"the runner printed no timing (needs at least 2 steps):\n{output[-500:]}")
    return float(match.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or a preset")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of torch mesp and the packed runner each, alternating (their medians are reported)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N blocks (every arm alike)")
    parser.add_argument("--skip-joint", action="store_true", help="leave out the joint-graph export")
    parser.add_argument("--build", default=str(REPO / "build" / "native"), help="where the runners are built")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--work", default=None,
                        help="the folder for the exports and batches (default: a new temporary one); a folder an "
                             "earlier run with the same flags filled is reused, its programs not exported again")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    import torch

    import edgetrain
    from edgetrain.cli.export_stream import batch_stream
    from edgetrain.export import export_training, make_trainable, write_batch_file
    from edgetrain.export.mesp_program import export_mesp_program
    from edgetrain.export.native import MESP_RUNNER, RUNNER, build_runner

    mesp_runner = build_runner(args.build, target=MESP_RUNNER)
    joint_runner = None if args.skip_joint else build_runner(args.build, target=RUNNER)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    # What the folder's exports were made from: written once all of them are, so a run stopped half-way reuses none.
    flags = {name: getattr(args, name) for name in ("model", "seq", "batch", "rank", "steps", "layers")}
    flags_file = work / "flags.json"
    reuse = flags_file.exists() and json.loads(flags_file.read_text()) == flags
    if flags_file.exists() and not reuse:
        parser.error(f"--work {work} holds the exports of other flags ({flags_file.read_text().strip()}); "
                     "name another folder")

    def lora_model(**options):
        torch.manual_seed(0)
        model = make_trainable(edgetrain.load_model(args.model, **options), "lora", rank=args.rank)
        if args.layers:
            del model.blocks[args.layers:]
        return model

    model = lora_model()
    stream_args = argparse.Namespace(data=None, batch=args.batch, seed=0, seq=args.seq)
    batches = list(itertools.islice(batch_stream(model, stream_args), args.steps))
    batch_file = work / "batches.bin"
    if not reuse:
        write_batch_file(batch_file, batches)
    print(f"model {args.model} ({len(model.blocks)} blocks, LoRA r{args.rank}), seq {args.seq} x batch {args.batch}, "
          f"{args.steps} steps an arm" + (f"; the exports in {work} reused" if reuse else ""), flush=True)

    if reuse:
        programs = {"runner, packed": work / "packed.pte", "packed, no XNNPACK": work / "packed-plain.pte",
                    "runner, fp32": work / "fp32.pte"}
    else:
        programs = {"runner, packed": export_mesp_program(model, args.batch, args.seq, work / "packed.pte")[0],
                    "packed, no XNNPACK": export_mesp_program(model, args.batch, args.seq,
                                                              work / "packed-plain.pte", delegate="none")[0]}
        programs["runner, fp32"] = export_mesp_program(lora_model(quantized=False), args.batch, args.seq,
                                                       work / "fp32.pte")[0]
        flags_file.write_text(json.dumps(flags))
    del model

    def torch_arm() -> dict:
        output = run([sys.executable, "-c", _TORCH_CHILD, json.dumps(
            {"model": args.model, "rank": args.rank, "layers": args.layers, "batches": str(batch_file)})])
        result = json.loads(output.strip().splitlines()[-1])
        return {"peak_mib": (result["peak_bytes"] - result["floor_bytes"]) / MIB, "step_s": result["step_seconds"],
                "note": f"above its import floor ({result['floor_bytes'] / MIB:.0f} MiB), {result['threads']} threads"}

    def runner_arm(name: str) -> dict:
        output = run([str(mesp_runner), str(programs[name]), str(batch_file)])
        return {"peak_mib": runner_peak_bytes(output) / MIB, "step_s": runner_step_seconds(output),
                "note": "whole process"}

    repeated: dict[str, list[dict]] = {"torch mesp": [], "runner, packed": []}
    for repeat in range(args.repeats):
        for name in repeated:
            repeated[name].append(torch_arm() if name == "torch mesp" else runner_arm(name))
            print(f"{name} (run {repeat + 1}): {repeated[name][-1]['peak_mib']:.0f} MiB, "
                  f"{repeated[name][-1]['step_s']:.3f} s/step", flush=True)
    rows = {}
    for name, runs in repeated.items():
        rows[name] = {"peak_mib": statistics.median(r["peak_mib"] for r in runs),
                      "step_s": statistics.median(r["step_s"] for r in runs),
                      "note": runs[0]["note"] + (f"; median of {len(runs)} runs" if len(runs) > 1 else ""),
                      "runs": [r["step_s"] for r in runs]}
    for name in ("packed, no XNNPACK", "runner, fp32"):
        rows[name] = runner_arm(name)
        print(f"{name}: {rows[name]['peak_mib']:.0f} MiB, {rows[name]['step_s']:.3f} s/step", flush=True)
    if joint_runner is not None:
        joint_model = lora_model(quantized=False)
        joint = export_training(joint_model, batches[0], "executorch", work / "joint.pte")
        del joint_model
        output = run([str(joint_runner), str(joint), str(batch_file), "--lr", "1e-3"])
        rows["joint graph"] = {"peak_mib": runner_peak_bytes(output) / MIB, "step_s": None, "note": "whole process, SGD"}

    print(f"\n{'arm':<19} {'peak MiB':>9} {'s/step':>8}  note")
    for name, row in rows.items():
        step = "" if row["step_s"] is None else f"{row['step_s']:.3f}"
        print(f"{name:<19} {row['peak_mib']:>9.1f} {step:>8}  {row['note']}")
    packed, reference = rows["runner, packed"], rows["torch mesp"]
    ratios = {"packed runner peak / torch mesp peak above its floor": packed["peak_mib"] / reference["peak_mib"],
              "packed runner step / torch mesp step": packed["step_s"] / reference["step_s"]}
    if "joint graph" in rows:
        ratios["packed runner peak / joint graph peak"] = packed["peak_mib"] / rows["joint graph"]["peak_mib"]
    # Each run of the runner against the torch run just before it: how far one pair alone can be trusted.
    paired = [runner["step_s"] / torch_run["step_s"]
              for torch_run, runner in zip(repeated["torch mesp"], repeated["runner, packed"])]
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print("packed runner step / torch mesp step, each alternating pair: "
          + " ".join(f"{value:.2f}x" for value in paired))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios, "paired_step_ratios": paired},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
