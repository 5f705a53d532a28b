#!/usr/bin/env bash
# Reproduce the committed results in benchmarks/results/ on this machine (2 cores, CPU):
#   bash benchmarks/run_all.sh [PRESET]      PRESET: bench (default) or quick
# Training runs once (bench: the pair ~40 min, the distilled drafts ~2 h more), then every measurement.
# Not rerun: results/bench/distill/*.json (copies of the drafts' own distill.json, written by the
# distill runs below), bench-int8-target* (a dynamic-int8 target), bench-int8-blockwise-target and
# call-width-large4-int8t-blockwise (a blockwise int8 target): the exporter writes neither any more;
# `--quantize int8` now makes the per-token (rowwise) int8 target, measured in bench-int8-rowwise-*.
# Run it on an otherwise idle machine: every figure is a wall-clock measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-bench}
case "$preset" in
  bench|quick) ;;
  *) echo "usage: bash benchmarks/run_all.sh [bench|quick]   (the pair preset; default bench)" >&2; exit 2 ;;
esac
out=benchmarks/results/$preset
mkdir -p "$out"
pair=$(edgespec train-pair --preset "$preset" --print-path)

# Drafts: the pair's own (1 layer, 0.5 M), a distilled one of the same size, and a distilled
# 2-layer one (1.7 M: `--size large`, 600 + 600 steps, the second run continuing the first).
[ -f "$pair/distilled/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled" --init "$pair/draft" --steps 150 --mode mix --no-progress
[ -f "$pair/distilled-large/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large" --size large --steps 600 --no-progress
[ -f "$pair/distilled-large2/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large2" --size large --init "$pair/distilled-large" --steps 600 --lr 2e-3 --seed 1 --no-progress
# ... then on-policy: 3/4 of each batch from 512 continuations the target wrote itself (half greedy)
[ -f "$pair/distilled-large3/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large3" --size large --init "$pair/distilled-large2" --steps 400 --lr 2e-3 --generated 0.75 --pool-size 512 --no-progress
[ -f "$pair/distilled-large4/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large4" --size large --init "$pair/distilled-large3" --steps 600 --lr 1.5e-3 --generated 0.9 --pool-size 1024 --seed 2 --no-progress
[ -f "$pair/distilled-large5/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large5" --size large --init "$pair/distilled-large4" --steps 600 --lr 1e-3 --generated 0.9 --pool-size 1024 --seed 3 --no-progress
# ... and large4 grown to 4 layers (the two new ones start as the identity), 600 on-policy steps
[ -f "$pair/distilled-large4-deep4/config.json" ] || edgespec distill --target "$pair/target" --out "$pair/distilled-large4-deep4" --init "$pair/distilled-large4" --layers 4 --steps 600 --lr 1.5e-3 --generated 0.9 --pool-size 1024 --seed 4 --no-progress

# Bundles (static-KV graphs, the exporter's default for Llama); re-exported if an older export
# with optimum's concat graphs is in the way.
bundle_of() {  # bundle_of NAME DRAFT_DIR [export options] -> prints the bundle folder
  local b="$pair/bundles/$1" draft="$2"
  shift 2
  grep -q '"kv_layout": "static"' "$b/edgespec.json" 2>/dev/null ||
    edgespec export --target "$pair/target" --draft "$draft" --out "$b" --overwrite --quiet "$@" >&2
  echo "$b"
}
pair_bundle=$(bundle_of pair-draft "$pair/draft")
small=$(bundle_of distilled "$pair/distilled")
# the best draft, int8: the draft's weights are read once per drafted token, so 4x fewer bytes
# matter, and a draft's precision cannot change the output distribution (only alpha)
large=$(bundle_of distilled-large2-int8 "$pair/distilled-large2" --quantize-draft int8)
large3=$(bundle_of large3-int8 "$pair/distilled-large3" --quantize-draft int8)
large4=$(bundle_of large4-int8 "$pair/distilled-large4" --quantize-draft int8)
large5=$(bundle_of large5-int8 "$pair/distilled-large5" --quantize-draft int8)
deep4=$(bundle_of deep4-int8 "$pair/distilled-large4-deep4" --quantize-draft int8)
# the target in int8 too (per-token int8: a different, quantized target; causal, not bit-exact vs plain)
large4_q=$(bundle_of large4-int8t-rowwise "$pair/distilled-large4" --quantize int8)

# 1. the bench grid (issue 4 targets, issue 8 adaptive vs static) with the best draft, 1 thread per
#    model and 2 threads for the target
edgespec bench "$large" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --repeats 5 --out "$out/bench-large"
edgespec bench "$large" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 2 --draft-threads 1 --repeats 5 --out "$out/bench-large-2threads"
#    the on-policy distilled drafts, fp32 target, then the int8 target
edgespec bench "$large3" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large3"
edgespec bench "$large3" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 2 --draft-threads 1 --repeats 5 --out "$out/bench-large3-2threads"
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4"
#    the same command again: how much the shared host moves the ratio (it moves plain decoding more)
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-again"
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-third"
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 2 --draft-threads 1 --repeats 5 --out "$out/bench-large4-2threads"
edgespec bench "$large5" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large5"
#    large4 and the grown 4-layer draft, alternately (the host's drift hits both alike)
for run in a b; do
  edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-s9$run"
  edgespec bench "$deep4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-deep4-s9$run"
done
#    the same command in later sessions (the host's load moves the ratio from run to run)
for run in s10a s10b s10c s11a; do
  edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-$run"
done
edgespec bench "$large4_q" --gammas 4,5,6,8,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-int8-rowwise-target"
edgespec bench "$large4_q" --gammas 5,6,auto --temperatures 0,1 --draft model,lookahead --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-int8-rowwise-lookahead"
#    the decode-rate columns (run twice) and the lookahead drafter beside the model drafter
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-decode"
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-decode-again"
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --draft model,lookahead --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-lookahead"
#    the hybrid drafter (model + prompt lookup) beside the model drafter, twice; where lookup beats the model
for run in "" -b; do
  edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0,1 --draft model,hybrid --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-hybrid$run"
done
edgespec bench "$large4" --gammas 3,4,5,6,auto --temperatures 0 --draft model,hybrid --threads 1 --draft-threads 1 --repeats 5 --out "$out/bench-large4-hybrid-c"
python benchmarks/lookup_agreement.py "$large4" --out "$out/lookup-agreement"
python benchmarks/lookup_agreement.py "$large4" --max-new-tokens 96 --out "$out/lookup-agreement-96"
#    plain steps where drafting loses (adaptive gamma choosing gamma = 0): the quick pair, whose
#    speculative decoding barely pays on a CPU that keeps its weights in cache (results/bench/
#    quick-plain-steps; quick-before-plain-steps is the same command at commit c3986e0)
quick=$(edgespec train-pair --preset quick --print-path)
[ -f "$quick/bundle/edgespec.json" ] || edgespec export --target "$quick/target" --draft "$quick/draft" --out "$quick/bundle" --quiet
edgespec bench "$quick/bundle" --gammas 2,3,4,auto --temperatures 0,1 --threads 1 --draft-threads 1 --repeats 5 --out "$out/quick-plain-steps"
# 2. the same grid with the pair's own draft and the small distilled draft
edgespec bench "$pair_bundle" --gammas 1,2,3,4,6,8,auto --temperatures 0,1 --threads 1 --repeats 5 --out "$out/bench"
edgespec bench "$small" --gammas 2,3,4,6,auto --temperatures 0,1 --threads 1 --repeats 5 --out "$out/bench-distilled"
edgespec bench "$small" --gammas 2,4 --temperatures 0,1 --threads 2 --draft-threads 1 --repeats 3 --quiet --out "$out/bench-distilled-2threads"
# 2b. the same model exported both ways (static-KV vs optimum's concat graph), per-call costs interleaved
[ -f "$pair/bundles/pair-draft-optimum/edgespec.json" ] ||
  edgespec export --target "$pair/target" --draft "$pair/draft" --out "$pair/bundles/pair-draft-optimum" --graph optimum --overwrite --quiet
python benchmarks/graphs.py --static "$pair_bundle" --concat "$pair/bundles/pair-draft-optimum" --out "$out/graphs"
# 2c. the MatMul kernel alone: int8 schemes' row independence, and what extra verified rows cost in fp32
python benchmarks/int8_rows.py --out "$out/int8-rows"
#     and what the call's width does to the target's logits and to greedy identity, fp32 vs int8 targets
python benchmarks/call_width.py "$large4" --out "$out/call-width-large4-int8"
python benchmarks/call_width.py "$large4_q" --out "$out/call-width-large4-int8t-rowwise"
python benchmarks/verify_width.py --out "$out/verify-width"
# 3. what a draft-length policy can gain at greedy (static sweep, adaptive, best threshold, oracle)
python benchmarks/adaptive_bound.py "$large" --out "$out/adaptive-bound"
python benchmarks/adaptive_bound.py "$large4" --out "$out/adaptive-bound-large4" --calibration 70
#    and what the draft knows at T=1 about whether its token will be kept
python benchmarks/acceptance_signals.py "$large4" --out "$out/acceptance-signals"
# 4. the paper's tables 2-5 and figure 3
python benchmarks/paper_tables.py --pair "$pair" --draft distilled="$pair/distilled" --draft distilled-large2="$pair/distilled-large2" --gammas 2,4,6 --repeats 3 --out "$out/tables"
# 5. peers side by side (onnxruntime-genai runs the same bundle's graphs)
python benchmarks/peers.py --pair "$pair" --bundle "$large" --draft-dir "$pair/distilled-large2" --gamma 5 --repeats 7 --threads 2 --out "$out/peers-large-2threads"
python benchmarks/peers.py --pair "$pair" --bundle "$large" --draft-dir "$pair/distilled-large2" --gamma 5 --repeats 7 --threads 1 --out "$out/peers-large-1thread"
python benchmarks/peers.py --pair "$pair" --bundle "$large4" --draft-dir "$pair/distilled-large4" --gamma 5 --repeats 7 --threads 2 --out "$out/peers-large4-2threads"
python benchmarks/peers.py --pair "$pair" --bundle "$large4" --draft-dir "$pair/distilled-large4" --gamma 5 --repeats 7 --threads 1 --out "$out/peers-large4-1thread"
# the same command again, as published (every peers.py run includes the lookahead drafter; this
# second run was the first to show it, hence the folder's name)
python benchmarks/peers.py --pair "$pair" --bundle "$large4" --draft-dir "$pair/distilled-large4" --gamma 5 --repeats 7 --threads 1 --out "$out/peers-large4-1thread-lookahead"
python benchmarks/peers.py --pair "$pair" --bundle "$small" --draft-dir "$pair/distilled" --repeats 2 --max-new-tokens 48 --out "$out/peers"
# 6. the XLA reference path on the same pair: greedy identity with ONNX Runtime and both runtimes' speed
grep -q '"kv_layout": "static"' "$pair/bundle-xla/edgespec.json" 2>/dev/null ||
  edgespec export --target "$pair/target" --draft "$pair/draft" --out "$pair/bundle-xla" --format onnx+xla --overwrite --quiet
python benchmarks/runtimes.py --bundle "$pair/bundle-xla" --out "$out/runtimes"
