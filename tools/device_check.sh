#!/usr/bin/env bash
# Everything to check and time on a GPU machine in one go, from a checkout (no install needed):
#   bash tools/device_check.sh [OUTDIR]          (default OUTDIR: ./device_out)
# Steps: versions → full pytest (GPU tests included) → compute-sanitizer memcheck on a
# representative subset → `cupydecode check` → `cupydecode bench` sweeps with peers (torch SDPA;
# FlashInfer when importable). Logs, CSV/JSON and the plot go to OUTDIR; a summary prints last.
# STEPS selects steps (default "tests sanitizer check bench layouts"; also "racecheck",
# "sanitizer-scores" (memcheck of windows, ALiBi, sinks, int64 lengths, non-finite inputs), and
# "softcap": the soft-cap's cost, the same points with and without it, and gemma-2 with peers;
# "paged": paged caches of 1 and 16 tokens per page beside the contiguous cache and FlashInfer;
# "append": the cost of appending the new token, contiguous and paged; "window": a sliding window
# over a long cache against a plain cache of the window's length; "scores": ALiBi's and the
# sinks' cost; "soak": tests/test_gpu_soak.py, 10^5 random calls from several threads;
# "head_dims": head_dims between the kernel widths, tested, memchecked and timed; "models":
# `check --model` for every preset's every layer type; "multi": several query tokens per
# sequence, tested, memchecked and timed against one; "fp8": the fp8 quantiser, tested and
# memchecked; "fp8attn": attention over fp8 caches, tested, memchecked and timed against fp16
# and FlashInfer's fp8 decode). DTYPE (default float16) is the dtype of the paged, append and multi sweeps;
# Q_LENS (default "1 2 4 8") the multi sweep's q_lens; FEATURE_TESTS=0 skips the feature steps'
# tests and memcheck (their sweeps only); LAYOUT_DTYPES (default "float16 bfloat16") the
# layouts sweep's dtypes.
# A machine that returns only a few files: run it into a scratch folder and pack that, e.g.
#   bash tools/device_check.sh /tmp/dc; tar czf "$OUT/device_check.tgz" -C /tmp/dc .
set -u
OUT_DIR=${1:-${OUT:-./device_out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
STEPS=${STEPS-"tests sanitizer check bench layouts"}  # STEPS="" runs none (setup only)
PY=${PY:-python3}
DTYPE=${DTYPE:-float16}
summary=()
# Each step's one-line result is also appended to 0_summary.txt as soon as the step ends, so it
# survives a run cut short (or a copy-back that keeps only the first few files, by name).
: > "$OUT_DIR/0_summary.txt"
add_summary() { summary+=("$1"); echo "$1" >> "$OUT_DIR/0_summary.txt"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
# feature_tests NAME FILE FILTER: one feature's GPU test file (4 processes where pytest-xdist is
# there), then memcheck on its tests that FILTER (pytest -k) selects; both into the summary
feature_tests() {
  local name=$1 file=$2 filter=$3
  [ "${FEATURE_TESTS:-1}" = 0 ] && return
  $PY -m pytest -q -p no:cacheprovider $($PY -c "import xdist" 2>/dev/null && echo "-n 4") \
    --tb=line "$file" 2>&1 | tail -n 60 > "$OUT_DIR/${name}_tests.log"  # (one line per failure)
  add_summary "$name tests: $(tail -n 1 "$OUT_DIR/${name}_tests.log")"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY -m pytest -q -p no:cacheprovider "$file" -k "$filter" 2>&1 \
    | tail -n 20 > "$OUT_DIR/sanitizer_${name}.log"
  add_summary "memcheck ($name): $(grep -E 'ERROR SUMMARY' "$OUT_DIR/sanitizer_${name}.log" | tail -n 1) | $(grep -E 'passed|failed' "$OUT_DIR/sanitizer_${name}.log" | tail -n 1)"
}
# merge_parts DEST PART...: the CSV parts as one file (one header), the parts removed (the
# device machine returns few files); an empty DEST where a step wrote none
merge_parts() {
  local dest=$1; shift
  if [ -e "$1" ]; then
    awk 'FNR == 1 && NR != 1 { next } 1' "$@" > "$dest" && rm -f "$@"
  else
    : > "$dest"
  fi
}

# Peers that are not installed on the machine can travel as wheels in .whl/ (never dependencies).
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/peers
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  | tee "$OUT_DIR/gpu.txt"
$PY -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"

if has tests; then
  XDIST=""  # GPU tests in 4 processes where pytest-xdist is there (about 100 s instead of 270)
  $PY -c "import xdist" 2>/dev/null && XDIST="-n 4"
  $PY -m pytest -q -ra -p no:cacheprovider $XDIST 2>&1 | tee "$OUT_DIR/pytest.log"
  add_summary "pytest: $(tail -n 1 "$OUT_DIR/pytest.log")"
fi

if has sanitizer; then
  # (about 290 s on the H200: a device call of its own, STEPS=sanitizer)
  timeout 420 compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_merge.py \
    tests/test_gpu_plan.py tests/test_gpu_scores.py tests/test_gpu_paged.py \
    -k "paged or pages or soft_cap or clamped or transposed or slice or large_logits or gqa or empty \
    or cache_seqlens or split_counts or many_forced or merge or graph or long_chunk or m_tile \
    or both_tensor_core_paths or (warps_in_step and not bfloat16) or (kv_groups and not bfloat16) \
    or enable_pdl or l2_hint" \
    2>&1 \
    | tail -n 40 > "$OUT_DIR/sanitizer.log"
  add_summary "memcheck: $(grep -E 'ERROR SUMMARY' "$OUT_DIR/sanitizer.log" | tail -n 1) | $(grep -E 'passed|failed' "$OUT_DIR/sanitizer.log" | tail -n 1)"
  # the appended rows' writes and the split kernel over the grown sequences: out-of-range
  # lengths and pages, page boundaries, strided new tokens, HND pages, a graph
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu_append.py \
    -k "(append_matches_reference and float16 and not bfloat16) or clamped or out_of_range_page \
    or graph or host_lengths or hnd or mtile" 2>&1 \
    | tail -n 40 > "$OUT_DIR/sanitizer_append.log"
  add_summary "memcheck (append): $(grep -E 'ERROR SUMMARY' "$OUT_DIR/sanitizer_append.log" | tail -n 1) | $(grep -E 'passed|failed' "$OUT_DIR/sanitizer_append.log" | tail -n 1)"
fi

if has sanitizer-scores; then
  # windows (splits from the window's start), ALiBi, sinks (the epilogue and both merges),
  # int64 lengths, non-finite inputs and the merge's non-finite states, in float16
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu_window.py tests/test_gpu_scores.py \
    tests/test_gpu_merge.py tests/test_gpu_decode.py tests/test_gpu_paged.py \
    -k "(window and not bfloat16 and not float32) or (alibi and not bfloat16) \
    or (sinks and not bfloat16) or int64 or pos_inf or non_finite" 2>&1 \
    | tail -n 40 > "$OUT_DIR/sanitizer_scores.log"
  add_summary "memcheck (window, alibi, sinks): $(grep -E 'ERROR SUMMARY' "$OUT_DIR/sanitizer_scores.log" | tail -n 1) | $(grep -E 'passed|failed' "$OUT_DIR/sanitizer_scores.log" | tail -n 1)"
fi

if has racecheck; then
  # shared-memory hazards of the split kernel (ring reuse, shared M-tile rings, epilogue) on a
  # few small cases (the M-tile layouts in both 16-bit types, both tensor-core paths in fp16,
  # blocks of several KV heads in fp16 with one split and with the fused merge, and the paged
  # KV view's per-stage mask words, and the appended row patched into the ring)
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu_plan.py tests/test_gpu_decode.py \
    tests/test_gpu_paged.py tests/test_gpu_append.py \
    -k "merge_modes_agree or m_tile_layouts or (both_tensor_core_paths and not bfloat16) \
    or (kv_groups and not bfloat16 and nhd and not kernel) or enable_pdl or paged_kv_groups \
    or (paged_matches_reference and float16 and 48-1-128) \
    or (append_matches_reference and float16 and not bfloat16 and (48-1-128 or 32-8-128) \
    and (contiguous or page16))" 2>&1 \
    | tail -n 20 > "$OUT_DIR/racecheck.log"
  add_summary "racecheck: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT_DIR/racecheck.log" | tail -n 1) | $(grep -E 'passed|failed' "$OUT_DIR/racecheck.log" | tail -n 1)"
fi

if has check; then
  $PY -m cupydecode.cli check --json "$OUT_DIR/check.json" 2>&1 | tee "$OUT_DIR/check.log"
  add_summary "check: exit ${PIPESTATUS[0]}, $(grep -c PASS "$OUT_DIR/check.log") PASS, $(grep -c FAIL "$OUT_DIR/check.log") FAIL"
fi

BASELINES=""  # peers only where they are installed (a missing one would stop the bench)
$PY -c "import torch" 2>/dev/null && BASELINES="--baseline torch"
$PY -c "import flashinfer" 2>/dev/null && BASELINES="$BASELINES --baseline flashinfer"
PROTOCOLS=${PROTOCOLS:-"step,back-to-back"}  # the sweeps' protocols (layouts: the first)
PLOT=""
$PY -c "import matplotlib" 2>/dev/null && PLOT="--plot $OUT_DIR/bench.png"
if has bench; then
  $PY -m cupydecode.cli bench $BASELINES --protocol "$PROTOCOLS" --csv "$OUT_DIR/bench.csv" \
    --json "$OUT_DIR/bench.json" $PLOT 2>"$OUT_DIR/bench.err" | tee "$OUT_DIR/bench.txt"
  $PY -m cupydecode.cli bench $BASELINES --protocol "$PROTOCOLS" --seqlens 8192 --batch 4,16,64 \
    --csv "$OUT_DIR/bench_b8k.csv" 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/bench.txt"
  $PY -m cupydecode.cli bench $BASELINES --protocol "$PROTOCOLS" --seqlens 32768 --batch 16 \
    --csv "$OUT_DIR/bench_b32k.csv" 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/bench.txt"
  add_summary "bench: $(awk 'FNR > 1' "$OUT_DIR"/bench*.csv | wc -l) rows in bench*.csv"
fi

if has softcap; then
  # what logits_soft_cap costs: llama-3-8b without and with a cap of 50 (same process order,
  # decode-step protocol), then gemma-2-9b (its own cap) beside FlashInfer, which has one too
  for cap in 0 50; do
    $PY -m cupydecode.cli bench --protocol "${PROTOCOLS%%,*}" --soft-cap $cap --seqlens 16384,65536 \
      --batch 1,16 --csv "$OUT_DIR/softcap_$cap.csv" 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/softcap.txt"
  done
  $PY -m cupydecode.cli bench $BASELINES --protocol "${PROTOCOLS%%,*}" --model gemma-2-9b \
    --seqlens 16384,65536 --batch 1,16 --csv "$OUT_DIR/softcap_gemma.csv" 2>>"$OUT_DIR/bench.err" \
    | tee -a "$OUT_DIR/softcap.txt"
  add_summary "softcap: $($PY - "$OUT_DIR" <<'PYEOF'
import csv, sys
rows = {c: {(r["batch"], r["seqlen"]): float(r["gpu_us"] or "nan") for r in csv.DictReader(open(f"{sys.argv[1]}/softcap_{c}.csv"))} for c in ("0", "50")}
print("; ".join(f"b{b}x{L}: {rows['0'][b, L]:.1f} -> {rows['50'][b, L]:.1f} us ({100 * (rows['50'][b, L] / rows['0'][b, L] - 1):+.2f}%)" for b, L in rows["0"]))
PYEOF
)"
fi

if has paged; then
  # the same points contiguous and paged (random page order) side by side in one process,
  # FlashInfer on the same pages
  fi_opt=$(echo "$BASELINES" | grep -o -- "--baseline flashinfer")
  for pt in "16384,65536 1" "8192 4" "32768 16"; do
    set -- $pt
    $PY -m cupydecode.cli bench $fi_opt --protocol "${PROTOCOLS%%,*}" --page-size none,1,16 \
      --dtype "$DTYPE" --seqlens "$1" --batch "$2" --csv "$OUT_DIR/paged_$2.csv" 2>>"$OUT_DIR/bench.err" \
      | tee -a "$OUT_DIR/paged.txt"
  done
  merge_parts "$OUT_DIR/paged.csv" "$OUT_DIR"/paged_*.csv
  add_summary "paged: $($PY - "$OUT_DIR/paged.csv" <<'PYEOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
base = {(r["batch"], r["seqlen"]): float(r["gpu_us"]) for r in rows if not r["page_size"]}
out = []
for r in rows:
    if r["page_size"] and r["gpu_us"]:
        us, b = float(r["gpu_us"]), base.get((r["batch"], r["seqlen"]))
        fi = [float(r[c]) for c in ("flashinfer_us", "flashinfer_tc_us") if r.get(c)]
        out.append(f"p{r['page_size']} b{r['batch']}x{r['seqlen']}: {us:.1f} us"
                   + (f" ({100 * (us / b - 1):+.1f}% vs contiguous)" if b else "")
                   + (f" FI {min(fi):.1f} x{min(fi) / us:.3f}" if fi else "") + f" {r['check']}")
print("; ".join(out))
PYEOF
)"
fi

if has append; then
  # what appending the new token costs: the same call with and without the append (bench
  # --append times both in the same process), contiguous and paged (16 tokens a page)
  $PY -m cupydecode.cli bench --protocol "${PROTOCOLS%%,*}" --append --page-size none,16 \
    --dtype "$DTYPE" --seqlens 16384,65536 --batch 1,16 --csv "$OUT_DIR/append.csv" 2>>"$OUT_DIR/bench.err" \
    | tee -a "$OUT_DIR/append.txt"
  add_summary "append: $($PY - "$OUT_DIR/append.csv" <<'PYEOF'
import csv, sys
out = []
for r in csv.DictReader(open(sys.argv[1])):
    if r["gpu_us"] and r["no_append_us"]:
        us, base = float(r["gpu_us"]), float(r["no_append_us"])
        out.append(f"p{r['page_size'] or '-'} b{r['batch']}x{r['seqlen']} ({float(r['kv_bytes']) / 1e6:.0f} MB): "
                   f"{base:.1f} -> {us:.1f} us ({100 * (us / base - 1):+.2f}%) {r['check']}")
print("; ".join(out))
PYEOF
)"
fi

if has window; then
  # a window of 4095 over 128k tokens against a plain cache of 4096 (the target: <= 1.10x),
  # FlashInfer with the same window, torch SDPA over the window's tokens
  $PY -m cupydecode.cli bench $BASELINES --protocol "${PROTOCOLS%%,*}" --window 4095 \
    --seqlens 131072 --batch 1,16 --csv "$OUT_DIR/window_w.csv" 2>>"$OUT_DIR/bench.err" \
    | tee -a "$OUT_DIR/window.txt"
  $PY -m cupydecode.cli bench $BASELINES --protocol "${PROTOCOLS%%,*}" --seqlens 4096 \
    --batch 1,16 --csv "$OUT_DIR/window_plain.csv" 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/window.txt"
  merge_parts "$OUT_DIR/window.csv" "$OUT_DIR"/window_*.csv
  add_summary "window: $($PY - "$OUT_DIR/window.csv" <<'PYEOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
plain = {r["batch"]: float(r["gpu_us"]) for r in rows if not r["window_left"] and r["gpu_us"]}
print("; ".join(f"b{r['batch']} W{r['window_left']} over {r['seqlen']}: {float(r['gpu_us']):.1f} us "
                f"vs plain {plain.get(r['batch'], float('nan')):.1f} "
                f"(x{float(r['gpu_us']) / plain.get(r['batch'], float('nan')):.3f}) {r['check']}"
                for r in rows if r["window_left"] and r["gpu_us"]))
PYEOF
)"
fi

if has scores; then
  # what ALiBi and sinks cost: llama-3-8b without and with each (same protocol, one process each)
  for opt in "" --alibi --sinks; do
    $PY -m cupydecode.cli bench --protocol "${PROTOCOLS%%,*}" $opt --seqlens 16384,65536 \
      --batch 1,16 --csv "$OUT_DIR/scores_${opt#--}.csv" 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/scores.txt"
  done
  merge_parts "$OUT_DIR/scores.csv" "$OUT_DIR"/scores_*.csv
  add_summary "scores: $($PY - "$OUT_DIR/scores.csv" <<'PYEOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
base = {(r["batch"], r["seqlen"]): float(r["gpu_us"]) for r in rows
        if r["alibi"] != "True" and r["sinks"] != "True" and r["gpu_us"]}
print("; ".join(f"{'alibi' if r['alibi'] == 'True' else 'sinks'} b{r['batch']}x{r['seqlen']}: "
                f"{float(r['gpu_us']) / base[r['batch'], r['seqlen']] - 1:+.2%} {r['check']}"
                for r in rows if (r["alibi"] == "True" or r["sinks"] == "True") and r["gpu_us"]))
PYEOF
)"
fi

if has head_dims; then
  # head_dims between the kernel widths: their GPU tests, a memcheck of some, and the read
  # ceiling's share at >= 256 MB of KV (phi-2's 80 and phi-3-mini's 96 with their MHA heads;
  # 112 and 192 with llama-3-8b's heads, and its own 128 beside them), peers where they run
  feature_tests head_dims tests/test_gpu_head_dims.py \
    "(float16-80 or float16-192 or float32-136 or paged) and not bfloat16"
  # ours alone first (no peer in the process), so that a fault there is ours
  $PY -m cupydecode.cli bench --protocol "${PROTOCOLS%%,*}" --model phi-2 --seqlens 16384,65536 \
    --batch 1,16 2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/head_dims.txt" \
    | grep -qE "^ +16 +65536 .* ok$" && add_summary "head_dims: phi-2 alone ok" \
    || add_summary "head_dims: phi-2 alone FAILED (bench.err)"
  for spec in "phi-2" "phi-3-mini" "llama-3-8b --head-dim 112" "llama-3-8b --head-dim 192" "llama-3-8b"; do
    tag=$(echo "$spec" | tr -c 'a-z0-9\n' '_')
    $PY -m cupydecode.cli bench $BASELINES --protocol "${PROTOCOLS%%,*}" --model $spec \
      --seqlens 16384,65536 --batch 1,4,16 --csv "$OUT_DIR/head_dims_$tag.csv" 2>>"$OUT_DIR/bench.err" \
      | tee -a "$OUT_DIR/head_dims.txt"
  done
  merge_parts "$OUT_DIR/head_dims.csv" "$OUT_DIR"/head_dims_*.csv
  add_summary "head_dims bench: $($PY - "$OUT_DIR/head_dims.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["gpu_us"]]
out = []
for r in rows:
    if float(r["kv_bytes"]) >= 256e6:
        peer = f" x{float(r['speedup_vs_best_peer']):.3f} peer" if r["speedup_vs_best_peer"] else ""
        out.append(f"{r['model']} D{r['head_dim']} b{r['batch']}x{r['seqlen']}: "
                   f"{float(r['pct_of_floor']):.1f}% floor{peer} {r['check']}")
print("; ".join(out))
PYEOF
)"
fi

if has soak; then
  # many random calls from 4 threads and streams and a graph replayed from a fifth, sampled
  # outputs checked, caches and the memory pool bounded (SOAK_CALLS: default 100000)
  CUPYDECODE_SOAK=1 CUPYDECODE_SOAK_CALLS=${SOAK_CALLS:-100000} timeout 540 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu_soak.py 2>&1 | tail -n 20 > "$OUT_DIR/soak.log"
  add_summary "soak: $(grep -E 'passed|failed' "$OUT_DIR/soak.log" | tail -n 1)"
fi

if has fp8; then
  # fp8 KV: the standalone quantiser against the reference, code for code, and its memcheck
  feature_tests fp8 tests/test_gpu_fp8.py "(e4m3 and float16 and not bfloat16) or slice or strided or bad or cache or grid"
fi

if has fp8attn; then
  # attention over fp8 caches: its GPU tests and check rows, a memcheck of some, then the time of
  # e4m3 (scales per tensor, per token) and e5m2 against the same points in float16, FlashInfer's
  # fp8 decode beside (per-tensor scales, the one kind it takes); targets: >= 1.85x fp16 at
  # >= 256 MB of fp16-equivalent KV, >= 90% of the fp8 floor at >= 128 MB of fp8 bytes,
  # >= 1.5x FlashInfer's fp8
  feature_tests fp8attn tests/test_gpu_fp8_attention.py \
    "(matches_the_reference and e4m3 and (32x8x128 or 24x8x96)) or paged or append or graph or nan or bad"
  $PY -m pytest -q -p no:cacheprovider tests/test_cli_gpu.py -k "kv_dtype or ignores_the_scales" \
    2>&1 | tail -n 20 > "$OUT_DIR/fp8attn_cli.log"
  add_summary "fp8attn cli tests: $(tail -n 1 "$OUT_DIR/fp8attn_cli.log")"
  fi_opt=$(echo "$BASELINES" | grep -o -- "--baseline flashinfer")
  for kv in "none" "e4m3 tensor" "e4m3 token" "e5m2 tensor"; do
    set -- $kv
    tag=${1}${2:+_$2}
    opts=""; [ "$1" != none ] && opts="--kv-dtype $1 --kv-scale $2"
    for pt in "16384,65536 1,16" "8192 4" "32768 16"; do
      set -- $pt
      $PY -m cupydecode.cli bench $fi_opt --protocol "${PROTOCOLS%%,*}" $opts \
        --seqlens "$1" --batch "$2" --csv "$OUT_DIR/fp8attn_${tag}_${2%%,*}.csv" \
        2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/fp8attn.txt"
    done
  done
  merge_parts "$OUT_DIR/fp8attn.csv" "$OUT_DIR"/fp8attn_*_*.csv
  add_summary "fp8attn bench: $($PY - "$OUT_DIR/fp8attn.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["gpu_us"]]
fp16 = {(r["batch"], r["seqlen"]): r for r in rows if not r["kv_dtype"]}
out = []
for r in rows:
    if r["kv_dtype"]:
        base = fp16.get((r["batch"], r["seqlen"]))
        fi = [float(r[c]) for c in ("flashinfer_us", "flashinfer_tc_us") if r.get(c)]
        us = float(r["gpu_us"])
        out.append(f"{r['kv_dtype']}/{r['kv_scale']} b{r['batch']}x{r['seqlen']} "
                   f"({float(r['kv_bytes']) / 1e6:.0f} MB): {us:.1f} us, "
                   f"{float(r['pct_of_floor']):.1f}% floor"
                   + (f", x{float(base['gpu_us']) / us:.3f} fp16" if base else "")
                   + (f", x{min(fi) / us:.3f} FI" if fi else "") + f" {r['check']}")
print("; ".join(out))
PYEOF
)"
fi

if has multi; then
  # several query tokens per sequence: their GPU tests, a memcheck of some, and the time of
  # q_len 2, 4, 8 against one token (targets: q_len 4 <= 1.15x, q_len 8 <= 1.3x at >= 64 MB),
  # torch SDPA with the causal mask aligned to the end beside
  feature_tests multi tests/test_gpu_multi_token.py \
    "(float16 and not bfloat16 and (32-8-128 or 48-1-128)) or paged or graph or bad or window"
  torch_opt=$(echo "$BASELINES" | grep -o -- "--baseline torch")
  for model in llama-3-8b llama-3-70b; do
    for n in ${Q_LENS:-1 2 4 8}; do
      $PY -m cupydecode.cli bench $torch_opt --protocol "${PROTOCOLS%%,*}" --model $model --q-len $n \
        --dtype "$DTYPE" \
        --seqlens 16384,65536 --batch 1,16 --csv "$OUT_DIR/multi_${model}_$n.csv" 2>>"$OUT_DIR/bench.err" \
        | tee -a "$OUT_DIR/multi.txt"
    done
  done
  merge_parts "$OUT_DIR/multi.csv" "$OUT_DIR"/multi_*_*.csv
  add_summary "multi bench: $($PY - "$OUT_DIR/multi.csv" <<'PYEOF'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["gpu_us"]]
one = {(r["model"], r["batch"], r["seqlen"]): float(r["gpu_us"]) for r in rows if r["q_len"] == "1"}
print("; ".join(f"{r['model']} q{r['q_len']} b{r['batch']}x{r['seqlen']}: "
                f"x{float(r['gpu_us']) / one[r['model'], r['batch'], r['seqlen']]:.3f} of q1"
                + (f", x{float(r['speedup_vs_best_peer']):.3f} peer" if r["speedup_vs_best_peer"] else "")
                + f" {r['check']}" for r in rows if r["q_len"] != "1"))
PYEOF
)"
fi

if has models; then
  # every model preset's every layer type (its window, soft-cap, ALiBi, sinks) against float64,
  # varlen with an empty sequence, in both 16-bit types
  : > "$OUT_DIR/models.log"
  for model in $($PY -c "from cupydecode.workloads import MODELS; print(' '.join(MODELS))"); do
    for dtype in float16 bfloat16; do
      $PY -m cupydecode.cli check --model "$model" --dtype "$dtype" --batch 3 --seqlen 6000 \
        --varlen 2>&1 | tee -a "$OUT_DIR/models.log"
    done
  done
  add_summary "models: $(grep -c ' PASS$' "$OUT_DIR/models.log") PASS, $(grep -c ' FAIL$' "$OUT_DIR/models.log") FAIL"
fi

if has layouts; then
  # every model preset in both 16-bit types, in the first protocol (the decode-step one), peers
  # too: 20 bench processes, several minutes; best a device call of its own (STEPS=layouts)
  for model in $($PY -c "from cupydecode.workloads import MODELS; print(' '.join(MODELS))"); do
    for dtype in ${LAYOUT_DTYPES:-float16 bfloat16}; do
      $PY -m cupydecode.cli bench $BASELINES --protocol "${PROTOCOLS%%,*}" --model "$model" \
        --dtype "$dtype" --seqlens 16384,65536 --batch 1,16 --csv "$OUT_DIR/layouts_${model}_$dtype.csv" \
        2>>"$OUT_DIR/bench.err" | tee -a "$OUT_DIR/layouts.txt"
    done
  done
  merge_parts "$OUT_DIR/layouts.csv" "$OUT_DIR"/layouts_*_*.csv
  add_summary "layouts: $(awk 'FNR > 1' "$OUT_DIR/layouts.csv" | wc -l) rows in layouts.csv"
fi

echo "================ summary"
printf '%s\n' "${summary[@]}"
