# Sourced by tools/demo and tools/test: create or update .venv with the given extras.
# torch is pinned (tools/constraints.txt) to the CPU wheel; /opt/wheels holds it on the reference machines.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ensure_venv() {
    local extras="$1"
    local python="${PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        echo "edgetrain: creating .venv with $($python --version)" >&2
        "$python" -m venv .venv
    fi
    # Reinstall only when the dependency list or the extras changed.
    local stamp=".venv/.edgetrain-installed"
    local want
    # The compiled tile kernel's source too: an editable install builds it once, so a change to it must reinstall.
    want="$(cat pyproject.toml setup.py tools/constraints.txt edgetrain/models/*.c | sha256sum | cut -c1-16)-$extras"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    local find_links=()
    [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
    local spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    echo "edgetrain: installing $spec into .venv (first run takes a few minutes)" >&2
    local log=".venv/install.log"
    if ! .venv/bin/python -m pip install --disable-pip-version-check -c tools/constraints.txt \
            "${find_links[@]}" -e "$spec" >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -40 >&2
        echo "edgetrain: install failed (full log: $log)" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
}
