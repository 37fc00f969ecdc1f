#!/bin/sh
# Print the first Python >= 3.10 on PATH (newest first); exit 1 with a message if none.
# macOS ships python3 3.9: `brew install python@3.12` (or python.org, or uv) gives a newer one.
for exe in python3.13 python3.12 python3.11 python3.10 python3 python; do
    path=$(command -v "$exe" 2>/dev/null) || continue
    if "$path" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "$path"
        exit 0
    fi
done
echo "macinfer needs Python 3.10 or newer; found none on PATH (python3 is $(python3 --version 2>&1 || echo missing))." >&2
echo "On macOS: brew install python@3.12 (or use python.org's installer), then run make again." >&2
exit 1
