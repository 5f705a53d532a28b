#!/usr/bin/env bash
# Reproduce every committed result in benchmarks/results/ on this machine (2 cores, CPU):
#   bash benchmarks/run_all.sh [PRESET]      PRESET: bench (default, ~45 min of training once) or quick
# Run it on an otherwise idle machine: every figure is a wall-clock measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-bench}
out=benchmarks/results/$preset
mkdir -p "$out"
pair=$(edgespec train-pair --preset "$preset" --print-path)
bundle="$pair/bundle"
[ -f "$bundle/edgespec.json" ] || edgespec export --target "$pair/target" --draft "$pair/draft" --out "$bundle"
# a distilled draft of the pair draft's size (issue: drafts of several sizes, including a distilled one)
[ -f "$pair/distilled/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled" --init "$pair/draft" --steps 100 --mode mix --no-progress
# 1. the bench grid on the pair (issue 4 targets and issue 8 adaptive vs static)
edgespec bench "$bundle" --gammas 1,2,3,4,6,8,auto --temperatures 0,1 --threads 1 --repeats 5 --out "$out/bench"
# 2. the same grid with the distilled draft
[ -f "$pair/bundles/distilled/edgespec.json" ] || edgespec export --target "$pair/target" --draft "$pair/distilled" --out "$pair/bundles/distilled"
edgespec bench "$pair/bundles/distilled" --gammas 2,3,4,6,auto --temperatures 0,1 --threads 1 --repeats 5 --out "$out/bench-distilled"
# 3. the paper's tables 2-5 and figure 3
python benchmarks/paper_tables.py --pair "$pair" --draft distilled="$pair/distilled" --gammas 2,4,6 --repeats 3 --out "$out/tables"
# 4. peers side by side
python benchmarks/peers.py --pair "$pair" --bundle "$pair/bundles/distilled" --draft-dir "$pair/distilled" --out "$out/peers"
# 5. the XLA reference path on the same pair: greedy identity with ONNX Runtime and both runtimes' speed
[ -f "$pair/bundle-xla/edgespec.json" ] || edgespec export --target "$pair/target" --draft "$pair/draft" --out "$pair/bundle-xla" --format onnx+xla
python benchmarks/runtimes.py --bundle "$pair/bundle-xla" --out "$out/runtimes"
