"""The IMPALA ResNet's convolution and max pool, and the Nature CNN's strided convolutions, for XLA:CPU, with the same
values and gradients as flax's, and fast inside loops.

The training scripts' networks use them only when JAX runs on the CPU; on accelerators they use nn.Conv and
nn.max_pool as they are. tests/test_xla_cpu.py checks both against flax. What each replaces and its speed against
XLA:CPU's own: docs/performance.md, the ResNet update on XLA:CPU.

- conv_general_dilated: a convolution whose forward, input gradient and weight gradient are the C++ kernels of
  cleanba/cpu_kernels.cc (XLA FFI custom calls), built here on first use (cpu_kernels below); a strided one is
  folded into a stride-1 one first (strided). XLA:CPU's Eigen
  convolutions are slow on the first convolution's 4 input channels, and run a weight gradient on one thread after
  moving both operands into a batch-innermost layout.
  Without the kernels (no C++ compiler), the two gradients are convolutions written in the layout Eigen wants (batch
  first, features last, an HWIO kernel): XLA:CPU transposes other convolutions into it only in the entry
  computation, not inside a loop's body (jax issue 12868), so lax's own gradients inside lax.scan fall back to a
  naive kernel, and unrolled loops keep every step's buffers alive at once (openxla/xla issue 35719). Either way the
  loops stay rolled and memory follows the minibatch.
- max_pool: nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME") without XLA:CPU's slow select_and_scatter. Its
  gradient, bitwise select_and_scatter's, is the C++ kernel of cpu_kernels.cc where it is built, else the same
  routing in jax.numpy (slower than the kernel: it recomputes each window's maximum for every position the window
  covers).
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import partial, reduce
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EIGEN_LAYOUT = ("NHWC", "HWIO", "NHWC")
KERNEL_SOURCE = Path(__file__).with_name("cpu_kernels.cc")
KERNELS = {  # custom call target: the symbol of its handler in cpu_kernels.cc
    "cleanba_conv": "CleanbaConv",
    "cleanba_conv_weight_gradient": "CleanbaConvWeightGradient",
    "cleanba_max_pool_gradient": "CleanbaMaxPoolGradient",
}
# CLEANBA_CPU_KERNELS=xla keeps XLA's convolutions and the max-pool gradient written in jax.numpy, e.g. to compare.
KERNEL_SWITCH = "CLEANBA_CPU_KERNELS"
kernel_lock = threading.Lock()
kernel_state: dict = {}


def cpu_kernels() -> str:
    """Builds and registers cleanba/cpu_kernels.cc once per process; says whether the CPU network uses them, or why not.

    The library is compiled for this machine's CPU (-march=native) with the C++ compiler in $CXX (default c++),
    against the XLA FFI headers of the installed jaxlib, and cached under $CLEANBA_CACHE (default
    ~/.cache/cleanba) by a hash of everything that decides its code: the source, compiler, flags, jaxlib and the
    CPU's model and features, so that nodes of another CPU sharing a home directory build their own. Processes that
    build at the same time each write a temporary file and move it into place whole."""
    with kernel_lock:
        if "status" not in kernel_state:
            kernel_state["status"] = build_and_register()
            print(f"XLA:CPU kernels of the ResNet (cleanba/cpu_kernels.cc): {kernel_state['status']}", flush=True)
        return kernel_state["status"]


def kernel_ready() -> bool:
    return cpu_kernels().startswith("native")


def cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(sorted(set(wanted))) or platform.machine()


def build_and_register() -> str:
    if os.environ.get(KERNEL_SWITCH, "native") == "xla":
        return f"XLA's ({KERNEL_SWITCH}=xla)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"XLA's (no C++ compiler {compiler!r} on PATH; install one, e.g. g++, or set CXX)"
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir()]
    try:
        compiler_version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"XLA's ({compiler} --version failed: {error})"
    key = hashlib.sha256(
        "\0".join(
            [KERNEL_SOURCE.read_text(), compiler_version, " ".join(flags[:-1]), version("jaxlib"), cpu_identity()]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("CLEANBA_CACHE", Path.home() / ".cache" / "cleanba"))
    library = cache / f"cpu_kernels-{key}.so"
    if not library.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as scratch:
                built = Path(scratch) / library.name
                result = subprocess.run(
                    [compiler, *flags, str(KERNEL_SOURCE), "-o", str(built)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if result.returncode != 0:
                    first_error = next((line for line in result.stderr.splitlines() if "error" in line), "")
                    return f"XLA's (building {KERNEL_SOURCE.name} with {compiler} failed: {first_error.strip()})"
                os.replace(built, library)
        except (OSError, subprocess.SubprocessError) as error:
            return f"XLA's (could not build {KERNEL_SOURCE.name} into {cache}: {error}; set CLEANBA_CACHE)"
    loaded = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in KERNELS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu")
    return f"native ({library})"


def conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    **kwargs,
):
    """jax.lax.conv_general_dilated, with the gradients below for NHWC inputs and HWIO kernels (as nn.Conv passes
    them), no dilation, no feature groups: stride 1 as the IMPALA ResNet, other strides as the Nature CNN (strided);
    anything else unchanged."""
    plain = (
        all(d in (None, 1, (1, 1)) for d in (lhs_dilation, rhs_dilation))
        and feature_group_count == 1
        and not kwargs
        and lhs.ndim == 4
        and jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        == jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, EIGEN_LAYOUT)
    )
    if not plain:
        return jax.lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            precision=precision,
            **kwargs,
        )
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    padding = tuple(tuple(int(p) for p in pair) for pair in padding)
    if tuple(window_strides) != (1, 1):
        lhs, rhs, padding = strided(lhs, rhs, tuple(window_strides), padding)
    if lhs.dtype == rhs.dtype == jnp.bfloat16:  # as a GPU: bfloat16 in and out, accumulated in float32
        return eigen_conv(lhs.astype(jnp.float32), rhs.astype(jnp.float32), padding, precision).astype(jnp.bfloat16)
    return eigen_conv(lhs, rhs, padding, precision)


def strided(x, kernel, strides, padding):
    """The operands of a stride-1 convolution equal to the strided one (space to depth): y[o] = sum_j x[s o + j] k[j]
    = sum_a sum_b x[s (o + a) + b] k[s a + b], b < s, along each spatial axis. Each s x s block of x's pixels becomes
    one pixel of s * s * features, and the kernel, zero-padded to a multiple of s, folds the same way."""
    folded = [-(-k // s) for k, s in zip(kernel.shape[:2], strides)]  # the kernel's size in blocks
    out = [
        (size + lo + hi - k) // s + 1 for size, (lo, hi), k, s in zip(x.shape[1:3], padding, kernel.shape[:2], strides)
    ]
    # pad (or crop) each axis to the (out - 1 + folded) blocks that the output reads
    ends = [(o - 1 + f) * s - size - lo for o, f, s, size, (lo, _) in zip(out, folded, strides, x.shape[1:3], padding)]
    pads = [(0, 0, 0), *[(lo, end, 0) for (lo, _), end in zip(padding, ends)], (0, 0, 0)]
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), pads)
    kernel = jnp.pad(kernel, [(0, f * s - k) for f, s, k in zip(folded, strides, kernel.shape[:2])] + [(0, 0)] * 2)
    (sh, sw), (n, h, w, c), o = strides, x.shape, kernel.shape[3]
    x = x.reshape(n, h // sh, sh, w // sw, sw, c).transpose(0, 1, 3, 2, 4, 5).reshape(n, h // sh, w // sw, sh * sw * c)
    kernel = kernel.reshape(folded[0], sh, folded[1], sw, c, o).transpose(0, 2, 1, 3, 4, 5)
    return x, kernel.reshape(*folded, sh * sw * c, o), ((0, 0), (0, 0))


def native(padding, *arrays) -> bool:
    """Whether cpu_kernels.cc computes this: float32, non-negative padding, and the kernels built."""
    return all(a.dtype == jnp.float32 for a in arrays) and min(min(pair) for pair in padding) >= 0 and kernel_ready()


def kernel_call(target: str, shape, *arrays, **attributes):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32), vmap_method="sequential")
    return call(*arrays, **{name: np.int64(value) for name, value in attributes.items()})


def conv(x, kernel, padding, precision):
    """The stride-1 NHWC x HWIO convolution: the kernel of cpu_kernels.cc where it is built, else Eigen's."""
    if native(padding, x, kernel):
        (lo_h, hi_h), (lo_w, hi_w) = padding
        shape = (
            x.shape[0],
            x.shape[1] + lo_h + hi_h - kernel.shape[0] + 1,
            x.shape[2] + lo_w + hi_w - kernel.shape[1] + 1,
        )
        return kernel_call("cleanba_conv", (*shape, kernel.shape[3]), x, kernel, lo_h=lo_h, lo_w=lo_w)
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=EIGEN_LAYOUT, precision=precision)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def eigen_conv(x, kernel, padding, precision):
    """A stride-1 NHWC x HWIO convolution whose gradients are stride-1 NHWC x HWIO convolutions too."""
    return conv(x, kernel, padding, precision)


def eigen_conv_forward(x, kernel, padding, precision):
    return conv(x, kernel, padding, precision), (x, kernel)


def eigen_conv_backward(padding, precision, residuals, dy):
    # y[o] = sum_j x[o + j - lo] k[j] along each spatial axis (lo, hi: the padding, K: the kernel size), so
    # dx[i] = sum_j dy[i + j - (K - 1 - lo)] k[K - 1 - j]: dy convolved with the flipped kernel, in and out features
    # swapped, padded (K - 1 - lo, K - 1 - hi); and dk[j] = sum_o x[o + j - lo] dy[o] (weight_gradient).
    x, kernel = residuals
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
    dx = conv(dy, flipped, [(k - 1 - lo, k - 1 - hi) for k, (lo, hi) in zip(kernel.shape[:2], padding)], precision)
    return dx, weight_gradient(x, dy, kernel, padding, precision)


def weight_gradient(x, dy, kernel, padding, precision):
    """dk[j] = sum_o x[o + j - lo] dy[o] along each spatial axis, summed over the batch: the kernel of
    cleanba/cpu_kernels.cc where it is built (native), else a convolution in Eigen's layout."""
    if native(padding, x, dy, kernel):
        (lo_h, _), (lo_w, _) = padding
        return kernel_call("cleanba_conv_weight_gradient", kernel.shape, x, dy, lo_h=lo_h, lo_w=lo_w)
    # x convolved with dy as the kernel, the input features as the batch and the batch as the features
    dk = conv(x.transpose(3, 1, 2, 0), dy.transpose(1, 2, 0, 3), padding, precision)  # (in, K, K, out)
    return dk.transpose(1, 2, 0, 3)


eigen_conv.defvjp(eigen_conv_forward, eigen_conv_backward)


def pool_windows(x):
    """The 9 strided views of a 3x3, stride-2, SAME max pool over NHWC x (padded with -inf), and the padding."""
    out_h, out_w = -(-x.shape[1] // 2), -(-x.shape[2] // 2)
    pad_h, pad_w = 2 * out_h + 1 - x.shape[1], 2 * out_w + 1 - x.shape[2]
    pads = ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    x = jnp.pad(x, pads, constant_values=-jnp.inf)
    return [x[:, i : i + 2 * out_h : 2, j : j + 2 * out_w : 2] for i in range(3) for j in range(3)], pads


def interleave(even, odd, axis: int):
    """e0 o0 e1 o1 ... en along axis, from even (n + 1 long) and odd (n long)."""
    both = jnp.stack([even, jnp.pad(odd, [(0, int(a == axis)) for a in range(odd.ndim)])], axis=axis + 1)
    shape = list(even.shape)
    shape[axis] *= 2
    return jax.lax.slice_in_dim(both.reshape(shape), 0, shape[axis] - 1, axis=axis)


@jax.custom_vjp
def max_pool(x):
    """The maxima of every 3x3 window at stride 2 (SAME padding), with the custom gradient below."""
    return reduce(jnp.maximum, pool_windows(x)[0])


def max_pool_forward(x):
    y = max_pool(x)
    return y, (x, y)


def max_pool_backward(residuals, dy):
    # Like select_and_scatter, each window's gradient goes to its first maximum in row-major order. Padded input
    # row 2m gets shares from window rows m - 1 (offset 2) and m (offset 0), row 2m + 1 from window row m
    # (offset 1), and likewise for columns; shares are added in row-major window order, as XLA adds them, so the
    # sums round the same way.
    x, y = residuals
    if x.dtype == dy.dtype == jnp.bfloat16 and kernel_ready():  # the same routing; the shares summed in float32
        x, y, dy = (a.astype(jnp.float32) for a in (x, y, dy))
        return (kernel_call("cleanba_max_pool_gradient", x.shape, x, y, dy).astype(jnp.bfloat16),)
    if native([(0, 0)], x, dy):
        return (kernel_call("cleanba_max_pool_gradient", x.shape, x, y, dy),)
    windows, pads = pool_windows(x)
    first = reduce(jnp.minimum, [jnp.where(window == y, k, 9) for k, window in enumerate(windows)])
    share = [jnp.where(first == k, dy, 0.0) for k in range(9)]  # share[3 * row offset + column offset]

    def place(k, rows, cols):  # (1, 0): offset 2 lands one window later; (0, 1): offset 0
        return jnp.pad(share[k], ((0, 0), rows, cols, (0, 0)))

    late, early, none = (1, 0), (0, 1), (0, 0)
    even_even = place(8, late, late) + place(6, late, early) + place(2, early, late) + place(0, early, early)
    even_odd = place(7, late, none) + place(1, early, none)
    odd_even = place(5, none, late) + place(3, none, early)
    dx = interleave(interleave(even_even, even_odd, 2), interleave(odd_even, share[4], 2), 1)
    return (dx[:, pads[1][0] : pads[1][0] + x.shape[1], pads[2][0] : pads[2][0] + x.shape[2]],)


max_pool.defvjp(max_pool_forward, max_pool_backward)
