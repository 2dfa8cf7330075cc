#!/usr/bin/env bash
# Nsight Compute metrics of cupydecode and cuDNN SDPA on a few llama-3-8b shapes (dev tool).
# Usage: OUT=dir bash scripts/ncu_compare.sh
export PYTHONPATH=$(pwd)
which ncu nvdisasm cuobjdump; ncu --version | tail -1
K='regex:cd_|cudnn|sm90|fmha|flash|attn|sdpa'
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__shared_mem_per_block_static,launch__cluster_dim_x,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_active.avg,lts__t_bytes.sum"
for shape in "llama-3-8b 16 65536" "llama-3-8b 1 16384" "llama-3-8b 4 8192"; do
  f=$OUT/ncu_$(echo $shape | tr ' ' _).csv
  timeout 150 ncu --clock-control none -k "$K" --metrics $M --csv python3 scripts/ncu_peers.py $shape > $f 2> $OUT/ncu_err.txt
  echo "== $shape rc=$?"; tail -2 $OUT/ncu_err.txt; grep -c '"' $f
done
timeout 200 ncu --clock-control none --set full -k "$K" --launch-count 4 -o /tmp/full python3 scripts/ncu_peers.py llama-3-8b 16 65536 > /dev/null 2>>$OUT/ncu_err.txt
echo "full rc=$?"
ncu --import /tmp/full.ncu-rep --page details --csv > $OUT/full_details.csv 2>>$OUT/ncu_err.txt
ncu --import /tmp/full.ncu-rep --page raw --csv > $OUT/full_raw.csv 2>>$OUT/ncu_err.txt
cd $OUT && tar czf all.tgz *.csv *.txt && rm -f *.csv && ls -la
