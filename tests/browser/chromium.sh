#!/usr/bin/env bash
# The browser the page's tests drive: Debian's chromium package, through
# Playwright (tests/browser/conftest.py). Playwright's own browser download
# cannot work here (only package registries are reachable), so the system
# browser it is.
#
#   chromium.sh install  apt-get install chromium when missing
#   chromium.sh check    start it headless once; exit 1 if it cannot
#   chromium.sh status   one line
set -euo pipefail

die() { echo "chromium: $*" >&2; exit 1; }

binary() {
    command -v chromium 2>/dev/null || { [[ -x /usr/bin/chromium ]] && echo /usr/bin/chromium; }
}

install() {
    binary >/dev/null && return 0
    local sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    echo "chromium: installing the Debian package chromium (for the browser tests)..."
    $sudo apt-get update -qq || die "apt-get update failed"
    # Recommends (upower, udev, a notification daemon, printing) serve a
    # desktop, not a headless test browser.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        chromium >/dev/null || die "apt-get install chromium failed"
}

check() {
    local exe out
    exe="$(binary)" || die "not installed (run: bash $0 install)"
    # --no-sandbox: as root Chromium refuses to start with its sandbox on
    # (Playwright passes it too). Debian's launcher script prints a harmless
    # shell warning on some machines; only the page it renders counts here.
    out="$(timeout 60 "$exe" --headless --no-sandbox --disable-gpu \
        --dump-dom 'data:text/html,<p id="ok">ok</p>' 2>/dev/null)" \
        || die "$exe did not start headless (try: $exe --headless --no-sandbox --dump-dom about:blank)"
    grep -q 'id="ok"' <<<"$out" || die "$exe started but rendered nothing"
    echo "chromium: $("$exe" --version 2>/dev/null | head -n 1) starts headless"
}

status() {
    local exe
    if exe="$(binary)"; then
        echo "chromium: installed ($exe)"
    else
        echo "chromium: not installed"
        return 3
    fi
}

case "${1:-}" in
    install) install ;;
    check) check ;;
    status) status ;;
    *) echo "usage: $0 install|check|status" >&2; exit 2 ;;
esac
