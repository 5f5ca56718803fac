"""A stand-in GPU for the rehearsal: torch's PrivateUse1 device renamed "gpu", whose tensors exist
only under FakeTensorMode (shapes, dtypes, devices; no storage).

Why not fake CUDA tensors: a CPU-only torch has no CUDA device guard, and Tensor.copy_ (and FSDP2's
streams) need one; PrivateUse1 takes a device guard written in Python. So the rank code runs with
its device set to "gpu:N" and keeps every GPU-path property the rehearsal checks: a tensor on the
"gpu" and one on the CPU in the same op raise (a device mix-up), host copies are real copies (the
checkpoint, the fragments, the publish buffers are counted as host memory), and FSDP2 sees a device
with streams. What differs from CUDA, and how the rehearsal makes up for it:
- torch.cuda.* is not called (the code checks `device.startswith("cuda")`); the rehearsal applies
  the CUDA-only choices itself (the compute plane is NCCL-like: tensors/groups.py).
- Autocast: the CUDA autocast policy (ATen/autocast_mode.h's lists: lower precision for matmuls,
  convolutions and attention, float32 for norms, softmax, exp, pow, sums; widest type for the
  "promote" list) is registered for the stand-in device below. Its weight cache (bf16 copies of
  fp32 leaf weights kept for the autocast region) is not: each use casts again, and the cast a
  matmul saves for backward lives as long as on CUDA.
- Attention: torch picks an SDPA kernel per device type in C++, and for a device it does not know
  the math path, which holds the whole [S, S] score matrix (a 1024 px FLUX fragment: tens of GiB
  per layer). On the stand-in device F.scaled_dot_product_attention calls the kernel CUDA would
  pick (`sdp_choice`; cuDNN attention is off: runtime.device_of): flash attention for fp16 / bf16
  without a mask and head dim <= 256, else memory-efficient attention; both keep O(S) memory, and
  their fake (meta) kernels give the outputs and the log-sum-exp their backward keeps.
- torch's fused AdamW takes only CPU and CUDA tensors, so trainer.fused_adamw_ok says foreach here;
  the memory of the update is the same as fused on CUDA once DTensor's sharding propagation is not
  counted (memory.py).
"""
from __future__ import annotations

import contextlib
import threading

import torch

NAME = "gpu"
_installed = threading.Lock()
_done = []

LOWER = ["_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
         "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
         "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
         "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
         "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"]
FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "cosine_similarity", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "binary_cross_entropy_with_logits", "dist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
        "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d"]
FP32_SET_DTYPE = ["prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                  "linalg_vector_norm", "sum", "sum.dim_IntList"]
PROMOTE = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put",
           "tensordot", "scatter_add"]


class _Stream:
    """FSDP2 orders its all-gathers and reduce-scatters with streams and events: on one stand-in
    device with fake tensors there is nothing to order."""

    def __init__(self, *args, **kwargs):
        self.device = None

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Module:
    """torch.gpu: what FSDP2 and autocast ask of a device module."""

    Stream, Event = _Stream, _Event
    _current = _Stream()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_stream(device=None):
        return _Module._current

    @staticmethod
    def default_stream(device=None):
        return _Module._current

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]


def install() -> None:
    """Register the stand-in device and its autocast policy (once per process: PrivateUse1 can be
    renamed only once)."""
    with _installed:
        if _done:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module)
        _register_autocast()
        F = torch.nn.functional
        F.scaled_dot_product_attention = _attention(F.scaled_dot_product_attention)
        _done.append(True)


def sdp_choice(query: torch.Tensor, attn_mask) -> int:
    """The SDPA backend CUDA would choose for these inputs (torch._C._SDPBackend values)."""
    flash = (query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None
             and query.shape[-1] <= 256)
    return int(torch._C._SDPBackend.FLASH_ATTENTION if flash
               else torch._C._SDPBackend.EFFICIENT_ATTENTION)


def _attention(original):
    flash, efficient = (torch.ops.aten._scaled_dot_product_flash_attention.default,
                        torch.ops.aten._scaled_dot_product_efficient_attention.default)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != NAME or enable_gqa:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if torch.is_autocast_enabled("privateuseone"):  # the kernels' inputs in the autocast dtype
            dtype = torch.get_autocast_dtype("privateuseone")
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if sdp_choice(query, attn_mask) == int(torch._C._SDPBackend.FLASH_ATTENTION):
            return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return efficient(query, key, value, attn_mask, grad, dropout_p, is_causal,
                         scale=scale)[0]
    return scaled_dot_product_attention


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == NAME


def _cast(value, dtype):
    """CUDA autocast's cached_cast without the cache: a floating tensor on the device to `dtype`."""
    if _on_device(value) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _kernel(op, policy: str):
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            flat = [a for a in (*args, *kwargs.values()) if _on_device(a)]
            if policy == "lower":
                dtype = torch.get_autocast_dtype("privateuseone")
            elif policy == "promote":
                floats = [a.dtype for a in flat if a.is_floating_point()]
                dtype = floats and max(floats, key=lambda d: torch.finfo(d).bits)
            else:
                dtype = torch.float32
            if policy == "fp32_set_dtype":
                lower = any(a.is_floating_point() and a.dtype != torch.float32 for a in flat)
                if lower and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if dtype:
                args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return kernel


def _register_autocast() -> None:
    lib = torch.library.Library("aten", "IMPL")
    for policy, names in (("lower", LOWER), ("fp32", FP32), ("fp32_set_dtype", FP32_SET_DTYPE),
                          ("promote", PROMOTE)):
        for name in names:
            base, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
            lib.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _done.append((lib, fallback))  # a Library unregisters its kernels when collected
