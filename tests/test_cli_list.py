"""The CLI's conventions: --version, `edgetrain list ...`, and --help / --version without importing torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import edgetrain
from edgetrain.cli import main

REPO = Path(__file__).resolve().parents[1]


def _listing(capsys, what: str) -> dict[str, str]:
    assert main(["list", what]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        name, _, about = line.partition("  ")
        rows[name.strip()] = about.strip()
    return rows


def test_version_is_the_packages_one(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"edgetrain {edgetrain.__version__}"


def test_list_methods_names_every_registered_method_with_its_frameworks(capsys):
    from edgetrain.methods import METHODS

    rows = _listing(capsys, "methods")
    assert set(METHODS.names()) <= set(rows)
    assert rows["bp"].startswith("torch") and rows["segprop"] == "torch"
    mlx = pytest.importorskip("edgetrain.backends.mlx.methods", reason="mlx is not installed")
    assert all("mlx" in rows[name] for name in mlx.MLX_METHODS.names())


def test_list_models_targets_probes_and_formats(capsys):
    from edgetrain.models import MODEL_PRESETS
    from edgetrain.targets import available_targets

    from edgetrain.models.downloads import DOWNLOADS

    assert set(_listing(capsys, "models")) == set(MODEL_PRESETS.names()) | set(DOWNLOADS.names())
    targets = _listing(capsys, "targets")
    assert set(targets) == set(available_targets()) and "torch-cpu, 8,192 MiB" in targets["cpu"]
    probes = _listing(capsys, "probes")
    assert probes["tensors"] == "available"
    assert probes["darwin"].startswith("unavailable: ") if sys.platform != "darwin" else True
    formats = _listing(capsys, "formats")
    assert {"export: executorch", "export: onnxruntime", "adapter: edgetrain", "adapter: mlx-lm"} <= set(formats)


def test_list_with_no_argument_lists_everything_grouped(capsys):
    # A newcomer's first `edgetrain list` used to be a usage error.
    from edgetrain.cli.list import LISTINGS

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    groups: dict[str, set[str]] = {}
    current = None
    for line in out.splitlines():
        if line.endswith(":") and "  " not in line:
            current = line[:-1]
            groups[current] = set()
        elif line.strip():
            groups[current].add(line.partition("  ")[0].strip())
    assert list(groups) == list(LISTINGS)
    for what in LISTINGS:
        assert groups[what] == set(_listing(capsys, what)), what


def test_an_unknown_listing_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["list", "gadgets"])
    assert done.value.code == 2 and "invalid choice: 'gadgets'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["profile", "--help"]])
def test_help_and_version_answer_without_importing_torch(argv):
    script = ("import sys\nfrom edgetrain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print('TORCH', 'torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "TORCH False" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip(), "nothing printed"


def test_help_documents_the_exit_codes_the_cli_uses(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "exit codes:" in text and "  2    refused" in text and "  130  interrupted" in text
    config = tmp_path / "run.toml"
    config.write_text("steps = 'many'\n")
    assert main(["train", "--config", str(config)]) == 2  # refused, as documented


def test_list_gguf_says_what_each_path_holds_of_every_type(capsys):
    from edgetrain.export.mesp_program import program_reads
    from edgetrain.models.gguf.blocks import BLOCK_FORMATS
    from edgetrain.models.gguf.dequant import DEQUANTIZERS
    from edgetrain.models.gguf.ggml_types import GGML_TYPES
    from edgetrain.models.gguf.packed import PACKABLE_TYPES
    from edgetrain.models.quantized import layout_of

    rows = _listing(capsys, "gguf")
    for type_id, fmt in BLOCK_FORMATS.items():
        torch_how, mlx_how, native_how = (part.split(": ", 1)[1] for part in rows[fmt.name].split(" | "))
        assert torch_how.startswith("packed")
        assert mlx_how.startswith("packed" if type_id in PACKABLE_TYPES else "dequantised")
        assert native_how.startswith("packed" if program_reads(layout_of(fmt)) else "dense float32")
    assert rows["Q4_K"].startswith("torch: packed") and "MLX: packed (4-bit" in rows["Q4_K"]
    refused = {GGML_TYPES[t][0] for t in GGML_TYPES if t not in DEQUANTIZERS}
    assert rows["others"] == f"every path: refused by name at load ({', '.join(sorted(refused))})"


def test_list_gguf_says_which_dequantisation_a_cpu_tile_takes(capsys):
    from edgetrain.models import tile_kernel

    assert _listing(capsys, "gguf")["dequantising"] == f"torch on a CPU: {tile_kernel.status()}"
    with tile_kernel.kernel_enabled(False):
        assert "EDGETRAIN_TILE_KERNEL=off" in _listing(capsys, "gguf")["dequantising"]
