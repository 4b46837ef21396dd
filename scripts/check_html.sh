#!/usr/bin/env bash
# Open HTML reports in headless Chromium (scripts/check_html.py): every image loads, no horizontal
# scrolling at 1280 px, a screenshot beside each page. Installs Debian's chromium first when it is
# missing and apt-get can run (root); without it the check is skipped with the reason (exit 0).
#   bash scripts/check_html.sh REPORT.html [...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        echo "installing Debian's chromium for the browser check (about a minute)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
            || (apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1) \
            || true
    fi
fi
set +e
"$PY" scripts/check_html.py "$@"
rc=$?
set -e
if [ "$rc" = 3 ]; then
    echo "SKIPPED: the HTML browser check (no Chromium, and it could not be installed here)" >&2
    exit 0
fi
exit "$rc"
