# Shared by scripts/demo and scripts/test: make sure the system programs Skiff drives exist.
# As root, missing Debian packages are installed with apt-get; otherwise we say exactly what
# to run and stop.

# need_packages "command:package" ...
need_packages() {
  local missing=() pair cmd pkg
  for pair in "$@"; do
    cmd=${pair%%:*}
    pkg=${pair#*:}
    # Daemons such as sshd live in sbin, which is not on every PATH.
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "› installing ${missing[*]} (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    echo "error: missing system packages: ${missing[*]}" >&2
    echo "install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
}

need_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo is not installed; install Rust from https://rustup.rs and re-run" >&2
    exit 1
  fi
}
