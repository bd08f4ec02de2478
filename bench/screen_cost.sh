#!/usr/bin/env bash
# The instruction screen's cost (bench/README.md, "The instruction screen"): one first build of the shipped
# mall_knowledge and one routine run after a one-line edit of one page, each a fresh `kb-reindex run` process on
# e5, with KB_INSTRUCTION_SCREEN=patterns (the classifier off) and =meaning, interleaved so both see the same load.
# Each mode gets its own temporary project (KB_PROJECT_ROOT: a copy of knowledge/, its own state DB and store).
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for mode in patterns meaning; do mkdir -p "$work/$mode" && cp -r knowledge "$work/$mode/"; done
run() {
  local start end
  start=$(date +%s.%N)
  KB_PROJECT_ROOT="$work/$1" KB_EMBEDDER=e5 KB_INSTRUCTION_SCREEN=$1 .venv/bin/kb-reindex run > "$work/$1-$2.log" 2>&1
  end=$(date +%s.%N)
  printf '%-8s %-9s %6.1f s  load %s  %s\n' "$2" "$1" "$(echo "$end - $start" | bc)" "$(cut -d' ' -f1 /proc/loadavg)" \
    "$(grep -o 'judged [0-9]* of them.*before' "$work/$1-$2.log" || true)"
}
for mode in patterns meaning; do run "$mode" first; done
for mode in patterns meaning; do
  printf '\n客服热线每天 9:00 至 21:00 在线，节假日照常服务。\n' >> "$work/$mode/knowledge/docs/return-policy.md"
done
for mode in patterns meaning; do run "$mode" routine; done
