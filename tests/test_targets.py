"""Device profiles: the shipped ones are package data, a profile file is validated field by field, and a
target name never reaches outside the profile directory."""
from __future__ import annotations

from importlib import resources

import pytest

from edgetrain.registry import EdgetrainError
from edgetrain.targets import available_targets, load_target, targets_directory

VALID = {"description": '"a watch"', "backend": '"torch-cpu"', "probe": '"linux"', "dtype": '"float32"',
         "memory_budget_mib": "64"}


def write_profile(path, **fields) -> None:
    values = {**VALID, **fields}
    path.write_text("".join(f"{key} = {value}\n" for key, value in values.items() if value is not None))


def test_the_shipped_profiles_come_from_the_package():
    shipped = resources.files("edgetrain.targets") / "profiles"
    assert targets_directory() == shipped
    assert set(available_targets()) == {entry.name[:-5] for entry in shipped.iterdir() if entry.name.endswith(".toml")}
    assert load_target("cpu").backend == "torch-cpu"


def test_a_directory_of_ones_own_replaces_them(tmp_path, monkeypatch):
    write_profile(tmp_path / "watch.toml")
    monkeypatch.setenv("EDGETRAIN_TARGETS_DIR", str(tmp_path))
    assert available_targets() == ["watch"]
    assert load_target("watch").memory_budget_mib == 64
    with pytest.raises(EdgetrainError, match="unknown target 'cpu'; known targets: watch"):
        load_target("cpu")


@pytest.mark.parametrize("fields, message", [
    ({"memory_budget_mib": '"lots"'}, "memory_budget_mib must be int, not str"),
    ({"memory_budget_mib": "1.5"}, "memory_budget_mib must be int, not float"),
    ({"memory_budget_mib": "true"}, "memory_budget_mib must be int, not bool"),
    ({"memory_budget_mib": "0"}, "memory_budget_mib must be positive"),
    ({"memory_budget_mib": "-3"}, "memory_budget_mib must be positive"),
    ({"backend": "7"}, "backend must be str, not int"),
    ({"probe": None}, "missing field 'probe'"),
    ({"default_methods": '"bp"'}, "default_methods must be a list"),
    ({"default_methods": "[1, 2]"}, "default_methods must be a list"),
    ({"description": "[unclosed"}, "not valid TOML"),
])
def test_a_hostile_profile_is_refused_by_field(tmp_path, fields, message):
    path = tmp_path / "watch.toml"
    write_profile(path, **fields)
    with pytest.raises(EdgetrainError, match=message) as caught:
        load_target(path)
    assert str(path) in str(caught.value)


def test_a_profile_file_of_bytes_is_refused(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(EdgetrainError, match="not valid TOML"):
        load_target(path)


def test_a_target_name_is_never_a_path():
    shipped_cpu = str(targets_directory() / "cpu")  # without .toml: a name, by the rule, that is really a path
    for name in ("../profiles/cpu", shipped_cpu, "/etc/passwd"):
        with pytest.raises(EdgetrainError, match="a target is a name"):
            load_target(name)
    for name in ("..", "", "nonesuch"):
        with pytest.raises(EdgetrainError, match="unknown target"):
            load_target(name)
