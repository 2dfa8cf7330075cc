export PYTHONPATH=.
prof() {  # name, args...
  local name=$1; shift
  timeout 150 ncu --clock-control none --set full -k regex:cd_decode_split --launch-skip 1 --launch-count 1 \
    -o /tmp/$name python3 tools/profile_shape.py "$@" > /tmp/$name.log 2>&1
  tail -n 2 /tmp/$name.log
  ncu --import /tmp/$name.ncu-rep --page details > $OUT/$name.txt 2>&1
  ncu --import /tmp/$name.ncu-rep --page raw > $OUT/${name}_raw.txt 2>&1
  grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|Block Size|Grid Size|Dynamic Shared)" $OUT/$name.txt
  grep -E "pipe_tensor.*pct_of_peak_sustained_active|l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum |smsp__average_warps_issue_stalled_(barrier|long_scoreboard|short_scoreboard|math_pipe_throttle|mio_throttle|wait|not_selected|selected|lg_throttle|dispatch_stall|no_instruction|membar|sleeping|tex_throttle|drain|imc_miss|branch_resolving|misc)_per_issue_active" $OUT/${name}_raw.txt | awk '{print $1, $NF}'
}
for spec in "q8_64:--layout 64/8/128 --q-len 8" "q1_64:--layout 64/8/128 --q-len 1" "q8_32:--layout 32/8/128 --q-len 8"; do
  name=${spec%%:*}; echo "=== $name"; prof $name 16 16384 ${spec#*:} --calls 3
done
