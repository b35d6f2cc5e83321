"""`edgetrain profile`: records, JSON schema, table, target warnings, errors, Ctrl-C cleanliness."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from edgetrain.cli import main as cli_main
from edgetrain.profiler.config import RECORD_FIELDS
from edgetrain.profiler.report import format_table


@pytest.fixture(scope="module")
def bp_mebp_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    json_path, plot_path = out / "records.json", out / "chart.png"
    code = cli_main(["profile", "--methods", "bp,mebp", "--seq", "256", "--steps", "1",
                     "--json", str(json_path), "--plot", str(plot_path)])
    assert code == 0
    return json.loads(json_path.read_text()), plot_path


def test_json_schema(bp_mebp_records):
    records, _ = bp_mebp_records
    assert [r["method"] for r in records] == ["bp", "mebp"]
    for record in records:
        assert set(RECORD_FIELDS) <= set(record)
        assert record["model"] == "tiny" and record["seq"] == 256 and record["batch"] == 1
        assert record["rank"] == 8 and record["backend"] == "torch-cpu"
        for key in ("peak_bytes_probe", "peak_bytes_tensors"):
            assert isinstance(record[key], int) and record[key] > 0
        assert record["step_seconds"] > 0
        assert record["grad_cosine"] == pytest.approx(1.0, abs=1e-6)
        assert record["grad_max_rel_err"] < 1e-5
    # Same weights and batch for every method, so the same loss.
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)


def test_gradient_errors_are_against_an_fp64_reference_bps_own_included(bp_mebp_records):
    """Every method's gradient is compared with bp on a float64 copy of the model, so fp32 bp has an error
    of its own (its fp32 loss and reductions), shown in the table like the others'."""
    records, _ = bp_mebp_records
    assert all(r["grad_reference"] == "bp in float64" for r in records)
    bp = records[0]
    assert 0 < bp["grad_max_rel_err"] < 1e-5 and bp["grad_cosine"] < 1.0
    assert bp["reference_loss"] == pytest.approx(bp["loss"], rel=1e-6)
    table = format_table(records)
    assert "max rel err vs ref" in table and "against bp in float64 on the same batch and weights" in table
    assert f"{bp['grad_max_rel_err']:.1e}" in table


def test_the_fidelity_reference_is_autograd_in_float64(tiny_lora, text_batches):
    import copy

    from edgetrain.methods import METHODS
    from edgetrain.profiler.worker import gradient_fidelity

    model, batch = tiny_lora(rank=8), text_batches(1, seq_len=64)[0]
    fidelity = gradient_fidelity(model, "mesp", batch, {})
    _, exact = METHODS.get("bp")(copy.deepcopy(model).double()).gradients(batch)
    _, ours = METHODS.get("mesp")(model).gradients(batch)
    expected = max(float((ours[k].double() - exact[k]).abs().max() / exact[k].abs().max()) for k in exact)
    assert fidelity["grad_max_rel_err"] == pytest.approx(expected, rel=1e-9)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the copy was made in float64, not the model
    double = copy.deepcopy(model).double()
    assert gradient_fidelity(double, "bp", batch, {})["grad_max_rel_err"] == 0.0


def test_mebp_keeps_less_than_bp(bp_mebp_records):
    bp, mebp = bp_mebp_records[0]
    assert mebp["peak_bytes_tensors"] < 0.6 * bp["peak_bytes_tensors"]
    assert mebp["peak_bytes_probe"] < bp["peak_bytes_probe"]


def test_plot_is_a_png(bp_mebp_records):
    _, plot_path = bp_mebp_records
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_path.stat().st_size > 5000


def test_table_has_ratios_to_first_method(bp_mebp_records):
    records, _ = bp_mebp_records
    table = format_table(records)
    ratio = records[1]["peak_bytes_tensors"] / records[0]["peak_bytes_tensors"]
    assert f"{ratio:.2f}x" in table
    assert "weights excluded" in table and "ratios are to bp" in table


def test_target_budget_warning(bp_mebp_records, tmp_path, monkeypatch):
    from edgetrain.targets import load_target

    (tmp_path / "watch.toml").write_text(
        'description = "tiny budget"\nbackend = "torch-cpu"\nprobe = "linux"\ndtype = "float32"\n'
        "memory_budget_mib = 3\n")
    monkeypatch.setenv("EDGETRAIN_TARGETS_DIR", str(tmp_path))
    records, _ = bp_mebp_records
    warnings = load_target("watch").budget_warnings(records)
    assert len(warnings) == 2 and "over the watch budget of 3 MiB" in warnings[0]


def test_shipped_targets_load():
    from edgetrain.targets import available_targets, load_target

    names = available_targets()
    assert {"cpu", "agx-orin-32gb", "agx-orin-64gb", "mac-m-series-16gb", "iphone-15-pro"} <= set(names)
    for name in names:
        assert load_target(name).memory_budget_bytes > 0


def test_unknown_method_and_target_are_clear_errors(capsys):
    assert cli_main(["profile", "--methods", "bp,sgdx"]) == 2
    assert "unknown method 'sgdx'" in capsys.readouterr().err
    assert cli_main(["profile", "--target", "toaster"]) == 2
    assert "unknown target 'toaster'; known targets:" in capsys.readouterr().err
    assert cli_main(["profile", "--seq", "0"]) == 2
    assert "--seq must be positive" in capsys.readouterr().err


def test_failing_method_reports_the_child_error(capsys):
    assert cli_main(["profile", "--methods", "bp", "--model", "/nonexistent/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "method 'bp' failed" in err and "/nonexistent/ckpt" in err


def _profiler_children(parent_pid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "edgetrain.profiler.worker" in cmdline and proc.pid != parent_pid:
            found.append(proc)
    return found


def _sigint_state(pid: int | str = "self") -> str:
    """'blocked' / 'ignored' / '' for SIGINT in a process, from /proc/PID/status (Linux)."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
    except OSError:
        return ""
    bit = 1 << (signal.SIGINT - 1)
    return ",".join(name for name, key in (("blocked", "SigBlk"), ("ignored", "SigIgn"))
                    if int(status.get(key, "0"), 16) & bit)


def _as_from_a_terminal() -> None:
    # Ignored and blocked signals survive fork and exec: a pytest process whose SIGINT some earlier test
    # (or a background shell job) left ignored or blocked would pass that on, and `edgetrain profile`
    # rightly keeps an inherited SIG_IGN (nohup). A user at a terminal starts it with SIGINT at default.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_orphan():
    inherited = _sigint_state()
    if inherited:
        warnings.warn(f"SIGINT is {inherited} in this pytest process (left so by an earlier test or the shell)")
    before = {p.pid for p in _profiler_children(os.getpid())}
    parent = subprocess.Popen([sys.executable, "-m", "edgetrain.cli", "profile", "--methods", "bp,mebp",
                               "--seq", "512", "--steps", "50"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_as_from_a_terminal)
    # Generous: a busy machine (tools/test beside other work) can take a minute to start a worker; the bound
    # only turns a hang into a failure.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if [p for p in _profiler_children(parent.pid) if p.pid not in before]:
            break
        assert parent.poll() is None, parent.communicate()
        time.sleep(0.2)
    else:
        parent.kill()
        pytest.fail("profiler never started a worker")
    time.sleep(1.0)
    parent.send_signal(signal.SIGINT)
    try:
        _, err = parent.communicate(timeout=300)
    except subprocess.TimeoutExpired as exc:
        # Leave nothing behind, and say what the parent was doing (once seen on a loaded CI machine).
        workers = [(p.pid, p.status()) for p in _profiler_children(parent.pid) if p.pid not in before]
        for proc in _profiler_children(parent.pid):
            if proc.pid not in before:
                proc.kill()
        parent.kill()
        _, rest = parent.communicate()
        tail = ((exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
        pytest.fail(f"profile did not exit within 300 s of SIGINT (SIGINT in pytest: {inherited or 'default'}); "
                    f"workers then: {workers}; its stderr ended with:\n"
                    + (tail + (rest or ""))[-1500:])
    assert parent.returncode == 130, err
    assert "interrupted" in err
    time.sleep(0.5)
    assert [p for p in _profiler_children(parent.pid) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_4_bit_base_on_torch_keeps_less_weight_memory_and_reports_its_footprint(tmp_path):
    """`--quantize-bits 4` on torch-cpu: the base held packed, the same gradients against the fp64 reference
    of that (dequantised) base, and the footprint column: what the process holds above torch's runtime plus
    the step's peak."""
    records = {}
    for bits in (None, 4):
        out = tmp_path / f"{bits}.json"
        flags = ["--quantize-bits", str(bits)] if bits else []
        assert cli_main(["profile", "--methods", "mesp", "--seq", "256", "--steps", "1", "--quiet", "--json",
                         str(out), *flags]) == 0
        records[bits] = json.loads(out.read_text())[0]
    dense, packed = records[None], records[4]
    assert packed["quantize_bits"] == 4 and dense["quantize_bits"] is None
    assert packed["weights_bytes"] < 0.5 * dense["weights_bytes"]
    assert packed["grad_cosine"] > 0.9999 and packed["grad_max_rel_err"] < 1e-4
    for record in (dense, packed):
        assert record["weights_bytes"] < record["footprint_bytes"] < record["weights_bytes"] + 64 * 2**20, record
        assert 0.7 < record["peak_bytes_probe"] / record["estimate_bytes"] < 1.5


@pytest.mark.parametrize("warmup", [1, 3])
def test_warmup_steps_run_untimed_before_the_timed_ones(warmup, monkeypatch):
    """`--warmup N`: N steps before the timed `--steps` (then the compute-floor, step-breakdown and
    tensor-accounting steps), so a GPU's first-step costs (kernel choice, allocator pools) stay out of the timings."""
    import edgetrain
    from edgetrain.profiler.config import ProfileConfig
    from edgetrain.profiler.worker import profile_method

    seen = []
    original = edgetrain.Learner.step
    monkeypatch.setattr(edgetrain.Learner, "step", lambda self, batch: seen.append(1) or original(self, batch))
    record = profile_method(ProfileConfig(model="tiny", method="mesp", seq=16, steps=2, warmup=warmup,
                                          fidelity=False))
    assert len(seen) == warmup + 2 + 3 and record["step_seconds"] > 0 and record["floor_ratio"] > 0
    assert record["products_in_step_seconds"] > 0 and record["operator_calls"] > record["matmul_calls"]


def test_a_profile_whose_load_changed_prints_no_time_ratio():
    """Beside a process that took a core for one method and not the other, the s/step ratio compares unlike
    conditions: the table says so instead of printing it (the load is read by each profile worker)."""
    from edgetrain.profiler.report import format_table

    def record(method: str, seconds: float, others: float | None) -> dict:
        return {"method": method, "model": "tiny", "seq": 8, "batch": 2, "backend": "torch-cpu", "torch_threads": 2,
                "peak_bytes_probe": 2**20, "peak_bytes_tensors": 2**20, "step_seconds": seconds, "loss": 1.0,
                "grad_cosine": None, "grad_max_rel_err": None, "others_busy_cores": others}

    steady = format_table([record("mebp", 0.2, 0.1), record("mesp", 0.1, 0.3)])
    assert "0.50x" in steady and "load changed" not in steady and "2 threads" in steady
    changed = format_table([record("mebp", 0.2, 0.0), record("mesp", 0.1, 1.0)])
    assert "0.50x" not in changed
    assert "time ratios not printed: the load changed under this run (other processes kept 0.0 to 1.0 cores" in changed


def _trade_record(method: str, peak_mib: float, seconds: float, error: float | None = 2e-6,
                  others: float | None = 0.0) -> dict:
    return {"method": method, "model": "smollm2-135m", "seq": 256, "batch": 1, "backend": "torch-cpu",
            "torch_threads": 2, "peak_bytes_probe": peak_mib * 2**20, "peak_bytes_tensors": peak_mib * 2**20,
            "step_seconds": seconds, "loss": 1.0, "grad_cosine": 1.0, "grad_max_rel_err": error,
            "others_busy_cores": others}


def test_two_lines_under_the_table_weigh_mesp_against_the_autograd_methods():
    table = format_table([_trade_record("bp", 400, 2.0), _trade_record("mebp", 160, 3.0),
                          _trade_record("mesp", 32, 1.5, error=3e-6)])
    *_, blank, first, second = table.splitlines()
    assert blank == ""
    assert first == ("mesp: gradients within 3.0e-06 of the fp64 reference, in 0.20x mebp's and 0.08x bp's training "
                     "memory (peak above the weights), at 0.50x mebp's and 0.75x bp's step time.")
    assert second.startswith("mebp is autograd with every block checkpointed; bp is plain autograd; mesp keeps")
    # Without the fidelity pass nothing is claimed about exactness; with the load changed, nothing about time.
    unsteady = format_table([_trade_record("mebp", 160, 3.0, error=None, others=0.0),
                             _trade_record("mesp", 32, 1.5, error=None, others=1.0)])
    line = unsteady.splitlines()[-2]
    assert line == ("mesp: in 0.20x mebp's training memory (peak above the weights), (no time ratio: the load "
                    "changed under the run).")
    # Nothing to weigh: no lines.
    assert format_table([_trade_record("bp", 400, 2.0), _trade_record("mebp", 160, 3.0)]).splitlines()[-1].startswith(
        "mebp ")
    assert format_table([_trade_record("mesp", 32, 1.5), _trade_record("mezo", 20, 1.0)]).splitlines()[-1].startswith(
        "mezo ")


def test_threads_auto_reaches_the_profiled_learner_and_the_record(monkeypatch):
    """`--threads auto` profiles with the learner's fitted thread count, as `personalise run` trains by default,
    and the fidelity pass before the learner exists runs on the fitted count too (fixed at every core beside a
    busy one, its fp64 reference step had thrashed for minutes)."""
    import torch

    import edgetrain
    from edgetrain.profiler import worker
    from edgetrain.profiler.config import ProfileConfig
    from edgetrain.training.threads import ThreadFitter

    fitters, fidelity_threads = [], []
    original_init, original_fidelity = edgetrain.Learner.__init__, worker.gradient_fidelity

    def spy_init(self, *args, **kwargs):
        fitters.append(kwargs.get("threads"))
        original_init(self, *args, **kwargs)

    def spy_fidelity(*args, **kwargs):
        fidelity_threads.append(torch.get_num_threads())
        return original_fidelity(*args, **kwargs)

    monkeypatch.setattr(edgetrain.Learner, "__init__", spy_init)
    monkeypatch.setattr(worker, "gradient_fidelity", spy_fidelity)
    monkeypatch.setattr(ThreadFitter, "choose", lambda self: 1)  # one core left free
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        record = worker.profile_method(ProfileConfig(model="tiny", method="mesp", seq=16, steps=1, threads="auto"))
    finally:
        torch.set_num_threads(threads_before)
    assert len(fitters) == 1 and isinstance(fitters[0], ThreadFitter)
    assert fidelity_threads == [1] and record["torch_threads"] == 1 and record["threads_choice"] == "auto"
    assert record["minor_faults_per_step"] >= 0
    assert "1 threads (auto: the cores other processes left free)" in format_table([record])
    import argparse

    from edgetrain.cli.profile import build_parser

    parser = build_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--threads", "auto"]).threads == "auto"
    assert parser.parse_args(["--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])
