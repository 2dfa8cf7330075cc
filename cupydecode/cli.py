"""The ``cupydecode`` command line: check, bench, explain, info, models.

Thin on purpose: options are parsed and validated here, the work is done by
``cupydecode.check`` (correctness), ``cupydecode.bench`` (timings), ``cupydecode.explain``
(the algorithm on a tiny example) and ``cupydecode.workloads`` (shapes and data). The library
never imports this module, and this module imports CuPy only inside commands that need a GPU.

Exit codes: 0 success, 1 a check failed, 2 bad usage or no usable GPU.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import sys
import time

import click

from . import __version__, _validate
from ._policy import (HEAD_DIMS_TEXT, KERNEL_HEAD_DIMS, KV_DTYPES, MAX_BATCH, MAX_Q_LEN,
                      MAX_SPLITS, SUPPORTED_HEAD_DIMS)
from ._validate import MAX_SOFT_CAP
from .workloads import (DTYPES, KV_SCALES, MODELS, Workload, fresh_seed, random_lengths,
                        workload_for_model)

EXIT_FAILED = 1
EXIT_USAGE = 2
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                 "float": "float32"}


# ---------------------------------------------------------------------------- GPU detection

def detect_gpu() -> tuple[bool, str]:
    """(usable, description). Never raises: a missing CuPy or driver is a 'no', said plainly
    with its fix (_kernels.gpu_problem)."""
    from ._kernels import gpu_problem

    why = gpu_problem()
    if why:
        return False, why
    import cupy

    return True, f"{cupy.cuda.runtime.getDeviceCount()} CUDA device(s)"


def require_gpu(ctx: click.Context, hint: str = "This command runs CUDA kernels; `cupydecode "
                "explain`, `models` and `info` work without one.") -> None:
    ok, why = detect_gpu()
    if ok:
        from .decode import device_shortfall

        why = device_shortfall()  # (a GPU with too little shared memory per block)
        ok = why is None
    if not ok:
        click.echo(f"error: no usable GPU: {why}. {hint}", err=True)
        ctx.exit(EXIT_USAGE)


# ---------------------------------------------------------------------------- option types

class SplitsType(click.ParamType):
    """'auto' or an integer split count in [1, MAX_SPLITS]; 'auto' converts to the string."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            n = int(text)
        except ValueError:
            self.fail(f"expected 'auto' or an integer >= 1, got {value!r}", param, ctx)
        if not 1 <= n <= MAX_SPLITS:
            self.fail(f"expected 'auto' or an integer in [1, {MAX_SPLITS}], got {n}", param, ctx)
        return n


class IntListType(click.ParamType):
    """Comma-separated integers, each >= ``minimum`` (and <= ``maximum`` where given); a k
    suffix multiplies by 1024 (64k); with ``none`` set, that word stands for None (e.g. the
    contiguous cache among page sizes)."""

    name = "N,N,..."

    def __init__(self, minimum: int = 1, none: str | None = None, maximum: int | None = None):
        self.minimum, self.maximum, self.none = minimum, maximum, none
        if none:
            self.name = f"{none}|N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        out = []
        for part in str(value).split(","):
            text = part.strip().lower()
            if self.none and text == self.none:
                out.append(None)
                continue
            mult = 1024 if text.endswith("k") else 1
            try:
                n = int(text[:-1] if mult > 1 else text) * mult
            except ValueError:
                words = f" or '{self.none}'" if self.none else ""
                self.fail(f"expected comma-separated integers{words} (e.g. 1024,4096,64k), got "
                          f"{value!r}", param, ctx)
            if n < self.minimum:
                self.fail(f"expected integers >= {self.minimum}, got {n}", param, ctx)
            if self.maximum is not None and n > self.maximum:
                self.fail(f"expected integers <= {self.maximum}, got {n}", param, ctx)
            out.append(n)
        if not out:
            self.fail("expected at least one integer", param, ctx)
        return list(dict.fromkeys(out)) if self.none else out


def _output_path(ctx, param, value):
    """An output file the run can write: checked before any GPU work, not after the run."""
    if value is None:
        return None
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"folder {folder!r} does not exist", ctx, param)
    if not os.access(folder, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
        raise click.BadParameter(f"{value!r} is not writable", ctx, param)
    return value


def _dtype_callback(ctx, param, value):
    if value is None:
        return None
    return DTYPE_ALIASES.get(value.lower(), value.lower())


DTYPE_CHOICE = click.Choice([*DTYPES, *DTYPE_ALIASES], case_sensitive=False)
MODEL_CHOICE = click.Choice(list(MODELS), case_sensitive=False)
KV_DTYPE_CHOICE = click.Choice(list(KV_DTYPES), case_sensitive=False)
KV_SCALE_CHOICE = click.Choice(list(KV_SCALES), case_sensitive=False)
# check's and bench's --kv-scale (each command's --kv-dtype says what the fp8 cache does there)
KV_SCALE_OPTION = click.option(
    "--kv-scale", "kv_scale", type=KV_SCALE_CHOICE,
    help="With --kv-dtype: the scales per tensor (default), per KV head or per token and KV "
         "head.")


class HeadDimType(click.ParamType):
    """A head_dim the kernels take (_policy.SUPPORTED_HEAD_DIMS)."""

    name = "D"

    def convert(self, value, param, ctx):
        try:
            d = int(value)
        except (TypeError, ValueError):
            self.fail(f"expected {HEAD_DIMS_TEXT}, got {value!r}", param, ctx)
        if d not in SUPPORTED_HEAD_DIMS:
            self.fail(f"expected {HEAD_DIMS_TEXT}, got {d}", param, ctx)
        return d


HEAD_DIM_TYPE = HeadDimType()


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan (which passes every comparison of a range)."""

    def convert(self, value, param, ctx):
        x = super().convert(value, param, ctx)
        if not math.isfinite(x):
            self.fail(f"expected a finite number, got {value!r}", param, ctx)
        return x


# logits_soft_cap from the command line: 0 (none) to the library's most (_validate.MAX_SOFT_CAP)
SOFT_CAP_TYPE = FiniteFloatRange(min=0.0, max=MAX_SOFT_CAP)


# ---------------------------------------------------------------------------- output helpers

def _fmt(x, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Text table; columns are (header, key, format spec). Text left, numbers right."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([_fmt(r.get(k), spec) for _, k, spec in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    left = [spec == "s" for _, _, spec in columns]
    return ["  ".join(c[i].ljust(widths[i]) if left[i] else c[i].rjust(widths[i])
                      for i in range(len(columns))).rstrip() for c in cells]


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf" / "nan": strict JSON has no such numbers
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(_jsonable(payload), f, indent=2)
        f.write("\n")


def write_csv(path: str, rows: list[dict]) -> None:
    fields = list(rows[0]) if rows else []
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in r.items()})


def write_outputs(rows: list[dict], payload: dict, csv_path: str | None = None,
                  json_path: str | None = None) -> None:
    """The command's rows to ``csv_path`` and ``payload`` to ``json_path`` (each where given),
    each file said as written."""
    if csv_path:
        write_csv(csv_path, rows)
        click.echo(f"wrote {csv_path}")
    if json_path:
        write_json(json_path, payload)
        click.echo(f"wrote {json_path}")


def _device_header() -> tuple[dict, list[str]]:
    from .bench import device_info

    d = device_info()
    return d, [f"GPU {d['device_id']}: {d['name']} (sm_{d['compute_capability'].replace('.', '')}, "
               f"{d['sm_count']} SMs, L2 {d['l2_bytes'] / 2**20:.0f} MiB, "
               f"{d['total_mem'] / 2**30:.0f} GiB)",
               f"cupydecode {__version__}, CuPy {d['cupy']}, CUDA runtime {d['cuda_runtime']}, "
               f"driver {d['cuda_driver']}"]


# ---------------------------------------------------------------------------- main group

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupydecode")
def main():
    """FlashDecoding (split-KV decode attention) for CuPy: check, measure, explain.

    \b
    Examples:
      cupydecode check                        # built-in correctness matrix vs float64
      cupydecode bench --model llama-3-8b     # timings vs the HBM read floor
      cupydecode explain                      # the split/merge math on 12 tokens (no GPU)
    """


# ---------------------------------------------------------------------------- check

def _single_workload(batch, seqlen, heads, kv_heads, head_dim, dtype, splits, seed, varlen,
                     lengths, q_scale, model, soft_cap=None, page_size=None,
                     append=False, window=None, alibi=False, sinks=False,
                     layer: str | None = None, q_len: int = 1, kv_dtype: str | None = None,
                     kv_scale: str = "tensor") -> Workload:
    """One workload from ``check``'s options (raises click.BadParameter on bad combinations).
    ``soft_cap`` None: the model's (none without --model); 0: none. With --model, the options
    of its ``layer`` type (ModelPreset.layers) where the command line sets none: its window,
    ALiBi, sinks (``layer`` None: its first). ``append`` without lengths: every sequence holds seqlen − 1 tokens, so that
    the new one fills it."""
    preset = MODELS[(model or "llama-3-8b").lower()]
    if model:
        layers = preset.layers()
        layer = next(iter(layers)) if layer is None else layer
        own = layers[layer]
        window = own.get("window_left") if window is None else window
        alibi, sinks = alibi or own["alibi"], sinks or own["sinks"]
    if soft_cap is None:
        soft_cap = preset.logits_soft_cap if model else None
    if heads is None:
        heads = preset.num_heads
        kv_heads = preset.num_kv_heads if kv_heads is None else kv_heads
    elif kv_heads is None:
        kv_heads = preset.num_kv_heads if model else heads
    head_dim = preset.head_dim if head_dim is None else int(head_dim)
    if heads % kv_heads:
        raise click.BadParameter(f"expected a divisor of --heads {heads}, got {kv_heads}",
                                 param_hint="'--kv-heads'")
    if lengths is not None:
        if batch is not None and batch != len(lengths):
            raise click.BadParameter(f"expected {batch} lengths (one per sequence of --batch), "
                                     f"got {len(lengths)}", param_hint="'--lengths'")
        batch = len(lengths)
        seqlen = max(lengths) if seqlen is None else seqlen
        if max(lengths) > seqlen:
            raise click.BadParameter(f"expected lengths <= --seqlen {seqlen}, got {max(lengths)}",
                                     param_hint="'--lengths'")
    batch = 2 if batch is None else batch
    seqlen = 4096 if seqlen is None else seqlen
    seed = fresh_seed() if seed is None else seed
    if varlen and lengths is None:
        lengths = random_lengths(batch, seqlen, seed)
    name = (f"{model} {layer}".strip() if model else "custom") + (
        " varlen" if lengths is not None else "")
    if append and lengths is None:
        lengths = (seqlen - 1,) * batch
    return Workload(batch, seqlen, heads, kv_heads, head_dim, dtype or "float16",
                    None if splits in (None, "auto") else splits, lengths, q_scale, seed, name,
                    logits_soft_cap=soft_cap or None, page_size=page_size, append=append,
                    window_left=window, alibi=alibi, sinks=sinks, layer=layer if model else "",
                    q_len=q_len, kv_dtype=kv_dtype, kv_scale=kv_scale)


def _check_kv_dtype(kv_dtype, kv_scale, dtype) -> tuple[str | None, str]:
    """(kv_dtype, kv_scale) lower-cased, kv_scale "tensor" by default; an fp8 cache takes
    float16 or bfloat16 q (--dtype), and --kv-scale needs --kv-dtype."""
    if kv_dtype is None and kv_scale is not None:
        raise click.BadParameter(f"expected --kv-dtype e4m3 or e5m2 with --kv-scale, got "
                                 f"--kv-scale {kv_scale} alone", param_hint="'--kv-scale'")
    if kv_dtype is not None and dtype == "float32":
        raise click.BadParameter("expected --dtype float16 or bfloat16 with --kv-dtype (q and "
                                 "out of an fp8 cache), got float32", param_hint="'--dtype'")
    return kv_dtype and kv_dtype.lower(), (kv_scale or "tensor").lower()


def _check_head_dim(head_dim: int, dtype: str, kv_dtype: str | None) -> None:
    """The library's own checks of head_dim × dtype (× an fp8 cache), as usage errors naming
    --head-dim or --dtype, before a GPU is looked for (the library would refuse the call)."""
    try:
        _validate.check_head_dim(head_dim, dtype, "--head-dim")
        if kv_dtype is not None:
            _validate.check_fp8_query(dtype, head_dim, kv_dtype, "--dtype", "--head-dim")
    except (TypeError, ValueError) as e:
        raise click.UsageError(str(e)) from None


def _workload_label(w: Workload) -> str:
    label = f"{w.name}: {w.shape_label()}"
    if w.lengths is not None:
        label += " lens=" + ",".join(str(n) for n in w.lengths)
    return label


def _check_line(row: dict, label: str, width: int) -> str:
    req = row["splits_requested"]
    splits = f"{req}→{_fmt(row['splits'], 'd')}" if req == "auto" else str(req)
    result = "PASS" if row["passed"] else "FAIL"
    return (f"{label:<{width}s}  {row['dtype']:<8s}  {splits:>8s}  "
            f"{_fmt(row['max_abs_err'], '.2e'):>11s}  {_fmt(row['rel_err'], '.2e'):>9s}  "
            f"{_fmt(row['lse_err'], '.2e'):>9s}  {result}")


def _check_header(width: int) -> str:
    return (f"{'workload':<{width}s}  {'dtype':<8s}  {'splits':>8s}  {'max abs err':>11s}  "
            f"{'rel err':>9s}  {'LSE err':>9s}  result")


@main.command()
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), help="Sequences (default 2).")
@click.option("--seqlen", type=click.IntRange(min=1), help="max_seqlen of the cache (default 4096).")
@click.option("--heads", type=click.IntRange(min=1), help="Query heads (default: the model's).")
@click.option("--kv-heads", type=click.IntRange(min=1), help="KV heads; must divide --heads.")
@click.option("--head-dim", type=HEAD_DIM_TYPE,
              help=f"{HEAD_DIMS_TEXT[0].upper()}{HEAD_DIMS_TEXT[1:]} (default: the model's).")
@click.option("--dtype", type=DTYPE_CHOICE, callback=_dtype_callback,
              help="float16 (default), bfloat16 or float32.")
@click.option("--splits", type=SplitsType(), help="'auto' (default) or a forced split count.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), help="Replay a run's random data.")
@click.option("--varlen", is_flag=True, help="Random per-sequence lengths (one full, one empty).")
@click.option("--lengths", type=IntListType(minimum=0), help="Explicit per-sequence lengths.")
@click.option("--q-scale", type=float, default=1.0, show_default=True,
              help="Multiply q (and so every logit), e.g. 2400 for logits of about ±1e4.")
@click.option("--soft-cap", "soft_cap", type=SOFT_CAP_TYPE,
              help="logits_soft_cap c: scores capped to c·tanh(s/c) (default: the model's, e.g. "
                   "50 for gemma-2; 0: none).")
@click.option("--page-size", "page_size", type=click.IntRange(min=1),
              help="Run on a paged copy of the cache: pages of this many tokens, random order.")
@click.option("--append", is_flag=True,
              help="Append a new token per sequence in the call (k_new, v_new) at its length "
                   "(default lengths: seqlen − 1); the cache after it is checked bit for bit.")
@click.option("--window", "window", type=click.IntRange(min=0),
              help="window_left W: attend only the last W + 1 tokens of each sequence.")
@click.option("--alibi", is_flag=True, help="ALiBi's bias with the standard slopes of the heads.")
@click.option("--sinks", is_flag=True, help="A sink logit per query head (gpt-oss), from the seed.")
@click.option("--q-len", type=click.IntRange(1, MAX_Q_LEN), default=1, show_default=True,
              help="Query tokens per sequence (draft tokens verified together, causal).")
@click.option("--kv-dtype", "kv_dtype", type=KV_DTYPE_CHOICE,
              help="An fp8 cache (e4m3 or e5m2) of rows of differing magnitude; q and out stay "
                   "--dtype (float16 or bfloat16).")
@KV_SCALE_OPTION
@click.option("--model", type=MODEL_CHOICE,
              help="Take heads/kv-heads/head-dim (and the soft-cap) from a preset.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=_output_path,
              help="Write the result rows to this JSON file.")
@click.pass_context
def check(ctx, batch, seqlen, heads, kv_heads, head_dim, dtype, splits, seed, varlen, lengths,
          q_scale, soft_cap, page_size, append, window, alibi, sinks, q_len, kv_dtype, kv_scale,
          model, json_path):
    """Compare flash_decode with a float64 reference; one row per workload.

    Without shape options, runs the built-in matrix (fp16/bf16/fp32, head_dim 32 to 256 and
    512, MHA to MQA, lengths 1 to 65536, variable lengths with an empty sequence, forced and
    automatic splits, logits of ±1e4, the soft-cap, paged caches, appended tokens, sliding
    windows, ALiBi, attention sinks, fp8 caches with each kind of scale). Outputs are
    filled with NaN before each call.
    Tolerances: relative L2 error 2e-3 (fp16), 1e-2 (bf16), 1e-4 (fp32); LSE 1e-3.
    Exit status 0 if all pass, 1 if any fails, 2 on bad usage or without a GPU.

    \b
    Examples:
      cupydecode check
      cupydecode check --model llama-3-8b --seqlen 300 --batch 2 --varlen
      cupydecode check --heads 28 --kv-heads 4 --seqlen 4097 --dtype bf16 --splits 3
      cupydecode check --model gemma-2-9b --q-scale 60        (its soft-cap 50, logits past it)
      cupydecode check --model llama-3-8b --seqlen 5000 --page-size 16 --varlen
      cupydecode check --append --page-size 16 --varlen
      cupydecode check --seqlen 20000 --window 4095 --varlen       (Mistral's sliding window)
      cupydecode check --kv-dtype e4m3 --kv-scale token --append --page-size 16 --varlen
      cupydecode check --json check.json
    """
    from .workloads import default_check_matrix

    single = any(x is not None for x in (batch, seqlen, heads, kv_heads, head_dim, dtype, splits,
                                         lengths, model, soft_cap, page_size, window)) or varlen or q_scale != 1.0
    single = single or append or alibi or sinks or q_len > 1 or kv_dtype is not None
    if append and q_len > 1:
        raise click.BadParameter("expected --q-len 1 with --append (the command appends one "
                                 "token per sequence)", param_hint="'--q-len'")
    kv_dtype, kv_scale = _check_kv_dtype(kv_dtype, kv_scale, dtype)
    if single:
        # a model's every layer type (Gemma-2's sliding and full layers); --window sets one
        layers = list(MODELS[model.lower()].layers()) if model else [None]
        layers = layers if window is None else layers[:1]
        workloads = [_single_workload(batch, seqlen, heads, kv_heads, head_dim, dtype, splits,
                                      seed, varlen, lengths, q_scale, model, soft_cap, page_size,
                                      append, window, alibi, sinks, layer, q_len, kv_dtype,
                                      kv_scale)
                     for layer in layers]
        for w in workloads:
            _check_head_dim(w.head_dim, w.dtype, w.kv_dtype)
    else:
        workloads = default_check_matrix()
        base = fresh_seed() if seed is None else seed
        for i, w in enumerate(workloads):
            w.seed = (base + i) % 2**32
    require_gpu(ctx)
    from .check import repro_command, run_check

    device, header = _device_header()
    for line in header:
        click.echo(line)
    click.echo(f"{len(workloads)} workload(s); reference: float64 (NumPy, or on the GPU for "
               f"large caches); outputs poisoned with NaN before each call\n")
    labels = [_workload_label(w) for w in workloads]
    width = max(len(x) for x in labels)
    click.echo(_check_header(width))
    t0 = time.perf_counter()
    rows = []
    for w, label in zip(workloads, labels):
        row = run_check(w)
        rows.append(row)
        click.echo(_check_line(row, label, width))
        if not row["passed"]:
            if row["error"]:
                click.echo(f"    error: {row['error']}")
            click.echo(f"    replay: {repro_command(row)}")
    failed = sum(not r["passed"] for r in rows)
    click.echo(f"\n{len(rows) - failed}/{len(rows)} passed in {time.perf_counter() - t0:.1f} s")
    write_outputs(rows, {"device": device, "rows": rows}, json_path=json_path)
    ctx.exit(EXIT_FAILED if failed else 0)


# ---------------------------------------------------------------------------- bench

def _bench_columns(peer_cols: dict, processes: bool = False, append: bool = False,
                   paged: bool = False, layers: bool = False) -> list[tuple[str, str, str]]:
    """Table columns (label, row key, format); ``peer_cols`` maps peer columns to labels;
    ``append``: the same call without the append, and the difference; ``paged``: the page
    size ("-": contiguous); ``layers``: the model's layer type."""
    cols = [("layer", "layer", "s")] if layers else []
    cols += [("batch", "batch", "d"), ("seqlen", "seqlen", "d")]
    if paged:
        cols.append(("page", "page_label", "s"))
    cols += [("KV MB", "kv_mb", ".1f"), ("splits", "num_splits", "d"),
             ("protocol", "protocol_label", "s")]
    if processes:
        cols.append(("proc", "process", "d"))
    cols += [("floor µs", "floor_us", ".1f"), ("GPU µs", "gpu_us", ".1f"),
             ("p20–p80", "spread", "s"), ("GB/s", "gbps", ".0f"),
             ("% floor", "pct_of_floor", ".0f")]
    if append:
        cols += [("no-append µs", "no_append_us", ".1f"), ("+append µs", "append_cost_us", ".2f")]
    cols += [("eager µs", "eager_us", ".1f"), ("host µs", "host_us", ".1f"),
             ("run µs", "plan_host_us", ".1f"), ("launch µs", "launch_host_us", ".1f"),
             ("×split1", "speedup_vs_split1", ".2f"), ("naive µs", "naive_us", ".1f"),
             ("×naive", "speedup_vs_naive", ".1f")]
    cols += [(label, c, ".1f") for c, label in peer_cols.items()]
    if peer_cols:
        cols.append(("×best peer", "speedup_vs_best_peer", ".3f"))
    cols.append(("check", "check", "s"))
    return cols


def _bench_display(row: dict) -> dict:
    spread = (f"{row['gpu_us_p20']:.1f}–{row['gpu_us_p80']:.1f}"
              if row.get("gpu_us_p20") is not None else None)
    name = str(row["protocol"]).partition(":")[0]
    label = f"{name}×{row['graph_calls']}" if row.get("graph_calls") else name
    page = row.get("page_size")
    return dict(row, kv_mb=row.get("kv_bytes", 0) / 1e6, spread=spread, protocol_label=label,
                page_label="-" if page is None else str(page))


def stability(rows: list[dict]) -> list[dict]:
    """Per point (batch, seqlen, page size), over every protocol and process that timed it: the
    best and the worst GPU µs, the spread (worst / best − 1, %), and the lowest speed-up over
    the best peer of the same row (None without peers)."""
    points: dict = {}
    for r in rows:
        if r["gpu_us"]:
            key = (r.get("layer", ""), r["batch"], r["seqlen"], r.get("page_size"))
            points.setdefault(key, []).append(r)
    out = []
    for (layer, batch, seqlen, page), rs in points.items():
        us = [r["gpu_us"] for r in rs]
        ratios = [r["speedup_vs_best_peer"] for r in rs if r.get("speedup_vs_best_peer")]
        worst = max(rs, key=lambda r: r["gpu_us"])
        out.append({"layer": layer, "batch": batch, "seqlen": seqlen, "page_size": page,
                    "page_label": "-" if page is None else str(page), "runs": len(rs),
                    "best_us": min(us),
                    "worst_us": max(us), "spread_pct": 100.0 * (max(us) / min(us) - 1),
                    "worst_in": _bench_display(worst)["protocol_label"]
                    + (f" (process {worst['process']})" if "process" in worst else ""),
                    "min_speedup_vs_best_peer": min(ratios) if ratios else None})
    return out


STABILITY_COLUMNS = [("batch", "batch", "d"), ("seqlen", "seqlen", "d"), ("runs", "runs", "d"),
                     ("best µs", "best_us", ".1f"), ("worst µs", "worst_us", ".1f"),
                     ("spread %", "spread_pct", ".1f"), ("slowest in", "worst_in", "s"),
                     ("min ×best peer", "min_speedup_vs_best_peer", ".3f")]


def _check_plot_available(ctx) -> None:
    try:
        import matplotlib  # noqa: F401
    except Exception as exc:
        click.echo(f"error: --plot needs matplotlib ({type(exc).__name__}: {exc}); "
                   "install the plot extra (`pip install \".[plot]\"` in the checkout) or "
                   "`pip install matplotlib`", err=True)
        ctx.exit(EXIT_USAGE)


def _protocol_callback(ctx, param, value):
    from .bench import DEFAULT_PROTOCOL, parse_protocol

    items = [p.strip() for v in (value or (DEFAULT_PROTOCOL,)) for p in str(v).split(",")]
    for item in items:
        try:
            parse_protocol(item)
        except ValueError as exc:
            raise click.BadParameter(str(exc).split(": ", 1)[1], ctx, param) from None
    return list(dict.fromkeys(items))


def _bench_in_processes(n: int, argv: list[str]) -> list[dict]:
    """Run this bench command again in ``n`` fresh processes (one at a time, each with its own
    allocations and start state) and return all their rows, each tagged with ``process``."""
    import subprocess
    import tempfile

    rows = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "cupydecode.cli", "bench", *argv, "--processes", "1",
                   "--json", path]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode not in (0, EXIT_FAILED) or not os.path.exists(path):
                raise click.ClickException(f"bench process {i + 1} of {n} failed (exit "
                                           f"{done.returncode}):\n{done.stdout[-2000:]}")
            with open(path) as f:
                payload = json.load(f)
        for r in payload["rows"]:
            rows.append(dict(r, process=i + 1))
    return rows


def _forwarded_bench_args(model, dtype, seqlens, batches, splits, protocols, baselines,
                          soft_cap=None, page_sizes=(None,), append=False,
                          window=None, alibi=False, sinks=False, head_dim=None,
                          q_len=1, kv_dtype=None, kv_scale="tensor") -> list[str]:
    """The options of this bench run, for the processes of --processes (outputs stay here)."""
    argv = ["--model", model, "--dtype", dtype, "--seqlens", ",".join(map(str, seqlens)),
            "--batch", ",".join(map(str, batches)), "--splits", str(splits),
            "--protocol", ",".join(protocols)]
    if head_dim is not None:
        argv += ["--head-dim", str(head_dim)]
    if q_len > 1:
        argv += ["--q-len", str(q_len)]
    if soft_cap is not None:
        argv += ["--soft-cap", repr(float(soft_cap))]
    if list(page_sizes) != [None]:
        argv += ["--page-size", ",".join("none" if p is None else str(p) for p in page_sizes)]
    if append:
        argv.append("--append")
    if window is not None:
        argv += ["--window", str(window)]
    if alibi:
        argv.append("--alibi")
    if sinks:
        argv.append("--sinks")
    if kv_dtype is not None:
        argv += ["--kv-dtype", kv_dtype, "--kv-scale", kv_scale]
    for name in baselines:
        argv += ["--baseline", name]
    return argv


@main.command()
@click.option("--model", type=MODEL_CHOICE, default="llama-3-8b", show_default=True,
              help="Head shape preset (see `cupydecode models`).")
@click.option("--head-dim", type=HEAD_DIM_TYPE,
              help="The model's heads with this head_dim instead of its own (peers that do not "
                   "take it leave their columns empty).")
@click.option("--dtype", type=DTYPE_CHOICE, default="float16", show_default=True,
              callback=_dtype_callback, help="float16, bfloat16 or float32.")
@click.option("--seqlens", type=IntListType(), default="1024,4096,16384,65536,262144",
              show_default=True, help="Comma list of sequence lengths (64k allowed).")
@click.option("--batch", "batches", type=IntListType(maximum=MAX_BATCH), default="1,4,16",
              show_default=True, help="Comma list of batch sizes.")
@click.option("--splits", type=SplitsType(), default="auto", show_default=True,
              help="'auto' or a forced split count.")
@click.option("--protocol", "protocols", multiple=True, callback=_protocol_callback,
              metavar="step|back-to-back[:CALLS]",
              help="How GPU µs are measured (repeatable or comma list; default step): 'step' "
                   "puts the other kernels of a decode step before each call in the graph and "
                   "subtracts them, 'back-to-back' times a graph of attention calls alone; "
                   ":CALLS sets the calls per graph (default 10, more with more buffer sets).")
@click.option("--processes", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Run the sweep in this many fresh processes and report the spread per point.")
@click.option("--soft-cap", "soft_cap", type=SOFT_CAP_TYPE,
              help="logits_soft_cap c (default: the model's, e.g. 50 for gemma-2; 0: none). "
                   "torch SDPA has none: its columns stay empty.")
@click.option("--page-size", "page_sizes", type=IntListType(none="none"), default="none",
              show_default=True,
              help="Comma list of page sizes to time, 'none' for the contiguous cache (e.g. "
                   "none,1,16: each point contiguous and paged side by side); pages in random "
                   "order, FlashInfer reads the same pages (torch SDPA and the naive version "
                   "have no paging).")
@click.option("--append", is_flag=True,
              help="Each call also appends a new token per sequence (k_new, v_new; the cache "
                   "holds seqlen − 1 tokens); the same call without the append is timed too.")
@click.option("--window", "window", type=click.IntRange(min=0),
              help="window_left W: attend only the last W + 1 tokens (peers: FlashInfer with the "
                   "same window, torch SDPA and the naive version over those tokens).")
@click.option("--alibi", is_flag=True,
              help="ALiBi's bias with the standard slopes of the heads (no peer compared).")
@click.option("--sinks", is_flag=True,
              help="A sink logit per query head (gpt-oss; no peer compared).")
@click.option("--q-len", type=click.IntRange(1, MAX_Q_LEN), default=1, show_default=True,
              help="Query tokens per sequence, causal to their positions (draft tokens "
                   "verified together; peers: torch SDPA with the mask aligned to the end).")
@click.option("--kv-dtype", "kv_dtype", type=KV_DTYPE_CHOICE,
              help="An fp8 cache (e4m3 or e5m2; floor µs from its bytes); peers: FlashInfer's "
                   "fp8 decode with per-tensor scales (torch SDPA has no fp8 cache).")
@KV_SCALE_OPTION
@click.option("--baseline", "baselines", type=click.Choice(["torch", "flashinfer"]),
              multiple=True, help="Also time a peer (repeatable); needs torch / flashinfer.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), callback=_output_path,
              help="Write the rows to this CSV file.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=_output_path,
              help="Write the rows (and device facts) to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), callback=_output_path,
              help="Plot µs and % of floor vs seqlen to this PNG (needs matplotlib).")
@click.option("--gpus", type=click.IntRange(1, 64), default=None,
              help="Sequence parallelism instead: for 1, 2, 4, … GPUS ranks (one process per "
                   "GPU, NCCL: the nccl12/nccl13 extra), each holding a contiguous shard of every "
                   "sequence, µs per decode step, the collective's share, and one GPU holding "
                   "the shards together.")
@click.pass_context
def bench(ctx, model, head_dim, dtype, seqlens, batches, splits, protocols, processes, soft_cap,
          page_sizes, append, window, alibi, sinks, q_len, kv_dtype, kv_scale, baselines,
          csv_path, json_path, plot_path, gpus):
    """Time flash_decode against the HBM read floor and against baselines.

    Per point: floor = bytes(K+V) / read ceiling measured in this run; GPU µs per call from a
    replayed CUDA graph (median, p20–p80), rotating over KV buffers larger than 4× L2, in the
    decode-step protocol by default (see --protocol); host µs of flash_decode, of
    DecodePlan.run and of CuPy's own launch of an empty kernel, and eager µs (one flash_decode
    call with its synchronise); speedups over the same kernels with num_splits=1 and over a
    naive CuPy version (cuBLAS + float32 softmax). Peers are timed in the same protocol on the
    same buffers. The output of the timed configuration is checked against float64. With
    several protocols or processes, a last table gives each point's spread over all of them.

    \b
    Examples:
      cupydecode bench
      cupydecode bench --seqlens 4096,65536 --batch 1,16 --csv out.csv --plot out.png
      cupydecode bench --model qwen2.5-7b --dtype bf16 --baseline torch
      cupydecode bench --model gemma-2-9b --baseline flashinfer     (soft-cap 50, the model's)
      cupydecode bench --model phi-3-mini --seqlens 16384 --batch 16 --baseline torch
      cupydecode bench --page-size none,1,16 --baseline flashinfer
      cupydecode bench --append --page-size 16
      cupydecode bench --seqlens 131072 --batch 1,16 --window 4095 --baseline flashinfer
      cupydecode bench --kv-dtype e4m3 --baseline flashinfer        (fp8 cache, per-tensor scales)
      cupydecode bench --protocol step,back-to-back:2,back-to-back:10 --processes 3
      cupydecode bench --gpus 8 --seqlens 1048576 --batch 1      (sequence parallelism)
    """
    from . import bench as B

    if append and q_len > 1:
        raise click.BadParameter("expected --q-len 1 with --append (the command appends one "
                                 "token per sequence)", param_hint="'--q-len'")
    kv_dtype, kv_scale = _check_kv_dtype(kv_dtype, kv_scale, dtype)
    _check_head_dim(MODELS[model].head_dim if head_dim is None else head_dim, dtype, kv_dtype)
    if gpus is not None:
        _check_gpus_options(ctx)
    if plot_path:
        _check_plot_available(ctx)
    require_gpu(ctx)
    peers = list(dict.fromkeys(baselines))
    for name in peers:
        why = B.PEERS[name][0]()
        if why:
            click.echo(f"error: --baseline {name}: {why}", err=True)
            ctx.exit(EXIT_USAGE)
    device, header = _device_header()
    for line in header:
        click.echo(line)
    p = MODELS[model]
    if head_dim is not None:
        p = dataclasses.replace(p, head_dim=head_dim)
    if gpus is not None:
        rows = _bench_gpus(ctx, p, model, dtype, seqlens, batches, gpus)
        write_outputs(rows, {"device": device, "model": model, "gpus": gpus, "rows": rows},
                      csv_path, json_path)
        return
    if processes > 1:
        click.echo(f"{model}: {p.num_heads} query heads, {p.num_kv_heads} KV heads, head_dim "
                   f"{p.head_dim}, {dtype}, splits {splits}; {processes} processes, protocols "
                   f"{', '.join(protocols)}")
        rows = _bench_in_processes(processes, _forwarded_bench_args(
            model, dtype, seqlens, batches, splits, protocols, peers, soft_cap, page_sizes,
            append, window, alibi, sinks, head_dim, q_len, kv_dtype, kv_scale))
        ceiling = {"gbps": [r["ceiling_gbps"] for r in rows if r["ceiling_gbps"]]}
    else:
        ceiling = B.measure_read_ceiling()
        click.echo(f"HBM read ceiling: {ceiling['gbps']:.0f} GB/s (read-only kernel over "
                   f"{ceiling['nbytes'] / 1e9:.2f} GB, {ceiling['us']:.0f} µs)")
        points = B.sweep(model, dtype, seqlens, batches, None if splits == "auto" else splits,
                         soft_cap, page_sizes, append, window, alibi, sinks, head_dim, q_len,
                         kv_dtype, kv_scale)
        first = points[0]
        cap = first.logits_soft_cap
        click.echo(f"{model}: {p.num_heads} query heads, {p.num_kv_heads} KV heads, head_dim "
                   f"{p.head_dim}, {dtype}, splits {splits}"
                   + ("" if cap is None else f", logits_soft_cap {cap:g}")
                   + ("" if page_sizes == [None] else ", page sizes " + ", ".join(
                      "contiguous" if p is None else str(p) for p in page_sizes)
                      + " (random page order)")
                   + (", ALiBi" if first.alibi else "") + (", sinks" if first.sinks else "")
                   + ("" if q_len == 1 else f", {q_len} query tokens per sequence (causal)")
                   + ("" if kv_dtype is None else f", {kv_dtype} cache with scales per "
                      f"{kv_scale}")
                   + ("" if not append else ", each call appends a new token per sequence (the "
                      "cache holds seqlen − 1); no-append µs: the same call over the same seqlen "
                      "tokens without it"))
        for layer in dict.fromkeys(w.layer for w in points):  # the layer types and their windows
            w = next(w for w in points if w.layer == layer)
            if layer or w.window_left is not None:
                click.echo(f"  {layer + ' layers' if layer else 'every layer'}: "
                           + ("attend every token" if w.window_left is None else
                              f"window_left {w.window_left} (the last {w.window_left + 1} "
                              "tokens)"))
        click.echo(f"bytes per point: {B.napkin(points[0], symbolic=True)} "
                   f"(e.g. {B.napkin(points[0])})")
        click.echo(f"GPU µs: {B.GRAPH_TRIALS} replays of a graph per protocol; floor µs = KV "
                   f"bytes / {ceiling['gbps']:.0f} GB/s; protocols: {', '.join(protocols)}")
        if any(B.parse_protocol(x)[0] == "step" for x in protocols):
            click.echo(f"step: before each attention call, "
                       f"{B.StepTraffic.describe(points[0], device['l2_bytes'])} "
                       f"(sizes of the first point); the graph without the attention calls "
                       f"is subtracted")
        click.echo("host µs: flash_decode; run µs: DecodePlan.run; launch µs: CuPy's own launch "
                   "of an empty kernel; naive µs: cuBLAS q·Kᵀ, float32 softmax, cuBLAS P·V, "
                   "timed by events over back-to-back calls (CuPy cannot capture cuBLAS)\n")
        rows = []
        with click.progressbar(points, label="bench", file=sys.stderr,
                               item_show_func=lambda w: w and f"B={w.batch} L={w.seqlen}") as bar:
            for w in bar:
                rows.extend(B.bench_point(w, ceiling["gbps"], device["l2_bytes"], model, peers,
                                          protocols))
    peer_cols = {c: label for name in peers for c, label in B.PEERS[name][2].items()}
    done = [r for r in rows if not r["skipped"]]
    if done:
        for line in format_table([_bench_display(r) for r in done],
                                 _bench_columns(peer_cols, processes > 1, append,
                                                page_sizes != [None],
                                                any(r.get("layer") for r in done))):
            click.echo(line)
    for r in rows:
        if r["skipped"]:
            click.echo(f"skipped batch {r['batch']} seqlen {r['seqlen']}: {r['skipped']}")
        if r["notes"]:
            click.echo(f"note batch {r['batch']} seqlen {r['seqlen']} ({r['protocol']}): "
                       f"{r['notes']}")
    spread = stability(done) if (processes > 1 or len(protocols) > 1) else []
    if spread:
        click.echo("\nspread per point over every protocol and process:")
        columns = STABILITY_COLUMNS if page_sizes == [None] else (
            STABILITY_COLUMNS[:2] + [("page", "page_label", "s")] + STABILITY_COLUMNS[2:])
        if any(r["layer"] for r in spread):
            columns = [("layer", "layer", "s")] + columns
        for line in format_table(spread, columns):
            click.echo(line)
    payload = {"device": device, "ceiling": ceiling, "model": model, "protocols": protocols,
               "processes": processes, "rows": rows, "stability": spread}
    write_outputs(rows, payload, csv_path, json_path)
    if plot_path:
        first = protocols[0]
        page = page_sizes[0]
        B.plot_rows([r for r in rows if r["protocol"] == first and r.get("process", 1) == 1
                     and r.get("page_size") == page and r.get("layer") == rows[0].get("layer")],
                    plot_path,
                    f"{model} {dtype} on {device['name']}, {first} protocol"
                    + ("" if page is None else f", pages of {page}"))
        click.echo(f"wrote {plot_path}")
    if any(r["check"] in ("FAIL", "ERROR") for r in rows):
        click.echo("error: a timed configuration failed its correctness check", err=True)
        ctx.exit(EXIT_FAILED)


# ---------------------------------------------------------------------------- explain

@main.command()
@click.option("--tokens", type=click.IntRange(1, 4096), default=12, show_default=True,
              help="Tokens in the cache.")
@click.option("--splits", type=click.IntRange(1, 64), default=3, show_default=True,
              help="Chunks the cache is split into.")
@click.option("--head-dim", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Vector length.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Seed of the example's q, K, V.")
@click.option("--center", type=FiniteFloatRange(0.0, 1e6, min_open=True), default=120.0,
              show_default=True, help="Logits are drawn around this value (> 0).")
@click.option("--gpu", is_flag=True, help="Also read the same numbers from the real kernels.")
@click.pass_context
def explain(ctx, tokens, splits, head_dim, seed, center, gpu):
    """Walk the split/merge algorithm of docs/DESIGN.md on a tiny example, number by number.

    Prints the scores s_j, each split's m_i, l_i, V_i, Õ_i and LSE_i, the merge weights w_i
    and the merged O next to a direct float64 softmax; then shows the direct exp-sum
    overflowing in float16 and float32 while the LSE path stays exact. Runs on the CPU;
    --gpu adds the partials read back from the CUDA kernels.

    \b
    Examples:
      cupydecode explain
      cupydecode explain --tokens 10 --splits 4 --head-dim 8 --seed 3
      cupydecode explain --gpu
    """
    from . import explain as E

    if gpu:  # before the walk: no half-printed run that then fails
        require_gpu(ctx, "--gpu reads the partials back from the CUDA kernels; without it "
                         "`cupydecode explain` runs on the CPU.")
    wk = E.walk(tokens, splits, head_dim, seed, center)
    for line in E.format_walk(wk) + E.format_overflow(wk):
        click.echo(line)
    if gpu:
        for line in E.format_gpu(wk, E.gpu_partials(wk)):
            click.echo(line)


# ---------------------------------------------------------------------------- info

def _cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                            "kernel_cache")


def _safe(fn, default="unavailable"):
    try:
        return fn()
    except Exception as exc:
        return f"{default} ({type(exc).__name__})"


@main.command()
@click.option("--compile", "compile_all", is_flag=True,
              help="Build every kernel specialisation now, which fills CuPy's on-disk cache; "
                   "without a GPU, compile them with NVRTC for sm_90 only (a compile check: "
                   "nothing is cached).")
@click.pass_context
def info(ctx, compile_all):
    """Versions, GPU facts, and where compiled kernels are cached.

    \b
    Examples:
      cupydecode info
      cupydecode info --compile      # build all dtype × head_dim specialisations
    """
    from . import _kernels

    click.echo(f"cupydecode {__version__} (Python {sys.version.split()[0]})")
    click.echo(f"kernel sources: {_safe(lambda: str(_kernels.kernel_dir()), 'not found')}")
    try:
        import cupy
    except Exception as exc:
        click.echo(f"CuPy: not importable ({type(exc).__name__}: {exc})")
        click.echo("no GPU found: CuPy is needed to run the kernels; `cupydecode explain` works without it")
        return
    from .bench import _cuda_version

    click.echo(f"CuPy {cupy.__version__}")
    click.echo("CUDA runtime " + str(_safe(lambda: _cuda_version(cupy.cuda.runtime.runtimeGetVersion()))))
    driver = _safe(cupy.cuda.runtime.driverGetVersion)
    click.echo("CUDA driver " + (("none found" if driver == 0 else _cuda_version(driver))
                                 if isinstance(driver, int) else driver))
    click.echo("NVRTC " + str(_safe(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))))
    cache = _cache_dir()
    n_files = sum(len(f) for _, _, f in os.walk(cache)) if os.path.isdir(cache) else 0
    click.echo(f"CuPy kernel cache: {cache} ({n_files} file(s)"
               f"{'' if os.environ.get('CUPY_CACHE_DIR') else '; set CUPY_CACHE_DIR to move it'})")
    ok, why = detect_gpu()
    if not ok:
        click.echo(f"no GPU found: {why}")
        if compile_all:
            _compile_all_nvrtc()
        return
    _, header = _device_header()
    click.echo(header[0])
    free, total = cupy.cuda.runtime.memGetInfo()
    click.echo(f"memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    pdl = _safe(lambda: _kernels.programmatic_launch_supported(cupy.cuda.Device().id))
    click.echo("merge kernel launch: " + (
        "programmatic (it starts while the split kernel runs)" if pdl is True else
        "plain (programmatic needs compute capability 9.0 and a CUDA 12.3 driver)" if pdl is False
        else pdl))
    if compile_all:
        click.echo("--compile: building and loading every specialisation (a minute or more) ...")
        _compile_all()
    specs = _kernels.compiled_specialisations()
    click.echo(f"specialisations compiled in this process: {len(specs)}")
    for s in specs:
        click.echo(f"  {s}")


# bench's options that --gpus (the scaling table of the plain decode step) does not take
_GPUS_IGNORES = ("splits", "protocols", "processes", "soft_cap", "page_sizes", "append", "window",
                 "alibi", "sinks", "q_len", "kv_dtype", "kv_scale", "baselines", "plot_path")


def _check_gpus_options(ctx) -> None:
    """bench --gpus times the plain decode step: an option of the single-GPU sweep given with
    it is refused (it would be ignored)."""
    given = [param.opts[0] for param in ctx.command.params if param.name in _GPUS_IGNORES
             and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"--gpus times the plain decode step (shapes and dtype only): "
                               f"drop {', '.join(given)}", ctx)


def _bench_gpus(ctx, p, model: str, dtype: str, seqlens, batches, gpus: int) -> list[dict]:
    """bench --gpus: the scaling table of sequence parallelism at every (batch, seqlen); its
    rows (for --csv, --json)."""
    from . import bench as B
    from . import distributed as Dist

    import cupy

    have = cupy.cuda.runtime.getDeviceCount()
    if gpus > have:
        click.echo(f"error: --gpus {gpus}: this machine has {have} GPU(s)", err=True)
        ctx.exit(EXIT_USAGE)
    try:
        Dist.nccl_unique_id()
    except ImportError as exc:
        click.echo(f"error: --gpus: {exc}", err=True)
        ctx.exit(EXIT_USAGE)
    click.echo(f"{model}: {p.num_heads} query heads, {p.num_kv_heads} KV heads, head_dim "
               f"{p.head_dim}, {dtype}; sequence parallelism over 1 to {gpus} GPUs (contiguous "
               "shards, one all-gather per step); µs per step from the host to completion")
    own = [what for what, on in (("soft-cap", p.logits_soft_cap), ("windows", p.window_left),
                                 ("ALiBi", p.alibi), ("sinks", p.sinks)) if on]
    if own:
        click.echo(f"(plain attention: the model's {', '.join(own)} not applied)")
    rows = []
    click.echo(f"{'point':>14s} {'GPUs':>5s} {'tokens/GPU':>11s} {'step µs':>9s} "
               f"{'collective µs':>14s} {'1 GPU µs':>9s} {'speedup':>8s} {'rel err':>9s}")
    for b in batches:
        for n in seqlens:
            spec = dict(batch=b, seqlen=n, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
                        head_dim=p.head_dim, dtype=dtype, seed=fresh_seed())
            for row in B.scaling_rows(spec, gpus):
                rows.append(dict(row, batch=b, seqlen=n))
                single = "—" if row["single_gpu_us"] is None else f"{row['single_gpu_us']:.1f}"
                speed = "—" if row["speedup"] is None else f"{row['speedup']:.2f}×"
                err = "—" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
                click.echo(f"{f'{b} × {n}':>14s} {row['gpus']:>5d} {row['tokens_per_gpu']:>11d} "
                           f"{row['step_us']:>9.1f} {row['collective_us']:>8.1f} "
                           f"({100 * row['collective_share']:>3.0f}%) {single:>9s} {speed:>8s} "
                           f"{err:>9s}")
    return rows


def _compile_all() -> None:
    """Build the split kernels (every block shape a plan can pick) and the merge kernel that
    a split plan uses, for every dtype × kernel width it takes (64, 128, 256, and 512 for 16-bit
    types; the head_dims between them are builds of their own, compiled when first used)."""
    from . import _policy
    from .decode import _merge_function, _split_function


    for dt in DTYPES:
        for d in KERNEL_HEAD_DIMS:
            if not _policy.width_takes(dt, d):
                continue
            t0 = time.perf_counter()
            for cfg in _policy.split_kernel_configs(dt, d):
                for build in _policy.builds(cfg):
                    _split_function(build)
            _merge_function("float32", dt, d)
            click.echo(f"  built {dt} head_dim {d} in {time.perf_counter() - t0:.2f} s")


def _compile_all_nvrtc(arch: str = "sm_90") -> None:
    """Without a GPU: build every specialisation with NVRTC for ``arch`` (what `--compile` would
    load), or say why not."""
    from . import _kernels, _policy

    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:
        click.echo(f"--compile: not compiled: NVRTC is not available ({type(exc).__name__}: {exc})")
        return
    click.echo(f"--compile: building every specialisation with NVRTC for {arch} (a minute or "
               "more on one core) ...")
    t0, count, worst = time.perf_counter(), 0, 0
    for dt in DTYPES:
        for d in KERNEL_HEAD_DIMS:
            if not _policy.width_takes(dt, d):
                continue
            builds = [("decode_split.cu", b.defines()) for c in _policy.split_kernel_configs(dt, d)
                      for b in _policy.builds(c)]
            builds.append(("merge_states.cu", {"IN_DTYPE": _policy.DTYPE_IDS["float32"],
                                               "OUT_DTYPE": _policy.DTYPE_IDS[dt],
                                               "VEC": _policy.merge_vec(d)}))
            for filename, defines in builds:
                _, log = _kernels.compile_for_arch(filename, defines, arch, ptxas_info=True)
                spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
                worst = max([worst, *spills])
                count += 1
    click.echo(f"--compile: no GPU, so compiled with NVRTC for {arch} only: {count} kernels in "
               f"{time.perf_counter() - t0:.1f} s, at most {worst} spill bytes (nothing loaded)")


# ---------------------------------------------------------------------------- models

@main.command()
def models():
    """List the model presets usable with --model.

    \b
    Example:
      cupydecode models
    """
    rows = []
    for name, p in MODELS.items():
        rows.append({"model": name, "heads": p.num_heads, "kv_heads": p.num_kv_heads,
                     "head_dim": p.head_dim, "group": p.group,
                     "kv_kib": workload_for_model(name, 1, 1, "float16").kv_bytes() / 1024,
                     "note": p.note})
    cols = [("model", "model", "s"), ("heads", "heads", "d"), ("kv heads", "kv_heads", "d"),
            ("head_dim", "head_dim", "d"), ("G", "group", "d"),
            ("KV KiB/token/layer (fp16)", "kv_kib", ".1f"), ("attention", "note", "s")]
    for line in format_table(rows, cols):
        click.echo(line.rstrip())


if __name__ == "__main__":  # pragma: no cover
    main()
