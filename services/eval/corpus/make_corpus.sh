#!/bin/sh
# Regenerates the bundled corpus (see README.md): the King James Bible's Genesis and
# Exodus 1-20 from Debian's bible-kjv-text (read with its `bible` tool, package bible-kjv),
# verse numbers dropped, and CPython 3.11's heapq.py as the code sample.
set -e
here=$(dirname "$0")
bible -l100000 "Gen1:1-Exo20:26" | sed -E 's/^ +[0-9]+ //' | cat -s | sed "1{/^$/d}" > "$here/kjv.txt"
cp "$(python3 -c 'import heapq; print(heapq.__file__)')" "$here/heapq_py.txt"
