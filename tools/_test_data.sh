# Sourced by tools/test: install the Debian packages that hold the real data sets the tests read
# (Fashion-MNIST's IDX files, the fortune cookie files), when apt-get can. Nothing is downloaded at
# test time; where this cannot install them, the tests that need them skip with the exact command.

# package -> the directory it installs (the paths edgetrain.data reads)
TEST_DATA_PACKAGES=(
    "dataset-fashion-mnist:/usr/share/datasets/fashion-mnist"
    "fortunes:/usr/share/games/fortunes"
)

ensure_test_data() {
    local missing=() entry
    for entry in "${TEST_DATA_PACKAGES[@]}"; do
        [ -d "${entry#*:}" ] || missing+=("${entry%%:*}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "edgetrain: no apt-get here; tests that read ${missing[*]} will skip" >&2
        return 0
    fi
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            as_root=(sudo -n)
        else
            echo "edgetrain: not root; tests that read ${missing[*]} will skip" \
                 "(install them with: sudo apt-get install ${missing[*]})" >&2
            return 0
        fi
    fi
    local log="${TMPDIR:-/tmp}/edgetrain-apt.log"
    echo "edgetrain: installing test data: apt-get install ${missing[*]}" >&2
    # A fresh machine may have no package lists yet: update once and try again.
    if ! DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y --no-install-recommends \
            "${missing[@]}" >"$log" 2>&1; then
        if ! { DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get update >>"$log" 2>&1 &&
               DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y --no-install-recommends \
                   "${missing[@]}" >>"$log" 2>&1; }; then
            tail -5 "$log" >&2
            echo "edgetrain: could not install ${missing[*]} (log: $log); the tests that read them will skip" >&2
        fi
    fi
    return 0
}
