#!/usr/bin/env bash
# run_trainers.sh TRAINER...: runs each example trainer in every precision the CPU runs, in a
# scratch folder (their exported models go there); fails when any run fails.
set -euo pipefail
programs=()
for program in "$@"; do programs+=("$(cd "$(dirname "$program")" && pwd)/$(basename "$program")"); done
cd "${TEST_TMPDIR:-$(mktemp -d)}"
for program in "${programs[@]}"; do
  for precision in 32 bf16-mixed 16-mixed; do
    "$program" "$precision" cpu
  done
done
