"""Argument checks for the public API: every bad input is refused here, before any launch.

Each error names the argument, what was expected and what was given, e.g.
``ValueError: k_cache: expected shape (batch=2, max_seqlen, num_kv_heads, head_dim=128), got (2, 64, 8, 64)``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._policy import (DTYPE_IDS, FP8_HEAD_DIM_STEP, HEAD_DIM_STEP, HEAD_DIMS_TEXT, ITEMSIZE,
                      KV_DTYPES, LOG2E, MAX_APPEND_Q_LEN, MAX_BATCH, MAX_HEAD_DIM, MAX_Q_LEN,
                      MAX_SPLITS, MAX_TOKENS, MIN_HEAD_DIM, SPLIT_STATIC_SMEM_BYTES,
                      SUPPORTED_HEAD_DIMS, WIDE_DTYPES, WIDE_HEAD_DIM, Tuning, kernel_head_dim,
                      tuned, width_takes)


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # np.dtype(...).name is computed in Python each time: remember it
        name = np.dtype(dtype).name
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def fail(kind: type[Exception], name: str, expected: str, got) -> None:
    raise kind(f"{name}: expected {expected}, got {got}")


def check_dtype_arg(dtype, name: str) -> str:
    """An element type given as an argument (a NumPy dtype, type or name; "bfloat16" once CuPy
    is imported): its name, one of the kernels' types."""
    try:
        got = dtype_name(dtype)
    except TypeError:
        fail(TypeError, name, "a NumPy dtype or dtype name", repr(dtype))
    if got not in DTYPE_IDS:
        fail(TypeError, name, "one of (" + ", ".join(DTYPE_IDS) + ")", got)
    return got


def as_device_array(x, name: str):
    """A ``cupy.ndarray`` view of ``x`` (zero-copy for CuPy, DLPack and CUDA-array-interface
    objects such as torch or JAX GPU tensors). Host arrays are refused with a hint.

    DLPack is tried first: it names bfloat16, which ``__cuda_array_interface__`` cannot (its
    typestr has no code for it: torch 2.5 exports bfloat16 as '<f2', i.e. float16, other versions
    raise or use a void type), so a bfloat16 tensor that does not come through DLPack is refused
    rather than read as another type.
    """
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
        raise TypeError(
            f"{name}: expected a GPU array (cupy.ndarray, or a torch/JAX GPU tensor), got a host "
            f"{type(x).__name__}; move it to the GPU first, e.g. cupy.asarray({name})")
    dlpack_error = None
    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception as exc:  # a CPU tensor offers DLPack too
            dlpack_error = exc
    try:
        x.__cuda_array_interface__
    except AttributeError:
        has_cai = False
    except Exception as exc:  # e.g. a dtype the interface cannot describe
        raise TypeError(f"{name}: expected a GPU array, got {type(x).__name__} whose "
                        f"__cuda_array_interface__ failed ({type(exc).__name__}: {exc})") from exc
    else:
        has_cai = True
    if has_cai and "bfloat16" in str(getattr(x, "dtype", "")):
        raise TypeError(f"{name}: expected a bfloat16 GPU array that CuPy can import through "
                        f"DLPack, got {type(x).__name__} whose DLPack export failed "
                        f"({dlpack_error}); __cuda_array_interface__ cannot describe bfloat16")
    if has_cai:
        return cupy.asarray(x)
    if dlpack_error is not None:
        raise TypeError(f"{name}: expected a GPU array, got {type(x).__name__} that CuPy cannot "
                        f"view on the GPU ({dlpack_error}); move it to the GPU first") from dlpack_error
    raise TypeError(f"{name}: expected a GPU array (cupy.ndarray or an object with "
                    f"__cuda_array_interface__ / __dlpack__), got {type(x).__name__}")


def check_dtype(x, name: str, allowed=tuple(DTYPE_IDS)) -> str:
    dt = dtype_name(x.dtype)
    if dt not in allowed:
        fail(TypeError, name, "dtype in (" + ", ".join(allowed) + ")", dt)
    return dt


def check_ndim(x, name: str, ndim: int, layout: str) -> None:
    if x.ndim != ndim:
        fail(ValueError, name, f"{ndim}-D array {layout}", f"{x.ndim}-D array of shape {tuple(x.shape)}")


def check_shape(x, name: str, expected: tuple, layout: str) -> None:
    """``expected`` holds ints or None (free); ``layout`` names the axes for the message."""
    if len(x.shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, x.shape)):
        fail(ValueError, name, f"shape {layout}", tuple(x.shape))


def check_vector_layout(x, name: str, axes: tuple[int, ...]) -> None:
    """Last dim contiguous; 16-byte aligned base and strides on ``axes`` (for 16-byte loads).

    Zero-size arrays are never read (CuPy gives them all-zero strides), so they pass.
    """
    if x.size == 0:
        return
    if x.strides[-1] != x.itemsize and x.shape[-1] > 1:
        fail(ValueError, name, "the last dimension contiguous (stride of 1 element)",
             f"strides {tuple(s // x.itemsize for s in x.strides)} (in elements)")
    bad = [x.strides[a] for a in axes if x.strides[a] % 16 != 0 or x.strides[a] < 0]
    if bad or x.data.ptr % 16:
        fail(ValueError, name, "a 16-byte aligned base pointer and non-negative strides that are "
             "multiples of 16 bytes on the batch/sequence/head axes",
             f"pointer % 16 = {x.data.ptr % 16}, strides {tuple(x.strides)} bytes")


def check_same_device(arrays: dict) -> None:
    import cupy

    current = cupy.cuda.runtime.getDevice()
    for name, a in arrays.items():
        if a is not None and a.data.device_id != current:
            fail(ValueError, name, f"an array on the current device (GPU {current})",
                 f"GPU {a.data.device_id}")


def check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(TypeError, name, "an int", f"{type(value).__name__} {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        fail(ValueError, name, rng, value)
    return value


def check_flag(value, name: str) -> bool:
    """A yes/no option: True or False (a NumPy bool too), never another truthy value."""
    if not isinstance(value, (bool, np.bool_)):
        fail(TypeError, name, "True or False", repr(value))
    return bool(value)


def check_splits(num_splits, split_size) -> tuple[int | None, int | None]:
    """``num_splits`` / ``split_size``: each None or an int in range, not both given."""
    if num_splits is not None and split_size is not None:
        raise ValueError("num_splits and split_size: expected at most one of them, got both")
    if num_splits is not None:
        num_splits = check_int(num_splits, "num_splits", 1, MAX_SPLITS)
    if split_size is not None:
        split_size = check_int(split_size, "split_size", 1, MAX_TOKENS)
    return num_splits, split_size


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        fail(TypeError, "softmax_scale", "a finite real number or None",
             f"{type(softmax_scale).__name__} {softmax_scale!r}")
    s = float(softmax_scale)
    if not math.isfinite(s):
        fail(ValueError, "softmax_scale", "a finite real number or None", s)
    if abs(s) * LOG2E > _FLOAT32_MAX:  # the kernels take scale · log2(e) as a float32
        fail(ValueError, "softmax_scale", f"|softmax_scale| <= {_FLOAT32_MAX / LOG2E:.3g} "
             "(it is used in float32)", s)
    return s


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


# The kernel forms a capped score to about 1e-7 · c absolute (kernels/decode_split.cu,
# score_mod): at c = 1000 that moves outputs by < 5e-5 relative (float32 emulation, scores up to
# ±100), at c = 1e4 by 5e-4 — beyond float32's tolerance. Models cap at 30–50.
MAX_SOFT_CAP = 1000.0


def check_tuning_types(tuning) -> None:
    """``tuning``: None or a :class:`cupydecode.Tuning` whose fields have their types (what
    can be checked before the plan's shape is known)."""
    if tuning is None:
        return
    if not isinstance(tuning, Tuning):
        fail(TypeError, "tuning", "a cupydecode.Tuning or None", type(tuning).__name__)
    for name in ("num_warps", "stages"):
        value = getattr(tuning, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            fail(TypeError, f"tuning.{name}", "an int or None", f"{type(value).__name__} {value!r}")
    for name in ("l2_evict_first", "warps_in_step", "kv_groups"):
        value = getattr(tuning, name)
        if value is not None and not isinstance(value, bool):
            fail(TypeError, f"tuning.{name}", "True, False or None", repr(value))


def check_tuning(tuning, config, smem_optin: int):
    """The plan's block shape ``config`` (the policy's, with every switch the plan sets) with
    ``tuning``'s overrides (None or a :class:`cupydecode.Tuning`), checked to give a kernel that
    builds (decode_split.cu's conditions) and fits in ``smem_optin`` bytes of shared memory per
    block (0: unknown)."""
    if tuning is None:
        return config
    check_tuning_types(tuning)
    config = tuned(config, tuning)
    per_slot = config.m_tiles * config.kv_per_block  # warps of one token slot
    nw = config.num_warps
    if not (per_slot <= nw <= 32 and nw % per_slot == 0):
        fail(ValueError, "tuning.num_warps", f"a multiple of {per_slot} from {per_slot} to 32 "
             f"(this plan's blocks: {config.m_tiles} M-tile(s) x {config.kv_per_block} KV "
             f"head(s) per token slot)", nw)
    chunks = config.kv_per_block * config.width * ITEMSIZE[config.dtype] // 16
    if config.threads < chunks:  # (a thread per 16-byte chunk of the block's new K/V rows)
        fail(ValueError, "tuning.num_warps", f"at least {-(-chunks // 32)} for {config.dtype} "
             f"head_dim {config.width} (a thread per 16-byte chunk of a row)", nw)
    if config.m_tiles > 1 and config.slots > 15:
        fail(ValueError, "tuning.num_warps", f"at most {15 * per_slot} for blocks of "
             f"{config.m_tiles} M-tiles (15 named barriers)", nw)
    if not 2 <= config.stages <= 16:
        fail(ValueError, "tuning.stages", "2 to 16", config.stages)
    if tuning.warps_in_step and config.m_tiles > 1:
        fail(ValueError, "tuning.warps_in_step", "False or None for blocks of several M-tiles "
             "(their slots meet at named barriers already)", True)
    need = config.smem_bytes + SPLIT_STATIC_SMEM_BYTES
    if smem_optin and need > smem_optin:
        fail(ValueError, "tuning", f"a block shape within the GPU's {smem_optin} bytes of "
             f"shared memory per block", f"{nw} warps x {config.stages} stages "
             f"({config.smem_bytes} bytes + up to {SPLIT_STATIC_SMEM_BYTES} static)")
    return config


def check_soft_cap(logits_soft_cap) -> float | None:
    """``logits_soft_cap``: None (or 0, FlashAttention's "no cap") → None; else c in
    (0, MAX_SOFT_CAP]."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
        fail(TypeError, "logits_soft_cap", "a finite number > 0, or None (or 0) for no cap",
             f"{type(logits_soft_cap).__name__} {logits_soft_cap!r}")
    c = float(logits_soft_cap)
    if c == 0.0:
        return None
    if not math.isfinite(c) or c < 0.0:
        fail(ValueError, "logits_soft_cap", "a finite number > 0, or None (or 0) for no cap", c)
    if not _FLOAT32_TINY <= c * LOG2E or c > MAX_SOFT_CAP:
        fail(ValueError, "logits_soft_cap", f"a number in [{_FLOAT32_TINY / LOG2E:.3g}, "
             f"{MAX_SOFT_CAP:g}] (the capped scores are accurate to ~1e-7 · cap; models use "
             "30-50)", c)
    return c


def check_window(window_left) -> int | None:
    """``window_left``: None or −1 (no window) → None; else W ≥ 0, the keys left of the query's
    position it attends (W + 1 keys with its own), an int up to MAX_TOKENS."""
    if window_left is None:
        return None
    if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral):
        fail(TypeError, "window_left", "an int >= 0, or None (or -1) for no window",
             f"{type(window_left).__name__} {window_left!r}")
    w = int(window_left)
    if w == -1:
        return None
    if not 0 <= w <= MAX_TOKENS:
        fail(ValueError, "window_left", f"an int in [0, {MAX_TOKENS}], or None (or -1) for no "
             "window", w)
    return w


def host_array(x, name: str) -> np.ndarray:
    """Host values (a list, tuple or NumPy array) as a NumPy array; a ragged or otherwise
    unconvertible sequence is refused with the argument's name."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:
        fail(ValueError, name, "a rectangular sequence of numbers", f"{type(x).__name__} ({exc})")


def _host_finite(x, name: str) -> np.ndarray:
    """Host values (a list, tuple or NumPy array) of real, finite numbers, as a NumPy array."""
    arr = host_array(x, name)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        fail(TypeError, name, "real numbers", f"dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        at = int(np.flatnonzero(~np.isfinite(arr))[0])
        fail(ValueError, name, "finite values", f"{arr.flat[at]} at index {at}")
    return arr


def check_head_values(x, name: str, num_heads: int, allow_host_array: bool = True):
    """A per-query-head float32 vector (``alibi_slopes``, ``sinks``): None, a (num_heads,)
    float32 device array used as is (contiguous, on the current device), or (with
    ``allow_host_array``) finite host values copied to the device. Returns the device array or
    None."""
    if x is None:
        return None
    import cupy

    if isinstance(x, (list, tuple, np.ndarray)) and allow_host_array:
        arr = _host_finite(x, name)
        if arr.shape != (num_heads,):
            fail(ValueError, name, f"shape ({num_heads},) (one per query head)", arr.shape)
        return cupy.asarray(arr, dtype=cupy.float32)
    arr = as_device_array(x, name)
    if dtype_name(arr.dtype) != "float32":
        fail(TypeError, name, "dtype float32", dtype_name(arr.dtype))
    if arr.shape != (num_heads,):
        fail(ValueError, name, f"shape ({num_heads},) (one per query head)", tuple(arr.shape))
    if num_heads > 1 and arr.strides[0] != 4:
        fail(ValueError, name, "a contiguous array", f"stride {arr.strides[0]} bytes")
    check_same_device({name: arr})
    return arr


def check_tokens_after(tokens_after, batch: int, appending: bool):
    """DecodePlan.run's ``tokens_after`` (a shard of each sequence: the tokens after it): a
    (batch,) contiguous int32 device array on the current device, never read on the host (the
    kernel clamps each value to [0, 2³⁰]); not with appended tokens (``appending``), which belong
    at the sequence's end."""
    if appending:
        fail(ValueError, "tokens_after", "None with k_new/v_new (new tokens are appended at the "
             "sequence's end, on the shard that holds it)", "an array")
    if isinstance(tokens_after, (list, tuple, np.ndarray, int)):
        fail(TypeError, "tokens_after", "a (batch,) int32 device array (it may change between "
             "graph replays, so it is never copied from the host)", type(tokens_after).__name__)
    arr = as_device_array(tokens_after, "tokens_after")
    if dtype_name(arr.dtype) != "int32":
        fail(TypeError, "tokens_after", "dtype int32", dtype_name(arr.dtype))
    if arr.shape != (batch,):
        fail(ValueError, "tokens_after", f"shape ({batch},)", tuple(arr.shape))
    if batch > 1 and arr.strides[0] != 4:
        fail(ValueError, "tokens_after", "a contiguous array", f"stride {arr.strides[0]} bytes")
    check_same_device({"tokens_after": arr})
    return arr


def check_alibi_slopes(alibi_slopes, alibi: bool, num_heads: int, allow_host_array: bool = True):
    """``alibi_slopes`` (:func:`check_head_values`) against the plan: required where it was built
    with ``alibi=True``, refused otherwise."""
    if alibi_slopes is None and alibi:
        fail(ValueError, "alibi_slopes", f"a (num_heads={num_heads},) float32 array (the plan "
             "was built with alibi=True)", "None")
    if alibi_slopes is not None and not alibi:
        fail(ValueError, "alibi_slopes", "None for a plan built without alibi=True "
             "(DecodePlan(..., alibi=True) adds the bias)", type(alibi_slopes).__name__)
    return check_head_values(alibi_slopes, "alibi_slopes", num_heads, allow_host_array)


def soft_cap_args(softmax_scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """The split kernel's (soft_cap_in, soft_cap_out) for score_mod (kernels/decode_split.cu):
    2·log2(e)·scale/c and c·log2(e); (0, 0) without a cap. A ratio scale/c too large for
    float32 is refused (naming both)."""
    if logits_soft_cap is None:
        return 0.0, 0.0
    ratio = 2.0 * LOG2E * softmax_scale / logits_soft_cap
    if abs(ratio) > _FLOAT32_MAX:
        fail(ValueError, "softmax_scale/logits_soft_cap",
             f"|softmax_scale / logits_soft_cap| <= {_FLOAT32_MAX / (2 * LOG2E):.3g} (float32)",
             f"{softmax_scale!r} / {logits_soft_cap!r}")
    return ratio, logits_soft_cap * LOG2E


_VALIDATED: dict = {}


def layout_key(q, k_cache, v_cache):
    """Every property of q, k_cache and v_cache that :func:`check_decode_inputs` checks (shapes,
    strides, dtypes, pointer alignment, devices, and the current device), as a hashable key; None
    unless all three are ``cupy.ndarray``. Equal keys pass or fail the checks alike. It is the
    first :data:`LAYOUT_PARTS` items of their :func:`call_key`."""
    key = call_key(q, k_cache, v_cache, (None,) * 4, ())[0]
    return None if key is None else key[:LAYOUT_PARTS]


LAYOUT_PARTS = 14  # a call_key's items of q, k_cache and v_cache: its layout_key
_KEY_SCALARS = (int, float, str, bool)  # host values a call key holds as (type, value)


def call_key(q, k_cache, v_cache, args: tuple, rare: tuple):
    """Every property of a call's inputs that its checks depend on, as one hashable key, and
    the device pointers of its arrays: ``(key, pointers)``. The key: q, k_cache and v_cache's
    :func:`layout_key` items, then for each of ``args`` and ``rare`` (the call's other
    arguments, in a fixed order: ``rare`` those a serving loop seldom passes, left out of the
    key while all are None) None, a ``cupy.ndarray``'s shape, strides, dtype, pointer alignment
    and device, or a host int, float, str or bool with its type. ``pointers``: a list of the
    pointer of q, k_cache, v_cache and each of ``args`` (then of ``rare`` where the key has
    them), 0 for what is not an array, each read once for the key and the launch. ``(None,
    None)`` (not cacheable: checked on every call) where q, k or v is not a ``cupy.ndarray`` or
    another argument is of any other kind. Inputs with equal keys pass or fail every check alike
    and give the kernel the same values apart from the pointers, which is what lets
    DecodePlan.run and flash_decode skip the checks of keys that passed. ``args[0]`` is the
    call's cache_seqlens: an int there is keyed by its type alone (a loop's length changes every
    step), so its callers check its value on every call (DecodePlan._with_length)."""
    nd = _NDARRAY or _ndarray_type()
    if type(q) is not nd or type(k_cache) is not nd or type(v_cache) is not nd:
        return None, None
    qd, kd, vd = q.data, k_cache.data, v_cache.data
    qp, kp, vp = qd.ptr, kd.ptr, vd.ptr
    parts = [q.shape, q.strides, q.dtype, k_cache.shape, k_cache.strides, k_cache.dtype,
             v_cache.shape, v_cache.strides, v_cache.dtype, (qp | kp | vp) & 15,
             qd.device_id, kd.device_id, vd.device_id, _GET_DEVICE()]
    pointers = [qp, kp, vp]
    items = args
    for a in rare:  # (by identity: an array's == is elementwise)
        if a is not None:
            items = args + rare
            break
    for a in items:
        if a is None:
            parts.append(None)
            pointers.append(0)
            continue
        kind = type(a)
        if kind is nd:
            d = a.data
            p = d.ptr
            parts.append((a.shape, a.strides, a.dtype, p & 15, d.device_id))
            pointers.append(p)
        elif kind in _KEY_SCALARS:
            parts.append((kind, a))
            pointers.append(0)
        else:
            return None, None
    if type(args[0]) is int:
        parts[LAYOUT_PARTS] = int
    return tuple(parts), pointers


def _ndarray_type():
    """cupy.ndarray, and the runtime's current-device query beside it (looked up once, on the
    first call: CuPy is imported lazily; importing it makes no CUDA call)."""
    global _NDARRAY, _GET_DEVICE
    if _NDARRAY is None:
        import cupy

        _GET_DEVICE = cupy.cuda.runtime.getDevice
        _NDARRAY = cupy.ndarray
    return _NDARRAY


_NDARRAY = _GET_DEVICE = None


def check_decode_inputs(q, k_cache, v_cache, key, paged: bool = False, kv_dtype=None):
    """Validate q, k_cache, v_cache; return (q, k, v, dtype, shape dict) as device arrays.

    Every property the checks depend on (shapes, strides, dtypes, pointer alignment, devices) is
    a key of a small cache, so a serving loop that passes the same layouts every step pays for a
    dictionary lookup instead of the full checks. ``key``: the inputs' :func:`layout_key` (None:
    not cached). ``paged``: the caches are pools of pages, (num_pages, page_size,
    num_kv_heads, head_dim); the shape dict then has ``page_size`` and ``num_pages`` instead of
    ``max_seqlen`` (which the block table sets: :func:`check_block_table`). ``kv_dtype``
    ("e4m3", "e5m2"; checked by the caller): the caches hold fp8 codes (uint8, or the matching
    ml_dtypes float8 type), q float16 or bfloat16, head_dim a multiple of 16; the caches are
    returned as uint8 views.
    """
    if key is not None:
        hit = _VALIDATED.get((key, paged, kv_dtype))
        if hit is not None:
            if kv_dtype is not None:
                return q, _codes_view(k_cache), _codes_view(v_cache), hit[0], hit[1]
            return q, k_cache, v_cache, hit[0], hit[1]
        result = _check_decode_inputs(q, k_cache, v_cache, paged, kv_dtype)
        if len(_VALIDATED) < 256:
            _VALIDATED[(key, paged, kv_dtype)] = result[3:]
        return result
    return _check_decode_inputs(q, k_cache, v_cache, paged, kv_dtype)


# ml_dtypes' names of the fp8 formats (an fp8 cache may be such an array instead of uint8 codes)
_FP8_DTYPE_NAMES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _codes_view(a):
    """An fp8 cache as uint8 codes (a view; already uint8: itself)."""
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def check_head_dim(head_dim: int, dtype: str, head_dim_arg: str) -> None:
    """A head_dim the kernels take for ``dtype`` (``head_dim_arg``: the argument that carries
    it): SUPPORTED_HEAD_DIMS; WIDE_HEAD_DIM with 16-bit types only."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        fail(ValueError, head_dim_arg, f"head_dim {HEAD_DIMS_TEXT}", head_dim)
    if not width_takes(dtype, kernel_head_dim(head_dim)):
        fail(ValueError, head_dim_arg, f"head_dim a multiple of {HEAD_DIM_STEP} from "
             f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM} for {dtype} ({WIDE_HEAD_DIM} takes "
             f"{' or '.join(WIDE_DTYPES)})", head_dim)


def check_fp8_query(dtype: str, head_dim: int, kv_dtype: str, dtype_arg: str,
                    head_dim_arg: str) -> None:
    """q's dtype and head_dim over an fp8 cache: 16-bit, a multiple of FP8_HEAD_DIM_STEP
    (``dtype_arg``, ``head_dim_arg``: the arguments that carry them)."""
    if dtype == "float32":
        fail(TypeError, dtype_arg, f"float16 or bfloat16 with kv_dtype={kv_dtype!r} (q and out "
             "stay 16-bit over an fp8 cache)", dtype)
    if head_dim > MAX_HEAD_DIM:
        fail(ValueError, head_dim_arg, f"head_dim at most {MAX_HEAD_DIM} with kv_dtype={kv_dtype!r} "
             f"({WIDE_HEAD_DIM} takes 16-bit caches only)", head_dim)
    if head_dim % FP8_HEAD_DIM_STEP:
        fail(ValueError, head_dim_arg, f"head_dim a multiple of {FP8_HEAD_DIM_STEP} from 32 to "
             f"256 with kv_dtype={kv_dtype!r} (whole 16-byte pieces of codes per row)", head_dim)


def check_fp8_cache(a, name: str, kv_dtype: str) -> None:
    """``a`` holds codes of ``kv_dtype``: uint8, or that format's ml_dtypes float8 type."""
    got = dtype_name(a.dtype)
    want = _FP8_DTYPE_NAMES[kv_dtype]
    if got not in ("uint8", want):
        fail(TypeError, name, f"uint8 codes or {want} with kv_dtype={kv_dtype!r}", got)


def _check_decode_inputs(q, k_cache, v_cache, paged: bool = False, kv_dtype=None):
    q = as_device_array(q, "q")
    k = as_device_array(k_cache, "k_cache")
    v = as_device_array(v_cache, "v_cache")
    if q.ndim not in (3, 4):  # one query token per sequence, or q_len of them
        fail(ValueError, "q", "a 3-D (batch, num_heads, head_dim) or 4-D (batch, q_len, "
             "num_heads, head_dim) array", f"{q.ndim}-D array of shape {tuple(q.shape)}")
    cache = ("(num_pages, page_size, num_kv_heads, head_dim) (a paged cache: block_table given)"
             if paged else "(batch, max_seqlen, num_kv_heads, head_dim)")
    check_ndim(k, "k_cache", 4, cache)
    check_ndim(v, "v_cache", 4, cache)
    dt = check_dtype(q, "q")
    batch, q_len, num_heads, head_dim = q.shape if q.ndim == 4 else (q.shape[0], 1, *q.shape[1:])
    if kv_dtype is not None:  # fp8 codes; q (and out) 16-bit
        check_fp8_query(dt, head_dim, kv_dtype, "q", "q")
        for name, a in (("k_cache", k), ("v_cache", v)):
            check_fp8_cache(a, name, kv_dtype)
        k, v = _codes_view(k), _codes_view(v)
    else:
        for name, a in (("k_cache", k), ("v_cache", v)):
            if dtype_name(a.dtype) != dt:
                codes = ", or fp8 codes with kv_dtype='e4m3' or 'e5m2'" if a.itemsize == 1 else ""
                fail(TypeError, name, f"the dtype of q ({dt}){codes}", dtype_name(a.dtype))
    if not 1 <= q_len <= MAX_Q_LEN:
        fail(ValueError, "q", f"q_len (its second axis of four) in [1, {MAX_Q_LEN}]", q_len)
    check_head_dim(head_dim, dt, "q")
    kb, max_seqlen, num_kv_heads, kd = k.shape
    if paged:
        check_shape(k, "k_cache", (None, None, None, head_dim),
                    f"(num_pages, page_size, num_kv_heads, head_dim={head_dim}) to match q")
        if kb < 1 or max_seqlen < 1 or kb > MAX_TOKENS:
            fail(ValueError, "k_cache", f"at least one page of at least one token (and at most "
                 f"{MAX_TOKENS} pages)", f"shape {tuple(k.shape)}")
    else:
        check_shape(k, "k_cache", (batch, None, None, head_dim),
                    f"(batch={batch}, max_seqlen, num_kv_heads, head_dim={head_dim}) to match q")
    if max_seqlen > MAX_TOKENS:
        fail(ValueError, "k_cache", f"{'page_size' if paged else 'max_seqlen'} <= {MAX_TOKENS}",
             max_seqlen)
    if tuple(v.shape) != tuple(k.shape):
        fail(ValueError, "v_cache", f"the shape of k_cache {tuple(k.shape)}", tuple(v.shape))
    if num_heads < 1:
        fail(ValueError, "q", "num_heads >= 1", num_heads)
    if batch > MAX_BATCH:
        fail(ValueError, "q", f"batch <= {MAX_BATCH} (one grid row per sequence)", batch)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        fail(ValueError, "k_cache", f"num_kv_heads dividing num_heads={num_heads}", num_kv_heads)
    check_vector_layout(q, "q", tuple(range(q.ndim - 1)))
    check_vector_layout(k, "k_cache", (0, 1, 2))
    check_vector_layout(v, "v_cache", (0, 1, 2))
    check_same_device({"q": q, "k_cache": k, "v_cache": v})
    shape = dict(batch=batch, q_len=q_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    if paged:
        return q, k, v, dt, dict(shape, page_size=max_seqlen, num_pages=kb)
    return q, k, v, dt, dict(shape, max_seqlen=max_seqlen)


def check_block_table(block_table, batch: int, page_size: int, num_pages: int,
                      min_pages: int = 1, allow_host_array: bool = True):
    """``block_table`` of a paged cache: ``(device int32 array, row stride in elements,
    max_pages_per_seq)``. A device table's values are never read on the host (the kernel reads
    nothing for an index outside [0, num_pages)); a host table is range-checked, then copied.
    ``min_pages``: the pages per sequence a plan's max_seqlen needs. (Every entry of a host
    table must be a valid page index, those past a sequence's length too: the lengths may be
    on the device.)"""
    import cupy

    layout = f"({batch}, max_pages_per_seq >= {min_pages}) int32 (or int64)"

    def check_table_shape(arr):  # the same for host and device tables
        if arr.ndim != 2 or arr.shape[0] != batch or arr.shape[1] < min_pages:
            fail(ValueError, "block_table", f"shape {layout}", tuple(arr.shape))
    if isinstance(block_table, (list, tuple, np.ndarray)):
        if not allow_host_array:
            fail(TypeError, "block_table", f"a {layout} device array (a plan never copies from "
                 "the host)", type(block_table).__name__)
        arr = host_array(block_table, "block_table")
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            fail(TypeError, "block_table", "integers", f"dtype {arr.dtype}")
        check_table_shape(arr)
        if arr.size and (arr.min() < 0 or arr.max() >= num_pages):
            fail(ValueError, "block_table", f"page indices in [0, num_pages={num_pages})",
                 f"values in [{arr.min()}, {arr.max()}]")
        arr = cupy.asarray(arr, dtype=cupy.int32)
    else:
        arr = as_device_array(block_table, "block_table")
        if dtype_name(arr.dtype) not in ("int32", "int64"):
            fail(TypeError, "block_table", "dtype int32 or int64", dtype_name(arr.dtype))
        check_table_shape(arr)
        if arr.shape[1] > 1 and arr.strides[1] != arr.itemsize:
            fail(ValueError, "block_table", "rows contiguous (a column stride of 1 element)",
                 f"strides {tuple(arr.strides)} bytes")
        if arr.strides[0] < 0 or arr.strides[0] % arr.itemsize:
            fail(ValueError, "block_table", "a non-negative row stride", f"strides {tuple(arr.strides)} bytes")
        check_same_device({"block_table": arr})
    max_pages = int(arr.shape[1])
    if max_pages * page_size > MAX_TOKENS:
        fail(ValueError, "block_table", f"max_pages_per_seq × page_size <= {MAX_TOKENS}",
             f"{max_pages} × {page_size}")
    return arr, (arr.strides[0] // arr.itemsize if batch > 1 else 0), max_pages


def check_paged_cache(shape: dict, block_table, min_pages: int = 1,
                      allow_host_array: bool = True):
    """A paged cache's shape (:func:`check_decode_inputs`' dict, with ``page_size`` and
    ``num_pages``) and its ``block_table`` (:func:`check_block_table`): returns ``(shape,
    table, row stride, num_pages)``, the shape a new dict with ``max_seqlen`` =
    max_pages_per_seq × page_size in place of ``num_pages``."""
    shape = dict(shape)  # (the checks' cached dict stays as it is)
    num_pages = shape.pop("num_pages")
    table, bt_sb, max_pages = check_block_table(block_table, shape["batch"], shape["page_size"],
                                                num_pages, min_pages, allow_host_array)
    shape["max_seqlen"] = max_pages * shape["page_size"]
    return shape, table, bt_sb, num_pages


def check_lengths_fit(cache_seqlens, q_len: int, max_seqlen: int, appending: bool,
                      in_cache: bool) -> None:
    """Host-given lengths (None: every sequence holds max_seqlen; an int; a host sequence)
    against the query tokens. ``appending`` (k_new and v_new given): their q_len tokens are
    written at positions length … length + q_len − 1, which must lie below max_seqlen.
    ``in_cache`` (q_len > 1 tokens already in the cache): each query token is one of its
    sequence's last q_len tokens, so a length must be ≥ q_len; a length of 0 (an empty slot)
    passes, its rows attend nothing. Device lengths are never read: the kernel clamps them (a
    position at or past max_seqlen is not written; a shorter sequence's first query rows attend
    nothing). Values of the wrong type or range are left to :func:`check_seqlens`."""
    if not appending and not (in_cache and q_len > 1):
        return
    if cache_seqlens is None:  # (only appending asks anything of it: room for the new tokens)
        if not appending:
            return
        values = np.asarray([max_seqlen])
    elif isinstance(cache_seqlens, bool):
        return
    elif isinstance(cache_seqlens, numbers.Integral):
        values = np.asarray([int(cache_seqlens)])
    elif isinstance(cache_seqlens, (list, tuple, np.ndarray)):
        values = host_array(cache_seqlens, "cache_seqlens")
        if values.ndim != 1 or not values.size or not np.issubdtype(values.dtype, np.integer):
            return
    else:
        return
    if appending:
        most = int(values.max())
        if most + q_len > max_seqlen:
            tokens = "token" if q_len == 1 else f"{q_len} tokens"
            fail(ValueError, "cache_seqlens", f"lengths <= max_seqlen - {q_len} = "
                 f"{max_seqlen - q_len} (k_new/v_new's {tokens} written at positions "
                 "cache_seqlens[b] onwards must lie inside the cache)",
                 "None (every sequence full)" if cache_seqlens is None else f"a length of {most}")
        return
    values = values[values > 0]
    least = int(values.min()) if values.size else q_len
    if least < q_len:
        fail(ValueError, "cache_seqlens", f"lengths >= q_len={q_len} (the query tokens are each "
             f"sequence's last {q_len}, already in the cache)", f"a length of {least}")


def check_seqlens(cache_seqlens, batch: int, max_seqlen: int, allow_host_array: bool = True,
                  device: int | None = None):
    """Return ``(device_array_or_None, int_value)`` for the kernel's (seqlens, seqlen_all).

    A device array, int32 or int64 (torch's default integer type), is used as is (never read on
    the host; the kernel clamps each entry to [0, max_seqlen]). Host sequences are range-checked
    here, then copied to the device. ``device``: the current device where the caller knows it
    (a ``cupy.ndarray`` that passed is then remembered by its properties, as inputs are).
    """
    if cache_seqlens is None:
        return None, max_seqlen
    import cupy

    key = None
    if device is not None and type(cache_seqlens) is cupy.ndarray:
        key = (cache_seqlens.shape, cache_seqlens.strides, cache_seqlens.dtype,
               cache_seqlens.data.device_id, batch, device)
        if key in _SEQLENS_CHECKED:
            return cache_seqlens, max_seqlen
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return None, check_int(cache_seqlens, "cache_seqlens", 0, max_seqlen)
    if isinstance(cache_seqlens, (list, tuple, np.ndarray)):
        if not allow_host_array:
            fail(TypeError, "cache_seqlens", "None, an int or an int32/int64 device array of shape "
                 f"({batch},) (host arrays would need a copy, which a plan never makes)",
                 type(cache_seqlens).__name__)
        arr = host_array(cache_seqlens, "cache_seqlens")
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            fail(TypeError, "cache_seqlens", "integers", f"dtype {arr.dtype}")
        if arr.shape != (batch,):
            fail(ValueError, "cache_seqlens", f"shape ({batch},) (one length per sequence)", arr.shape)
        if arr.size and (arr.min() < 0 or arr.max() > max_seqlen):
            fail(ValueError, "cache_seqlens", f"lengths in [0, max_seqlen={max_seqlen}]",
                 f"values in [{arr.min()}, {arr.max()}]")
        return cupy.asarray(arr, dtype=cupy.int32), max_seqlen
    if isinstance(cache_seqlens, (bool, numbers.Number, str)):
        host = f" a host sequence of {batch} ints," if allow_host_array else ""
        fail(TypeError, "cache_seqlens", f"None, an int,{host} or a ({batch},) int32/int64 "
             "device array", f"{type(cache_seqlens).__name__} {cache_seqlens!r}")
    arr = as_device_array(cache_seqlens, "cache_seqlens")
    if dtype_name(arr.dtype) not in ("int32", "int64"):
        fail(TypeError, "cache_seqlens", "dtype int32 or int64", dtype_name(arr.dtype))
    if arr.shape != (batch,):
        fail(ValueError, "cache_seqlens", f"shape ({batch},) (one length per sequence)", tuple(arr.shape))
    if arr.size > 1 and arr.strides[0] != arr.itemsize:
        fail(ValueError, "cache_seqlens", "a contiguous array", f"stride {arr.strides[0]} bytes")
    check_same_device({"cache_seqlens": arr})
    if key is not None and len(_SEQLENS_CHECKED) < 64:
        _SEQLENS_CHECKED.add(key)
    return arr, max_seqlen


_SEQLENS_CHECKED: set = set()  # check_seqlens' device arrays that passed, by their properties


def new_key(x):
    """Every property of a new-token array that :func:`check_new_tokens` checks (shape, strides,
    dtype, pointer alignment, device), as a hashable key; None unless a ``cupy.ndarray``."""
    import cupy

    if type(x) is cupy.ndarray:
        return (x.shape, x.strides, x.dtype, x.data.ptr & 15, x.data.device_id)
    return None


_NEW_CHECKED: dict = {}


def new_token_strides(x) -> tuple[int, int, int]:
    """The split kernel's batch, token and head strides of a k_new/v_new array (3 dims: one
    token, stride 0), in elements."""
    es = x.itemsize
    return x.strides[0] // es, (x.strides[1] // es if x.ndim == 4 else 0), x.strides[-2] // es


def check_new_tokens(k_new, v_new, batch: int, num_kv_heads: int, head_dim: int, dtype: str,
                     q_len: int = 1):
    """``k_new``, ``v_new``: the new token of each sequence, to be written into the cache at
    position cache_seqlens[b] and attended (the split kernel reads and writes them). Each is
    (batch, 1, num_kv_heads, head_dim) or (batch, num_kv_heads, head_dim), of ``dtype`` (q's; a
    16-bit cache's too), on the
    current device, last dimension contiguous, base pointer and batch/head strides 16-byte aligned
    (rows are copied as 16-byte vectors); nothing is ever copied to make them so. Returns
    ``(k_new, v_new, (kn_sb, kn_ss, kn_sh, vn_sb, vn_ss, vn_sh))``, strides in elements. Inputs
    that passed are remembered by their :func:`new_key` (and the current device). With several
    query tokens (``q_len`` > 1, at most MAX_APPEND_Q_LEN), one new token per query token: each
    is (batch, q_len, num_kv_heads, head_dim)."""
    if q_len > MAX_APPEND_Q_LEN:
        name = "k_new" if k_new is not None else "v_new"
        fail(ValueError, name, f"None with q_len={q_len} query tokens (the call appends at most "
             f"{MAX_APPEND_Q_LEN}: write the draft tokens' K and V into the cache first, and "
             "pass cache_seqlens that count them)", "an array")
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        fail(ValueError, missing, f"a GPU array like {given} (appending takes both k_new and "
             "v_new, or neither)", "None")
    import cupy

    kk, vk = new_key(k_new), new_key(v_new)
    key = None
    if kk is not None and vk is not None:
        key = (kk, vk, batch, num_kv_heads, head_dim, dtype, q_len,
               cupy.cuda.runtime.getDevice())
        hit = _NEW_CHECKED.get(key)
        if hit is not None:
            return k_new, v_new, hit
    if q_len == 1:
        shapes = ((batch, 1, num_kv_heads, head_dim), (batch, num_kv_heads, head_dim))
        layout = (f"(batch={batch}, 1, num_kv_heads={num_kv_heads}, head_dim={head_dim}) or "
                  f"({batch}, {num_kv_heads}, {head_dim}) (one new token per sequence)")
    else:
        shapes = ((batch, q_len, num_kv_heads, head_dim),)
        layout = (f"(batch={batch}, q_len={q_len}, num_kv_heads={num_kv_heads}, "
                  f"head_dim={head_dim}) (one new token per query token)")
    arrays, strides = [], []
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        x = as_device_array(x, name)
        dt = dtype_name(x.dtype)
        if dt != dtype:
            fail(TypeError, name, f"dtype {dtype} (q's)", dt)
        if tuple(x.shape) not in shapes:
            fail(ValueError, name, f"shape {layout}", tuple(x.shape))
        check_vector_layout(x, name, (0, 1, 2) if q_len > 1 else (0, x.ndim - 2))
        check_same_device({name: x})
        arrays.append(x)
        strides += new_token_strides(x)
    strides = tuple(strides)
    if key is not None and len(_NEW_CHECKED) < 64:
        _NEW_CHECKED[key] = strides
    return arrays[0], arrays[1], strides


def check_out(out, name: str, shape: tuple, dtype: str):
    """A caller-provided output: right shape and dtype, C-contiguous, on the current device."""
    out = as_device_array(out, name)
    if dtype_name(out.dtype) != dtype:
        fail(TypeError, name, f"dtype {dtype}", dtype_name(out.dtype))
    if tuple(out.shape) != tuple(shape):
        fail(ValueError, name, f"shape {tuple(shape)}", tuple(out.shape))
    if not out.flags.c_contiguous:
        fail(ValueError, name, "a C-contiguous array", f"strides {tuple(out.strides)}")
    check_same_device({name: out})
    return out


def check_merge_sinks(sinks, rows_shape: tuple):
    """merge_states' ``sinks``: None, or float32 values whose shape is a trailing part of the
    rows' shape (broadcast from the right: row r takes sinks.flat[r % sinks.size]); host values
    are copied to the device. Returns a contiguous float32 device array or None."""
    import cupy

    if sinks is None:
        return None
    if isinstance(sinks, (list, tuple, np.ndarray)):
        arr = _host_finite(sinks, "sinks")
        shape = arr.shape
    else:
        arr = as_device_array(sinks, "sinks")
        if dtype_name(arr.dtype) != "float32":
            fail(TypeError, "sinks", "dtype float32", dtype_name(arr.dtype))
        check_same_device({"sinks": arr})
        shape = tuple(arr.shape)
    if not shape or len(shape) > len(rows_shape) or tuple(rows_shape[-len(shape):]) != shape:
        fail(ValueError, "sinks", f"a shape that ends the rows' shape {rows_shape} (e.g. "
             f"{rows_shape[-1:]}: one per last-axis row)", shape)
    return cupy.ascontiguousarray(cupy.asarray(arr, dtype=cupy.float32)).ravel()


def check_merge_inputs(o_parts, lse_parts):
    """Validate merge_states inputs; returns (o, lse, dtype) as device arrays."""
    o = as_device_array(o_parts, "o_parts")
    lse = as_device_array(lse_parts, "lse_parts")
    dt = check_dtype(o, "o_parts")
    if dtype_name(lse.dtype) != "float32":
        fail(TypeError, "lse_parts", "dtype float32", dtype_name(lse.dtype))
    if o.ndim < 2:
        fail(ValueError, "o_parts", "shape (num_states, *rows, head_dim) with at least 2 dims",
             tuple(o.shape))
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        fail(ValueError, "lse_parts", f"shape {tuple(o.shape[:-1])} (o_parts' shape without head_dim)",
             tuple(lse.shape))
    if o.shape[0] < 1 or o.shape[-1] < 1:
        fail(ValueError, "o_parts", "at least one state and head_dim >= 1", tuple(o.shape))
    check_same_device({"o_parts": o, "lse_parts": lse})
    return o, lse, dt


# ---------------------------------------------------------------- fp8 KV (kv_dtype, scales)

# (KV_DTYPES: the fp8 formats, _policy's)


def check_kv_dtype(kv_dtype) -> str:
    """``kv_dtype``: "e4m3" or "e5m2" (the fp8 formats of reference.FP8_FORMATS)."""
    if not isinstance(kv_dtype, str):
        fail(TypeError, "kv_dtype", " or ".join(map(repr, KV_DTYPES)),
             f"{type(kv_dtype).__name__} {kv_dtype!r}")
    if kv_dtype not in KV_DTYPES:
        fail(ValueError, "kv_dtype", " or ".join(map(repr, KV_DTYPES)), repr(kv_dtype))
    return kv_dtype


def check_attention_scales(kv_dtype, k_scale, v_scale, k_cache, num_kv_heads: int):
    """``k_scale``, ``v_scale`` of a call over ``k_cache``: :func:`check_kv_scales`'s result
    for an fp8 cache (``kv_dtype`` set; the scales' leading shape is the cache's first two
    axes), None without one (where scales must not be given)."""
    if kv_dtype is None:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is not None:
                fail(ValueError, name, "None without kv_dtype (scales belong to an fp8 cache: "
                     "kv_dtype='e4m3' or 'e5m2')", type(sc).__name__)
        return None
    return check_kv_scales(k_scale, v_scale, tuple(k_cache.shape[:2]), num_kv_heads)


def check_kv_scales(k_scale, v_scale, lead: tuple, num_kv_heads: int):
    """The scales of an fp8 cache for attention: ``(per_token, (k array or None, k float),
    (v array or None, v float))``; both per (token, KV head), or neither (the kernel takes the
    per-token scales of K and V from one place)."""
    k_mode, k_arr, k_all = check_kv_scale(k_scale, "k_scale", lead, num_kv_heads)
    v_mode, v_arr, v_all = check_kv_scale(v_scale, "v_scale", lead, num_kv_heads)
    if (k_mode == 3) != (v_mode == 3):
        name, other = ("v_scale", "k_scale") if k_mode == 3 else ("k_scale", "v_scale")
        fail(ValueError, name, f"a {(*lead, num_kv_heads)} float32 device array (per token and "
             f"KV head) like {other}: the two are per token together or not at all",
             "a float" if (v_mode if name == "v_scale" else k_mode) == 1 else "a per-head array")
    return k_mode == 3, (k_arr, k_all), (v_arr, v_all)


def check_kv_scale(scale, name: str, lead: tuple, num_kv_heads: int, allow_none: bool = False):
    """An fp8 cache's scale: ``(mode, device array or None, float)`` with mode 0 for None (where
    ``allow_none``: computed per (token, KV head)), 1 a positive finite float (per tensor), 2 a
    (num_kv_heads,) float32 device array (per KV head), 3 a float32 device array of shape
    ``lead`` + (num_kv_heads,), contiguous (per token and KV head). Device values are never
    read on the host."""
    per_token = (*lead, num_kv_heads)
    expected = (f"a float > 0, a ({num_kv_heads},) float32 device array (per KV head) or a "
                f"{per_token} float32 device array (per token and KV head)")
    if scale is None:
        if not allow_none:
            fail(ValueError, name, expected, "None")
        return 0, None, 1.0
    if isinstance(scale, bool):
        fail(TypeError, name, expected, repr(scale))
    if isinstance(scale, numbers.Real):
        s = float(scale)
        with np.errstate(over="ignore"):
            s32 = np.float32(s)
        if not (np.isfinite(s32) and s32 > 0):  # (the kernels use it as a float32)
            fail(ValueError, name, "a finite float > 0 (in float32: > 0 and ≤ 3.4028235e38)", s)
        return 1, None, s
    if isinstance(scale, (list, tuple, np.ndarray)):
        fail(TypeError, name, expected + " (host arrays are not copied: cupy.asarray them)",
             type(scale).__name__)
    arr = as_device_array(scale, name)
    if dtype_name(arr.dtype) != "float32":
        fail(TypeError, name, expected, f"dtype {dtype_name(arr.dtype)}")
    shape = tuple(arr.shape)
    if shape not in ((num_kv_heads,), per_token):
        fail(ValueError, name, expected, f"shape {shape}")
    if not arr.flags.c_contiguous:
        fail(ValueError, name, "a contiguous array", f"strides {arr.strides}")
    check_same_device({name: arr})
    return (2 if shape == (num_kv_heads,) else 3), arr, 1.0
