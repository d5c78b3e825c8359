"""FakeTensorMode with a cheaper dispatch-cache key, for a simulation's static shapes.

FakeTensorMode caches each op's output metadata under a key made from the op's arguments. Building that key
(`FakeTensorMode._prep_args_for_hash`: a chain of type checks per argument and a 17-field dataclass per
tensor, memory-format inference included) is about half of each dispatch in a simulated step. Without a
ShapeEnv every size is an int, and a strided tensor's key needs only its dtype, sizes, strides (which fix its
memory format), device, storage offset and size, and flags; `StaticKeyMode` builds that key directly for the
arguments simulated ops pass — this mode's fake tensors, numbers, strings, dtypes, devices, layouts and
memory formats, and lists or tuples of them — and hands any other call to FakeTensorMode's own key. The two
kinds of key never meet in the shared cache: this one starts with `STATIC`.

The outputs are FakeTensorMode's own (the same cache entries, the same output construction), so a
simulation gives the same figures with either key; `tests/test_simulate_fast.py` runs both and compares.
"""
from __future__ import annotations

import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode

try:  # torch's private cache key: checked, not assumed, on another torch than the pinned one
    from torch._subclasses.fake_tensor import _DispatchCacheKey

    KEYABLE = list(inspect.signature(FakeTensorMode._cache_key).parameters) == ["self", "state", "func", "args",
                                                                                 "kwargs"]
except ImportError:
    KEYABLE = False
"""Whether this torch's FakeTensorMode has the cache-key hook `StaticKeyMode` overrides (else `fake_mode` gives
FakeTensorMode's own key: the same figures, slower)."""

STATIC = "shardwise static key"
"""First element of every key this mode builds (FakeTensorMode's own keys start with the op)."""

PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
"""Argument types whose (type, value) is their key, as in FakeTensorMode's own."""


class Unkeyed(Exception):
    """An argument this key does not describe: FakeTensorMode's own key decides."""


class StaticKeyMode(FakeTensorMode):
    """FakeTensorMode whose cache key is built in one pass for static shapes (module docstring)."""

    __torch_dispatch__ = inspect.unwrap(FakeTensorMode.__dict__["__torch_dispatch__"])
    """FakeTensorMode's own, without the Dynamo-disabling and call-counting wrappers torch puts around it (two Python
    frames and an eval-frame swap per op; a simulation compiles nothing: simulate refuses --compile)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # keeps `__torch_dispatch__` above unwrapped (TorchDispatchMode.__init_subclass__)

    def _cache_key(self, state, func, args, kwargs):
        if self.shape_env is not None:
            return super()._cache_key(state, func, args, kwargs)
        key = [STATIC, func, torch.get_default_dtype(), torch._C._get_default_device(),
               torch.is_inference_mode_enabled(), get_proxy_mode() is not None]
        try:
            self._flat(key, args)
            if kwargs:
                key.append(len(kwargs))
                for name, value in kwargs.items():
                    key.append(name)
                    self._flat(key, (value,))
        except Unkeyed:
            return super()._cache_key(state, func, args, kwargs)
        return _DispatchCacheKey(tuple(key))

    def _flat(self, key: list, args) -> None:
        """Append each argument's self-delimiting description to `key`."""
        for a in args:
            kind = type(a)
            if kind is FakeTensor:
                if a.fake_mode is not self or a.constant is not None or a.layout is not torch.strided:
                    raise Unkeyed
                key.append(FakeTensor)
                key.append((a.dtype, tuple(a.shape), a.stride(), a.device, a.storage_offset(),
                            a.untyped_storage().nbytes(), a.requires_grad, a.is_quantized, a.is_conj(), a.is_neg(),
                            a.is_inference()))
            elif kind in PLAIN:
                key.append(kind)
                key.append(a)
            elif kind is list or kind is tuple:
                key.append(kind)
                key.append(len(a))
                self._flat(key, a)
            else:
                raise Unkeyed


def fake_mode(fast: bool) -> FakeTensorMode:
    """The simulation's fake mode: `StaticKeyMode` when `fast` and this torch has its hook."""
    return StaticKeyMode() if fast and KEYABLE else FakeTensorMode()
