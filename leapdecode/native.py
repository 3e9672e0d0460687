"""C++ kernels for the CPU, compiled at first use: one module (:func:`kernels`) from the sources of
attention/cpu_exact.py, model/cpu_ops.py, model/packed_linear.py and model/cpu_layer.py.

Built with ``torch.utils.cpp_extension.load_inline`` (g++ and ninja, ``-O3 -march=native``) and cached under
``TORCH_EXTENSIONS_DIR`` by source, flags, this CPU's instruction-set flags and the torch version, so a cache
shared between machines never hands one machine another's instructions (~30 s the first time). Where that fails
(no compiler, no ninja) or ``LEAPDECODE_NO_CPU_KERNELS=1`` is set, :func:`build` returns None and callers keep
their PyTorch path. ``LEAPDECODE_CPU_ISA=avx2`` builds without AVX-512 on a machine that has it (the AVX2 forms:
tests compare their bits with the AVX-512 ones').
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from typing import Sequence


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(name: str, source: str, functions: Sequence[str] | None, flags: Sequence[str] = ()):
    """The compiled module of ``source`` exposing ``functions``, or None where it cannot be built. With
    ``functions=None`` the source declares its own bindings (``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``).

    With ``-fopenmp``: ``at::parallel_for`` is a header template that runs its loop on PyTorch's OpenMP threads
    only when the caller is compiled with OpenMP; without it every kernel ran on one thread (measured: a weight
    stream at 12 GB/s on one core of the 2-core VM, 21 GB/s on both). The extension then needs ``libgomp.so.1``,
    the soname PyTorch's own OpenMP runtime is loaded under, so both share one thread pool."""
    if os.environ.get("LEAPDECODE_NO_CPU_KERNELS"):
        return None
    import torch
    cflags = ["-O3", "-march=native", "-fopenmp", *flags]
    if os.environ.get("LEAPDECODE_CPU_ISA") == "avx2":
        cflags.append("-mno-avx512f")
    key = hashlib.sha1((source + " ".join(cflags) + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load_inline
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_inline(name=f"leapdecode_{name}_{key}", cpp_sources=source,
                               functions=None if functions is None else list(functions),
                               extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception:       # no toolchain, or a build error: the caller's PyTorch path serves
        return None


@functools.lru_cache(maxsize=1)
def kernels():
    """The CPU kernels (exact paged attention, RMSNorm and rotary embedding, the row kernel, the one-call decoder
    layer) compiled together, or None where they cannot be. One module, so the one-call layer runs the very machine
    code the layer-by-layer path runs and their results are the same bits (model/cpu_layer.py). Products, norms
    and the rotary embedding compile without contracting a multiply and an add into one rounding
    (``-ffp-contract=off``: the row kernel's FMA chain is explicit, and the rotary embedding matches PyTorch's
    bits); the attention kernel, whose results only need to be its own, with it (its exponentials' polynomial)."""
    from leapdecode.attention import cpu_exact, cpu_sparse
    from leapdecode.model import cpu_layer, cpu_ops, packed_linear
    source = "\n".join([cpu_ops._SOURCE, '#pragma GCC push_options\n#pragma GCC optimize ("fp-contract=fast")',
                        cpu_exact._SOURCE, cpu_sparse._SOURCE, "#pragma GCC pop_options", packed_linear._SOURCE,
                        cpu_layer._SOURCE])
    return build("cpu_kernels", source, ["rms_norm", "rope_", "paged_attention", "paged_attention_slots",
                                         "paged_attention_quantized", "top_k_attention",
                                         "top_k_attention_quantized", "rows_supported", "rows_wide", "rows_linear",
                                         "rows_linear_int8", "rows_linear_grid", "a8_supported", "rows_linear_a8",
                                         "decoder_layer", "layer_stack_new", "layer_stack_free",
                                         "layer_stack_run"],
                 flags=["-ffp-contract=off"])


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all``), so that the one thread that
    runs the model afterwards is the only one holding a pool. Returns whether a pool could be released.

    Why: GNU OpenMP (the runtime PyTorch's CPU wheels load) keeps a pool of worker threads per thread that ever ran
    a parallel region, and once all pools together hold more threads than the machine has CPUs it stops spinning
    at its barriers and waits in the kernel instead: every parallel region's fork and join then costs a system
    call. A decode step runs ~150 of them (each linear and attention call of the CPU kernels), so a second thread
    that ever ran a parallel PyTorch op - the thread that loaded the model, while another one steps the engine -
    made every step of the process ~2.6x slower from then on (the server: 32-38 tokens/s instead of ~100 for the
    default model on the 2-core VM). Call it in a thread that is done with the model (the server calls it in
    the thread that built the engine before its engine thread starts); a later parallel op in that thread makes
    a new pool."""
    import ctypes
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)   # only the runtime already loaded, if any
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0        # omp_pause_soft


__all__ = ["build", "kernels", "release_openmp_threads"]
