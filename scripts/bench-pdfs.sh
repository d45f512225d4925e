#!/usr/bin/env bash
# The real PDFs the documents benchmark runs on, from Debian's r-doc-pdf package (R's
# manuals, typeset by TeX): refman.pdf, the R reference manual of 2,415 pages, and
# R-intro.pdf (113 pages, the source of the scanned document). Prints the directory.
# Idempotent: downloads the package (about 10 MB) once into bench/.pdfs/.
set -euo pipefail

dest="$(cd "$(dirname "$0")/.." && pwd)/bench/.pdfs"
if [ -s "$dest/refman.pdf" ] && [ -s "$dest/R-intro.pdf" ]; then
  echo "$dest"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "bench-pdfs: no apt-get here; put refman.pdf and R-intro.pdf (R's manuals) in $dest" >&2
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
# `apt-get download` needs the package lists; refresh them only when it cannot find it.
apt-get download r-doc-pdf >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null && apt-get download r-doc-pdf >/dev/null; }
dpkg-deb -x r-doc-pdf_*.deb tree
mkdir -p "$dest"
cp tree/usr/share/R/doc/manual/refman.pdf tree/usr/share/R/doc/manual/R-intro.pdf "$dest/"
echo "$dest"
