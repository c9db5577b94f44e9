# Sourced by scripts/setup and scripts/setup-vllm: venv_install VENV ARGS... installs ARGS (pip's
# syntax) into the virtual environment VENV with uv, which does the same several times faster,
# and with pip where uv cannot be had or fails (ATROPOSD_NO_UV=1 asks for pip). uv does not read
# pip's configuration, so pip's find-links (a local torch wheel, say) are handed to it.
venv_install() {
  local venv=$1
  shift
  if [ -z "${ATROPOSD_NO_UV:-}" ]; then
    if [ ! -x "$venv/bin/uv" ]; then
      "$venv/bin/python" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || true
    fi
    if [ -x "$venv/bin/uv" ]; then
      local links link
      local args=()
      links=${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
      for link in $links; do
        args+=(--find-links "$link")
      done
      # --compile-bytecode: as pip does; with PYTHONDONTWRITEBYTECODE set, nothing would write
      # the .pyc files later, and every process would compile torch again (seconds each)
      if "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${args[@]}" "$@"; then
        return 0
      fi
      echo "setup: uv could not install $*; trying pip" >&2
    fi
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
}
