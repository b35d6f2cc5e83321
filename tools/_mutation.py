"""Driver of tools/mutation: cosmic-ray mutation testing of the modules whose behaviour is a promise.

cosmic-ray enumerates the mutants (its operators, filtered below to one slip of the pen per site); they are
tested by a worker of our own that runs inside a throwaway copy of the tree, so the checkout it is run
from is never touched. The worker imports torch, pytest and the other heavy dependencies once and forks a
child per mutant, which writes the mutant to disk, imports edgetrain afresh and runs the module's guard
tests with -x: about a second of overhead a mutant instead of cosmic-ray's fresh interpreter and torch
import (five to eight seconds here). Tests that start processes of their own (torchrun, the CLI) see the
mutant too: it is on disk, and PYTHONPATH points at the copy. See docs/mutation.md for the record.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    files: list[str]
    # Test files (globs allowed: files that do not exist yet are left out) or pytest node ids, fastest and
    # most specific first so that -x stops a killed mutant early.
    tests: list[str]
    # When set, only mutations inside these ("function", "Class" or "Class.method") are run.
    only: list[str] = field(default_factory=list)
    # A pytest -k expression over all the tests above, to leave out slow variants that add no guard.
    keyword: str = ""


KILLS = "tests/promises/test_mutation_kills.py"
# Kill tests of one module (files that do not exist are left out).
KILLS_OF = "tests/promises/test_mutation_kills_{}.py"
NON_FINITE = "tests/reliability/test_non_finite.py"

TARGETS: dict[str, Target] = {
    "checkpoint": Target(["edgetrain/training/checkpoint.py", "edgetrain/files/atomic.py"], [
        KILLS, "tests/reliability/test_crash_safe_saves.py", "tests/reliability/test_output_paths.py",
        "tests/reliability/test_fuzz_loaders.py::test_damaged_learner_checkpoint_is_detected",
        "tests/test_learner.py::test_save_load_resumes_exactly",
        "tests/test_learner.py::test_adam_state_survives_checkpoint",
        "tests/test_learner.py::test_fit_checkpoints_and_resume_skips_damaged",
        "tests/reliability/test_resume_restores_everything.py"],
        # The executorch cases save through the same atomic_write_bytes as the others, at 5-20 s a case; of
        # the SIGKILL-mid-write cases (a fresh process each) one file writer and the directory swap's are
        # kept: the others write through the same two functions.
        keyword="not executorch and (not killed_mid_write or learner-save-torn or save-mlx-lm-adapters)"),
    "mezo": Target(["edgetrain/methods/mezo.py"], [
        "tests/promises/test_step_formula*mezo*.py", KILLS,
        "tests/test_learner.py::test_step_returns_stats[mezo]",
        "tests/test_learner.py::test_mezo_nan_loss_changes_nothing",
        "tests/test_learner.py::test_compute_gradients_leaves_weights_alone",
        "tests/test_learner.py::test_mezo_estimate_is_unbiased", NON_FINITE,
        "tests/reliability/test_resume_restores_everything.py"]),
    # The single-process reference of the average; MaskedAverager is tested only across torchrun processes
    # (a minute a run), so it is a target of its own.
    "averaging": Target(["edgetrain/recipes/subnet_dp/averaging.py"], [
        "tests/promises/test_step_formula*subnet*.py", KILLS, "tests/distributed/test_subnet_subnetwork.py",
        "tests/distributed/test_subnet_method.py"],
        only=["average_masked_gradients", "_ring_wire_bytes"]),
    "averaging_torchrun": Target(["edgetrain/recipes/subnet_dp/averaging.py"], [
        KILLS_OF.format("averaging_torchrun"), "tests/distributed/test_subnet_distributed.py"],
        only=["_Piece", "_Bucket", "MaskedAverager", "gather_full_state"]),
    "subnet_method": Target(["edgetrain/methods/subnet_dp/method.py"], [
        "tests/promises/test_step_formula*subnet*.py", KILLS, "tests/distributed/test_subnet_method.py"]),
    "bp": Target(["edgetrain/methods/bp.py"], [
        "tests/promises/test_step_formula*bp*.py", KILLS,
        "tests/test_learner.py::test_step_returns_stats",
        "tests/test_learner.py::test_mebp_gradients_equal_bp",
        "tests/test_learner.py::test_compute_gradients_leaves_weights_alone",
        "tests/test_learner.py::test_nan_gradient_keeps_last_good_weights",
        # bp's gradient_step: accumulation drives its gradients instead of its step
        "tests/test_gradient_steps.py::test_accumulated_micro_batches_make_the_whole_batchs_update",
        "tests/reliability/test_resume_restores_everything.py"]),
    "tangents": Target(["edgetrain/methods/tangents.py"], [
        "tests/promises/test_step_formula*fgd*.py", KILLS, KILLS_OF.format("tangents"), KILLS_OF.format("fgd"),
        "tests/methods/test_fgd.py"]),
    "fgd": Target(["edgetrain/methods/fgd.py"], [
        "tests/promises/test_step_formula*fgd*.py", KILLS, KILLS_OF.format("fgd"), KILLS_OF.format("tangents"),
        "tests/methods/test_fgd.py", "tests/methods/test_asyncfgd.py::test_learner_resumes_mid_pipeline_exactly",
        NON_FINITE,
        "tests/reliability/test_resume_restores_everything.py"]),
    "asyncfgd": Target(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "edgetrain/methods/asyncfgd").glob("*.py")
                              if p.name != "__init__.py"), [
        "tests/promises/test_step_formula*asyncfgd*.py", KILLS, KILLS_OF.format("asyncfgd"),
        "tests/methods/test_asyncfgd.py", NON_FINITE],
        # The pipeline's update path: what enters, what leaves, which module updates with which stale
        # weights and tangents, and resume mid-pipeline. (Option parsing and the CUDA-stream workers, which
        # need a GPU, are left out.)
        only=["AsyncFGD.step", "AsyncFGD._fill_loss", "AsyncFGD.gradients", "AsyncFGD.load_state_dict",
              "_encode_in_flight", "_decode_in_flight", "forward_stage", "update_stage", "ReferenceScheduler",
              "split_units", "build_stages", "_serve", "ThreadWorkers"],
        # A 40 s digits run and a 35 s sample: convergence, which the step-formula tests pin down exactly.
        keyword="not on_digits and not transfer_sample"),
    "mesp": Target(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "edgetrain/methods/mesp").glob("*.py")
                          if p.name != "__init__.py"), [
        # The op-level gradchecks first: they run in seconds and catch most mutants (-x stops there).
        "tests/methods/test_mesp_ops.py", "tests/methods/test_mesp_parity.py", KILLS_OF.format("mesp"),
        "tests/promises/test_step_formula_bp.py", NON_FINITE]),
    "scpl": Target(["edgetrain/methods/scpl/method.py"], [
        "tests/promises/test_step_formula*scpl*.py", KILLS_OF.format("scpl"), "tests/methods/test_scpl.py"]),
    "segprop": Target([f"edgetrain/methods/segprop/{name}.py"
                       for name in ("trainer", "schedule", "stage_parts", "prefix_cache")], [
        "tests/promises/test_step_formula*segprop*.py", KILLS_OF.format("segprop"), "tests/methods/test_segprop.py"],
        # The stage logic: what trains in each stage, the global head, the update and its rates, stage
        # advance and resume. (Option parsing in __init__, the final model and the eval() pins are left out.)
        only=["cosine_multiplier", "Plateau.reached", "Plateau.load", "StageClock.lr_multipliers",
              "StageClock.tick", "StageClock.next_stage", "StageClock.state_dict", "StageClock.load_state_dict",
              "ActivePath", "module_params", "unique", "StageParts.body", "StageParts.head", "StageParts.committed",
              "StageParts.path", "FrozenPrefix.state", "StagedTrainer._apply_stage", "StagedTrainer._trainable_ids",
              "StagedTrainer.frozen_state", "StagedTrainer.forward_loss", "StagedTrainer.gradients",
              "StagedTrainer.step", "StagedTrainer._update", "_scaled_step", "StagedTrainer.advance_stage",
              "StagedTrainer.state_dict", "StagedTrainer.load_state_dict"]),
    # SegProp's memory options: the global head's gradients after the segment's backward, and the waiting
    # segments' weights mapped from a file. (Option checks are guarded by the same tests.)
    "segprop_memory": Target(["edgetrain/methods/segprop/head_last.py", "edgetrain/methods/segprop/waiting_spill.py"], [
        "tests/methods/test_segprop_spill.py", "tests/methods/test_segprop_memory.py"]),
    "resume": Target(["edgetrain/training/learner.py"], [
        KILLS, "tests/reliability/test_crash_safe_saves.py",
        "tests/test_learner.py::test_save_load_resumes_exactly",
        "tests/test_learner.py::test_adam_state_survives_checkpoint",
        "tests/test_learner.py::test_fit_checkpoints_and_resume_skips_damaged",
        "tests/reliability/test_resume_restores_everything.py",
        "tests/reliability/test_fuzz_loaders.py::test_damaged_learner_checkpoint_is_detected"],
        only=["Learner.save", "Learner.load", "Learner.resume", "Learner._restore"]),
}

# One mutant per operator site, the way a slip of the pen would change it (cosmic-ray's default swaps every
# binary operator for every other one: eleven mutants per `+`, most of them, like `+` -> `<<`, caught by
# any test that runs the line at all).
KEPT_OPERATORS = re.compile("|".join([
    r"core/ReplaceBinaryOperator_(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Div|Mod_FloorDiv|Pow_Mul"
    r"|BitAnd_BitOr|BitOr_BitAnd|LShift_RShift|RShift_LShift|MatMult_Mul)$",
    r"core/ReplaceComparisonOperator_(Eq_NotEq|NotEq_Eq|Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Is_IsNot|IsNot_Is"
    r"|In_NotIn|NotIn_In)$",
    r"core/ReplaceUnaryOperator_USub_UAdd$",
    r"core/(AddNot|NumberReplacer|RemoveDecorator|ReplaceAndWithOr|ReplaceOrWithAnd|ReplaceTrueWithFalse"
    r"|ReplaceFalseWithTrue|ReplaceBreakWithContinue|ReplaceContinueWithBreak|ExceptionReplacer"
    r"|ZeroIterationForLoop)$",
]))

def _annotation_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the annotations are: mutating them changes nothing, `from __future__ import annotations`
    keeps them unevaluated."""
    spans = []
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            annotations.append(node.returns)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in annotations]
    return spans


def _function_spans(tree: ast.AST, names: list[str]) -> list[tuple[int, int]]:
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{node.name}.{item.name}" in names:
                    spans.append((item.lineno, item.end_lineno))
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            spans.append((node.lineno, node.end_lineno))
    return spans


def _inside(pos: tuple[int, int], start: tuple[int, int], end: tuple[int, int]) -> bool:
    return start <= pos < end


def _resolve_tests(tree: Path, entries: list[str]) -> list[str]:
    found = []
    for entry in entries:
        file_part = entry.split("::", 1)[0]
        if "::" in entry:
            if (tree / file_part).is_file():
                found.append(entry)
        else:
            found += sorted(str(Path(p).relative_to(tree)) for p in glob.glob(str(tree / entry)))
    return list(dict.fromkeys(found))


def _copy_tree(dest: Path) -> Path:
    tree = dest / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache", "mutants"))
    return tree


def _env(tree: Path) -> dict[str, str]:
    # PYTHONPATH: test subprocesses (torchrun workers, CLI runs) import the mutated copy too, not the checkout.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")


COSMIC_RAY = str(Path(sys.executable).parent / "cosmic-ray")


def _stop(proc: subprocess.Popen) -> None:
    """End cosmic-ray and the test run it started (in a session of its own) when we are interrupted."""
    import psutil

    if proc.poll() is not None:
        return
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait()


def run_target(name: str, target: Target, timeout_floor: float, keep: bool,
               lines: set[int] | None = None) -> dict[str, object]:
    from cosmic_ray.config import serialize_config
    from cosmic_ray.work_db import WorkDB, use_db

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=f"edgetrain-mutation-{name}-"))
    try:
        tree = _copy_tree(scratch)
        imported = subprocess.run([sys.executable, "-c", "import edgetrain; print(edgetrain.__file__)"],
                                  cwd=tree, env=_env(tree), capture_output=True, text=True, check=True).stdout
        if not Path(imported.strip()).is_relative_to(tree):
            raise SystemExit(f"mutation: the copy imports edgetrain from {imported.strip()}, not {tree}")
        tests = _resolve_tests(tree, target.tests)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", *tests]
        if target.keyword:
            command += ["-k", target.keyword]
        print(f"== {name}: {', '.join(target.files)}\n   tests: {' '.join(tests)}", flush=True)

        # Baseline on the unmutated copy: the tests must pass, and their time sets the per-mutant timeout.
        t0 = time.monotonic()
        baseline = subprocess.run(command, cwd=tree, env=_env(tree), capture_output=True, text=True)
        baseline_s = time.monotonic() - t0
        if baseline.returncode != 0:
            print(baseline.stdout[-4000:], baseline.stderr[-2000:])
            raise SystemExit(f"mutation: the tests of {name} fail before any mutation; fix them first")
        timeout = max(timeout_floor, 3 * baseline_s)
        print(f"   baseline {baseline_s:.0f}s, per-mutant timeout {timeout:.0f}s", flush=True)

        config = scratch / "cosmic-ray.toml"
        config.write_text(serialize_config({
            "module-path": [str(tree / f) for f in target.files], "timeout": round(timeout, 1),
            "excluded-modules": [], "test-command": shlex.join(command), "distributor": {"name": "local"}}))
        session = scratch / "session.sqlite"
        subprocess.run([COSMIC_RAY, "init", str(config), str(session)], cwd=tree, env=_env(tree), check=True,
                       stdout=subprocess.DEVNULL)

        trees = {tree / f: ast.parse((tree / f).read_text()) for f in target.files}
        annotations = {path: _annotation_spans(t) for path, t in trees.items()}
        functions = {path: _function_spans(t, target.only) for path, t in trees.items()}
        jobs, filtered = [], 0
        with use_db(str(session), WorkDB.Mode.open) as db:
            for item in db.pending_work_items:
                m = item.mutations[0]
                path = Path(m.module_path)
                pos = tuple(m.start_pos)
                if (not KEPT_OPERATORS.match(m.operator_name)
                        or any(_inside(pos, a, b) for a, b in annotations[path])
                        or (target.only and not any(a <= pos[0] <= b for a, b in functions[path]))
                        or (lines and pos[0] not in lines)):
                    filtered += 1
                    continue
                jobs.append({"path": str(path), "operator": m.operator_name, "occurrence": m.occurrence,
                             "operator_args": dict(m.operator_args or {}), "line": pos[0]})
        print(f"   {len(jobs)} mutants ({filtered} filtered out)", flush=True)

        job_file, result_file = scratch / "jobs.json", scratch / "results.jsonl"
        job_file.write_text(json.dumps({"jobs": jobs, "pytest_args": command[3:], "timeout": timeout}))
        worker = subprocess.Popen([sys.executable, str(tree / "tools" / "_mutation.py"), "--worker",
                                   str(job_file), str(result_file)], cwd=tree, env=_env(tree))
        try:
            worker.wait()
        finally:
            _stop(worker)
        if worker.returncode != 0:
            raise SystemExit(f"mutation: the worker failed for {name} (exit {worker.returncode})")

        counts = {"total": len(jobs), "killed": 0, "survived": 0, "timeout": 0, "incompetent": 0}
        survivors = []
        for line in result_file.read_text().splitlines():
            result = json.loads(line)
            counts[result["outcome"]] += 1
            if result["outcome"] == "survived":
                survivors.append((str(Path(result["path"]).relative_to(tree)), result["line"], result["operator"],
                                  result["diff"].replace(str(tree) + "/", "")))
        elapsed = time.monotonic() - started
        print(f"-- {name}: {counts['total']} mutants, {counts['killed']} killed, {counts['survived']} survived, "
              f"{counts['timeout']} timeout, {counts['incompetent']} incompetent; {elapsed / 60:.1f} min", flush=True)
        for path, line, operator, diff in sorted(survivors):
            print(f"\n   survived: {path}:{line} {operator}\n{diff}", flush=True)
        return {"name": name, **counts, "minutes": elapsed / 60}
    finally:
        if keep:
            print(f"   kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


# -- the worker: runs inside the copy (cwd and PYTHONPATH), never imports edgetrain itself ---------------

# Imported once here and inherited by every forked child; edgetrain and the tests are imported afresh in
# each child, after its mutant is on disk. No torch computation happens before the fork (threads and
# lazily built kernels must start in the child).
_HEAVY_IMPORTS = ["torch", "torch.nn.functional", "torch.func", "numpy", "pytest", "safetensors.torch",
                  "hypothesis", "mlx.core", "mlx.nn", "mlx.optimizers", "psutil", "sklearn.datasets"]


def _outcome(exit_code: int) -> str:
    # pytest: 0 all passed, 1 a test failed, 2 interrupted (a collection error: the mutant does not even
    # import), 3 internal error, 4 usage error, 5 nothing collected.
    if exit_code == 0:
        return "survived"
    return "incompetent" if exit_code in (4, 5) else "killed"


def _run_child(path: Path, mutated: str, pytest_args: list[str]) -> None:
    """In the forked child: the mutant on disk, fresh imports of edgetrain and the tests, then pytest."""
    os.setsid()  # a group of its own, so a timeout kills the tests' own subprocesses with it
    path.write_text(mutated)
    tree = Path.cwd()
    for module_name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if module_name.split(".")[0] in ("edgetrain", "conftest") or file.startswith(str(tree)):
            del sys.modules[module_name]
    import pytest

    code = pytest.main(pytest_args)
    sys.stdout.flush()
    os._exit(int(code))


def worker(job_file: Path, result_file: Path) -> int:
    import importlib

    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    for module_name in _HEAVY_IMPORTS:
        try:
            importlib.import_module(module_name)
        except ImportError:
            pass
    spec = json.loads(job_file.read_text())
    jobs, pytest_args, timeout = spec["jobs"], spec["pytest_args"], spec["timeout"]
    started = last_report = time.monotonic()
    with result_file.open("a") as results:
        for done, job in enumerate(jobs):
            path = Path(job["path"])
            original = path.read_text()
            try:
                mutated = mutate_code(original, get_operator(job["operator"])(**job["operator_args"]),
                                      job["occurrence"])
            except Exception:  # noqa: BLE001 -- cosmic-ray's ExceptionReplacer fails on `except (a.B, C)`
                mutated = None
            if mutated is None:
                outcome = "incompetent"
            else:
                sys.stdout.flush()
                child = os.fork()
                if child == 0:
                    with open(os.devnull, "w") as quiet:  # the tests' output would drown the progress lines
                        os.dup2(quiet.fileno(), 1)
                        os.dup2(quiet.fileno(), 2)
                    try:
                        _run_child(path, mutated, pytest_args)
                    finally:
                        os._exit(3)
                deadline = time.monotonic() + timeout
                status = None
                while status is None:
                    pid, wait_status = os.waitpid(child, os.WNOHANG)
                    if pid:
                        status = wait_status
                    elif time.monotonic() > deadline:
                        try:
                            os.killpg(child, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        os.waitpid(child, 0)
                        status = "timeout"
                    else:
                        time.sleep(0.05)
                path.write_text(original)
                outcome = "timeout" if status == "timeout" else _outcome(os.waitstatus_to_exitcode(status))
            diff = "".join(difflib.unified_diff(original.splitlines(True), (mutated or "").splitlines(True),
                                                f"a/{path}", f"b/{path}", n=2)) if outcome == "survived" else ""
            results.write(json.dumps({**job, "outcome": outcome, "diff": diff}) + "\n")
            results.flush()
            if outcome == "survived":  # as it happens, so that triage can start before the run ends
                print(f"   survived: {Path(job['path']).relative_to(Path.cwd())}:{job['line']} {job['operator']}",
                      flush=True)
            if time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                print(f"   ... {done + 1}/{len(jobs)} after {last_report - started:.0f}s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/mutation", description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"a subset of: {' '.join(TARGETS)} (default: all)")
    parser.add_argument("--timeout-floor", type=float, default=60.0,
                        help="smallest per-mutant timeout in seconds (default 60; else 3x the baseline run)")
    parser.add_argument("--lines", type=lambda text: {int(n) for n in text.split(",")},
                        help="only mutants on these source lines, e.g. 31,91 (to re-check survivors)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and session for inspection")
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("JOBS", "RESULTS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    # A plain `kill` unwinds like Ctrl-C: the running test is stopped and the temporary copy removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    rows = [run_target(m, TARGETS[m], args.timeout_floor, args.keep, args.lines) for m in (args.modules or list(TARGETS))]
    print("\nmodule          total  killed  survived  timeout  incompetent  minutes")
    for r in rows:
        print(f"{r['name']:<15} {r['total']:>5}  {r['killed']:>6}  {r['survived']:>8}  {r['timeout']:>7}  "
              f"{r['incompetent']:>11}  {r['minutes']:>7.1f}")
    print(f"elapsed {(time.monotonic() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
