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
# Env: SHARDS (default 12), ONLY (the shards to run, e.g. "0 1 2": a tool's run split across
# calls; default all), TIMEOUT (seconds per tool, default 540: keep it inside the call's own
# limit, or the summary is never written), FILTER (pytest -k), EXCLUDE (a file of node ids, one
# a line, left out before sharding: CUPYDECODE_TEST_EXCLUDE, tests/conftest.py),
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
# Every test a tool passed is listed in OUTDIR/TOOL_passed.txt (its node id, written as it passes:
# CUPYDECODE_TEST_PASSED, tests/conftest.py), also from shards the timeout stopped: a tool too
# slow for one call (racecheck over the whole suite) goes on in the next with EXCLUDE= the lists
# so far, until no test is left. The reports of a stopped shard
# are in its log as they happen, so its errors count (lines "========= Error"/"Warning"/"Race")
# for the tests it passed.
set -u
OUT_DIR=${1:-${OUT:-./sanitize_out}}
shift || true
TOOLS=${*:-"memcheck racecheck initcheck synccheck"}
mkdir -p "$OUT_DIR"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
PY=${PY:-python3}
SHARDS=${SHARDS:-12}
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
  logs=$(mktemp -d)
  start=$(date +%s)
  for i in ${ONLY:-$(seq 0 $((SHARDS - 1)))}; do
    # shellcheck disable=SC2086
    CUPYDECODE_TEST_SHARD="$i/$SHARDS" timeout "${TIMEOUT:-540}" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
      ${kns:+--kernel-name kns="$kns"} \
      env ${EXCLUDE:+CUPYDECODE_TEST_EXCLUDE="$EXCLUDE"} CUPYDECODE_TEST_PASSED="$logs/$i.passed" \
      $PY -m pytest -v -p no:cacheprovider -p no:xdist --tb=line -m "not nccl" \
      ${FILTER:+-k "$FILTER"} $FILES > "$logs/$i.log" 2>&1 &
  done
  wait
  took=$(( $(date +%s) - start ))
  # the shards' pytest counts of WORD ("passed", "failed"), summed
  count() { grep -hoE "[0-9]+ $1" "$logs"/*.log | awk '{s += $1} END {print s + 0}'; }
  passed=$(count passed)
  failed=$(count failed)
  # one summary a shard: "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY: N hazards
  # displayed (…)"), N summed
  tag="ERROR SUMMARY"
  [ "$tool" = racecheck ] && tag="RACECHECK SUMMARY"
  errors=$(grep -hoE "$tag: [0-9]+" "$logs"/*.log | awk '{s += $NF} END {print s + 0}')
  finished=$(grep -l "$tag" "$logs"/*.log | wc -l)
  # the stopped shards (no summary): their tests passed so far and the reports in their logs
  stopped_passed=0 stopped_errors=0
  for f in $(grep -L "$tag" "$logs"/*.log); do
    stopped_passed=$((stopped_passed + $(cat "${f%.log}.passed" 2>/dev/null | wc -l)))
    stopped_errors=$((stopped_errors + $(grep -cE "^========= +(Error|Warning|Race)" "$f")))
  done
  cat "$logs"/*.passed >> "$OUT_DIR/${tool}_passed.txt" 2>/dev/null
  # the reports themselves: the sanitizer's lines ("========= " first), its banner, summaries
  # and empty lines left out
  grep -h -E "^========= " "$logs"/*.log | grep -vE "SUMMARY|COMPUTE-SANITIZER|^=+ *$" \
    | head -n 300 > "$OUT_DIR/${tool}_reports.log"
  grep -h -E "FAILED|Error|^E " "$logs"/*.log | head -n 100 > "$OUT_DIR/${tool}_failures.log"
  ran=$(ls "$logs"/*.log | wc -l)
  kdesc=", every kernel checked"
  [ -n "$kns" ] && kdesc=", kernels *$kns* checked"
  line="$tool: ${took}s, $passed passed, $failed failed, $errors errors; $finished of $ran shards finished (${ONLY:+shards $ONLY of }$SHARDS)$kdesc${EXCLUDE:+, $(wc -l < "$EXCLUDE") tests excluded}"
  [ "$finished" -lt "$ran" ] && line="$line; the $((ran - finished)) stopped: $stopped_passed passed, $stopped_errors reports"
  echo "$line" | tee -a "$summary"
  rm -rf "$logs"
done
