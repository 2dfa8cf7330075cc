#!/usr/bin/env bash
# The whole GPU test suite under compute-sanitizer, one tool after another:
#   bash tools/sanitize_suite.sh [OUTDIR] [TOOL...]     (default tools: memcheck racecheck
#                                                        initcheck synccheck)
# Each tool runs every GPU test file (tests/test_gpu_*.py, the CLI's and the examples' GPU tests)
# as SHARDS plain pytest processes side by side, each under a compute-sanitizer of its own and
# each taking one SHARDS-th of the tests (CUPYDECODE_TEST_SHARD, tests/conftest.py). (pytest-xdist's
# workers under one sanitizer did not get through their start-up on the H200.) A tool's line in
# OUTDIR/0_sanitize.txt: the tests passed and failed and the errors, summed over the shards;
# OUTDIR/TOOL_reports.log holds the first reports in full.
# Tests marked heavy (those that hold gigabytes of device memory: the bench runs, check's default
# matrix, info --compile, the speculative and transformers examples) run in one more shard of
# their own, "heavy", one after another beside the others: on an 80 GB H100, memcheck shards that
# ran them side by side (6 or 10 of them) left the sanitizer short of device memory ("Internal
# Sanitizer Error ... Unable to allocate enough memory", those launches untracked) and tests
# failed that pass alone with 0 errors. Under racecheck the heavy shard alone may outlast a
# TIMEOUT: give it runs of its own (ONLY=heavy).
# Env: SHARDS (default 12; the shards besides the heavy one), ONLY (the shards to run, e.g.
# "0 1 heavy": a tool's run split across runs; default all), TIMEOUT (seconds per tool,
# default 540: keep it inside the caller's own time limit, or the summary is never written), FILTER
# (pytest -k), EXCLUDE (a file of node ids, one a line, left out before sharding:
# CUPYDECODE_TEST_EXCLUDE, tests/conftest.py),
# KERNELS (default cd_: only kernels whose names hold it are checked, i.e. cupydecode's own; CuPy's
# kernels that the tests use to make inputs and compare results launch unchecked; KERNELS= checks
# every kernel; initcheck's default is every kernel: it does not see the stores of a kernel it
# does not check, so under cd_ it reports reads of memory that CuPy's kernels wrote, e.g. a
# cache copied into another layout by cupy.ascontiguousarray — seen on the H100),
# FILES (default the whole GPU suite), WARM=1: first the same tests without a sanitizer in
# pytest-xdist workers (OUTDIR/plain_pytest.log), which fills CuPy's kernel cache, so that the
# shards do not each compile the kernels they share (on a fresh H200 that compiling kept 1 to 2
# of 15 shards from finishing memcheck within 280 s).
# Tests marked nccl are left out under the sanitizer (they run in the plain suite): NCCL's own
# start-up probes the device with CUDA calls that fail by design (cudaErrorNoKernelImageForDevice
# in ncclInitKernelsForDevice, cudaFuncGetAttributes), which every tool counts as errors (16 in
# memcheck, none in cupydecode's code; seen on the H200).
# Tests marked torch (the transformers example) are left out under racecheck: racecheck stops
# torch's own cuBLAS GEMM of the prompt (CUBLAS_STATUS_EXECUTION_FAILED; as shipped, "The
# Sanitizer failed to handle a hardware exception") also when the model's attention is torch's
# SDPA throughout and no cupydecode kernel runs (seen on the H100); the other tools run them.
# Every test a tool passed (failed) is listed in OUTDIR/TOOL_passed.txt (TOOL_failed.txt), its
# node id written as it ends (CUPYDECODE_TEST_PASSED, CUPYDECODE_TEST_FAILED, tests/conftest.py),
# also in shards the timeout stopped: a tool too slow for one call (racecheck over the whole
# suite) goes on in the next with EXCLUDE= the lists so far, until no test is left; SPREAD=1
# then gives each shard every SHARDS-th test (CUPYDECODE_TEST_SHARD=i%n) rather than a run, so
# that the slow tests left (the CLI's, whose commands run under the sanitizer too) spread over
# the shards. A shard is stopped when timeout ended it (its exit status, not its log: a child
# process writes a summary of its own). Its reports are in its log as they happen, so those
# after its last summary count as its errors.
set -u
OUT_DIR=${1:-${OUT:-./sanitize_out}}
shift || true
TOOLS=${*:-"memcheck racecheck initcheck synccheck"}
SHARDS=${SHARDS:-12} TIMEOUT=${TIMEOUT:-540}
# SHARDS and TIMEOUT (often computed by the caller, e.g. the seconds left in a call) must be
# positive integers: 0 shards or a negative timeout would run nothing and summarise no logs
for var in SHARDS TIMEOUT; do
  val=${!var}
  case $val in
    *[!0-9]* | 0*) echo "sanitize_suite.sh: $var must be a positive integer, got '$val'" >&2
                   exit 2 ;;
  esac
done
# ONLY: shard numbers below SHARDS, or heavy
for i in ${ONLY:-}; do
  case $i in
    heavy) continue ;;
    *[!0-9]*) ;;
    *) [ "$i" -lt "$SHARDS" ] && continue ;;
  esac
  echo "sanitize_suite.sh: ONLY takes shard numbers below $SHARDS or heavy, got '$i'" >&2
  exit 2
done
mkdir -p "$OUT_DIR"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
PY=${PY:-python3}
SEP=/
[ -n "${SPREAD:-}" ] && SEP=%
FILES=${FILES:-"tests/test_gpu_*.py tests/test_cli_gpu.py tests/test_examples_gpu.py"}
summary="$OUT_DIR/0_sanitize.txt"
if [ "${WARM:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  $PY -m pytest -q -p no:cacheprovider -n "$SHARDS" --tb=line ${FILTER:+-k "$FILTER"} $FILES \
    > "$OUT_DIR/plain_pytest.log" 2>&1
  echo "without a sanitizer: $(tail -n 1 "$OUT_DIR/plain_pytest.log")" | tee -a "$summary"
fi
for tool in $TOOLS; do
  # the kernels checked: KERNELS if set (empty: every kernel), else cd_ (initcheck: every kernel)
  if [ -n "${KERNELS+x}" ]; then kns=$KERNELS; elif [ "$tool" = initcheck ]; then kns=; else kns=cd_; fi
  marks="not nccl"
  [ "$tool" = racecheck ] && marks="not nccl and not torch"
  logs=$(mktemp -d)
  start=$(date +%s)
  # the tests marked heavy in a shard of their own ("heavy", one after another, beside the
  # others), the rest in SHARDS shards
  for i in ${ONLY:-$(seq 0 $((SHARDS - 1))) heavy}; do
    if [ "$i" = heavy ]; then shard=0/1 m="$marks and heavy"
    else shard="$i$SEP$SHARDS" m="$marks and not heavy"; fi
    # each shard's exit status in $logs/$i.rc: timeout's 124 (or 137) marks a stopped shard
    # shellcheck disable=SC2086
    ( CUPYDECODE_TEST_SHARD="$shard" timeout "$TIMEOUT" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
      ${kns:+--kernel-name kns="$kns"} \
      env ${EXCLUDE:+CUPYDECODE_TEST_EXCLUDE="$EXCLUDE"} CUPYDECODE_TEST_PASSED="$logs/$i.passed" \
      CUPYDECODE_TEST_FAILED="$logs/$i.failed" \
      $PY -m pytest -v -p no:cacheprovider -p no:xdist --tb=line -m "$m" \
      ${FILTER:+-k "$FILTER"} $FILES > "$logs/$i.log" 2>&1
      echo $? > "$logs/$i.rc" ) &
  done
  wait
  took=$(( $(date +%s) - start ))
  # the tests passed and failed, from the lists the tests write as they end (also in the
  # stopped shards); a test failed in two phases counts once
  for outcome in passed failed; do
    touch "$logs/x.$outcome"
    sort -u "$logs"/*."$outcome" > "$logs/$outcome.all"
    cat "$logs/$outcome.all" >> "$OUT_DIR/${tool}_$outcome.txt"
  done
  passed=$(wc -l < "$logs/passed.all")
  failed=$(wc -l < "$logs/failed.all")
  # the errors of a shard (the sanitizer's lines may follow pytest -v's line of the test on
  # the same line): its processes' summaries ("ERROR SUMMARY: N errors"; racecheck:
  # "RACECHECK SUMMARY: N hazards displayed (…)"; a child process, e.g. the CLI a test runs,
  # prints one of its own) summed, plus the reports after the last summary (a stopped shard's,
  # whose main process wrote none). Not reports: "process didn't terminate successfully" and
  # "Target application returned an error" (a process's non-zero exit, which some CLI tests
  # expect). Internal errors of the sanitizer itself are counted apart.
  tag="ERROR SUMMARY"
  [ "$tool" = racecheck ] && tag="RACECHECK SUMMARY"
  errors=0 internal=0 finished=0 ran=0
  for f in "$logs"/*.log; do
    ran=$((ran + 1))
    rc=$(cat "${f%.log}.rc" 2>/dev/null || echo 124)
    [ "$rc" != 124 ] && [ "$rc" != 137 ] && finished=$((finished + 1))
    errors=$((errors + $(awk -v tag="========= $tag: " '
      { i = index($0, tag) }
      i > 0 { split(substr($0, i + length(tag)), w, " "); sum += w[1]; tail = 0; next }
      /========= +(Error|Warning|Race|Invalid|Uninitialized|Barrier|Program hit)/ &&
        !/process didn.t terminate successfully/ { tail++ }
      END { print sum + tail }' "$f")))
    internal=$((internal + $(grep -c "Internal Sanitizer Error" "$f")))
  done
  # the reports themselves: the sanitizer's lines (from "========= " on: pytest -v's line of
  # the test may come first), its banner, summaries and empty lines left out
  grep -h -o -E "========= .*" "$logs"/*.log | grep -vE "SUMMARY|COMPUTE-SANITIZER|^=+ *$" \
    | head -n 300 > "$OUT_DIR/${tool}_reports.log"
  grep -h -E "FAILED|Error|^E " "$logs"/*.log | head -n 100 > "$OUT_DIR/${tool}_failures.log"
  kdesc=", every kernel checked"
  [ -n "$kns" ] && kdesc=", kernels *$kns* checked"
  line="$tool: ${took}s, $passed passed, $failed failed, $errors errors"
  [ "$internal" -gt 0 ] && line="$line, $internal internal sanitizer errors"
  line="$line; $finished of $ran shards finished (${ONLY:+shards run: $ONLY; of }$SHARDS + heavy${SPREAD:+, spread})$kdesc${EXCLUDE:+, $(wc -l < "$EXCLUDE") tests excluded}"
  echo "$line" | tee -a "$summary"
  rm -rf "$logs"
done
