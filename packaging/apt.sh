# Sourced by packaging/dev.sh and packaging/gpu_build.sh: install Debian/Ubuntu packages, as root
# or through sudo. The caller defines say() (its own message prefix).
apt_install() {
    command -v apt-get >/dev/null || { say "please install: $*"; exit 1; }
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    say "installing system packages: $*"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
