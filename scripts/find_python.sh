#!/usr/bin/env bash
# Print a Python >= 3.12 interpreter: $PYTHON, python3.12/3.13 on PATH, or pyenv's 3.12/3.13.
set -u
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for c in "${PYTHON:-}" python3 python3.12 python3.13; do
  [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && ok "$c" && { command -v "$c"; exit 0; }
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
    p="$(pyenv root)/versions/$v/bin/python3"
    ok "$p" && { echo "$p"; exit 0; }
  done
fi
echo "no Python >= 3.12 found; install one or set PYTHON=/path/to/python3.12" >&2
exit 1
