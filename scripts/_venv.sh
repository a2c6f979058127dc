# Sourced by scripts/serve and scripts/test: create or refresh .venv at the project root.
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
if [ "$covered" = 0 ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
  echo "$want $extras" > "$stamp"
fi
