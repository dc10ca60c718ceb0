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
  install_packages "${missing[@]}"
}

# install_packages package ... — as root with apt-get; otherwise say what to run and stop.
install_packages() {
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "› installing $* (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
  else
    echo "error: missing system packages: $*" >&2
    echo "install them with: sudo apt-get install -y $*" >&2
    exit 1
  fi
}

# PostgreSQL's server programs (initdb, postgres) live in /usr/lib/postgresql/<N>/bin, which
# is not on PATH, so need_packages cannot find them; the store's tests start their own
# throwaway clusters with them (skiff-test-support's `postgres`).
need_postgres() {
  local initdb
  for initdb in /usr/lib/postgresql/*/bin/initdb; do
    [ -x "$initdb" ] && return 0
  done
  install_packages postgresql
}

need_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo is not installed; install Rust from https://rustup.rs and re-run" >&2
    exit 1
  fi
}
