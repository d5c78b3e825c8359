"""FakeTensorMode with a cheaper dispatch-cache key, for a simulation's static shapes.

FakeTensorMode caches each op's output metadata under a key made from the op's arguments. Building that key
(`FakeTensorMode._prep_args_for_hash`: a chain of type checks per argument and a 17-field dataclass per
tensor, memory-format inference included) is about half of each dispatch in a simulated step; on a cache hit,
making the output FakeTensor (a ShapeEnv check per size and stride, `FakeTensor.__new__`'s argument checks and
descriptors) is most of the rest: `StaticKeyMode.dispatch` answers a hit on its own key in one pass. Without a
ShapeEnv every size is an int, and a strided tensor's key needs only its dtype, sizes, strides (which fix its
memory format), device, storage offset and size, and flags; `StaticKeyMode` builds that key directly for the
arguments simulated ops pass — this mode's fake tensors, numbers, strings, dtypes, devices, layouts and
memory formats, and lists or tuples of them — and hands any other call to FakeTensorMode's own key. The two
kinds of key never meet in the shared cache: this one starts with `STATIC`.

The outputs are FakeTensorMode's own (the same cache entries; on a hit the same meta tensor, storage and
FakeTensor attributes `_output_from_cache_entry` gives), so a
simulation gives the same figures with either key; `tests/test_simulate_fast.py` runs both and compares.
"""
from __future__ import annotations

import inspect
from logging import DEBUG
from typing import NamedTuple

import torch
from torch._subclasses import fake_tensor
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


UNCACHED = frozenset(getattr(fake_tensor, "_DISPATCH_META_HANDLERS", ())) | frozenset(
    getattr(fake_tensor, "_DISPATCH_HANDLE_DIRECTLY", ()))
"""Ops FakeTensorMode's dispatch answers before its cache."""

ValidEntry = getattr(fake_tensor, "_DispatchCacheValidEntry", None)
"""torch's cache entry type; a torch without it (private, may move) takes FakeTensorMode's own path on every op."""
Unmade = object()
"""`_from_entry`'s answer where FakeTensorMode's own path must make the output."""


class Meta(NamedTuple):
    """An output's meta tensor, made in kernel mode, and the device its FakeTensor reports."""

    elem: torch.Tensor
    device: torch.device


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
        try:
            return self._static_key(func, args, kwargs)
        except Unkeyed:
            return super()._cache_key(state, func, args, kwargs)

    def _static_key(self, func, args, kwargs) -> _DispatchCacheKey:
        key = [STATIC, func, torch.get_default_dtype(), torch._C._get_default_device(),
               torch.is_inference_mode_enabled(), get_proxy_mode() is not None]
        self._flat(key, args)
        if kwargs:
            key.append(len(kwargs))
            for name, value in kwargs.items():
                key.append(name)
                self._flat(key, (value,))
        return _DispatchCacheKey(tuple(key))

    def dispatch(self, func, types, args=(), kwargs=None):
        """A cache hit on a static key, answered in one pass (`_from_entry`); anything else — a miss, a bypass, an op
        FakeTensorMode serves before its cache, debug logging, a ShapeEnv — by FakeTensorMode's own dispatch."""
        kwargs = kwargs or {}
        if ValidEntry is not None and self.shape_env is None and self.cache_enabled \
                and not self.cache_crosscheck_enabled \
                and func not in UNCACHED and not fake_tensor.log.isEnabledFor(DEBUG) \
                and not fake_tensor.FakeTensorConfig.debug:
            try:
                entry = FakeTensorMode.cache.get(self._static_key(func, args, kwargs))
            except Unkeyed:
                entry = None
            if type(entry) is ValidEntry:
                out = self._from_entry(entry, func, args)
                if out is not Unmade:
                    FakeTensorMode.cache_hits += 1
                    return out
        return super().dispatch(func, types, args, kwargs)

    def _from_entry(self, entry, func, args):
        """FakeTensorMode's `_output_from_cache_entry` without a ShapeEnv: the same meta tensors, views of the same
        storages, wrapped with the same attributes `FakeTensor.__new__` gives (`_wrap`); `Unmade` for an output
        other than a plain strided CPU tensor (FakeTensorMode's own path makes it)."""
        view = isinstance(func, torch._ops.OpOverload) and func.is_view
        # torch's `in_kernel_invocation_manager`, its generator's frames spared (the meta kernels run on the meta
        # dispatch key, no mode or subclass dispatch, the mode marked in a kernel)
        if torch._C._meta_in_tls_dispatch_include() != self.in_kernel_invocation:
            return Unmade
        prev = self.in_kernel_invocation
        with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
            self.in_kernel_invocation = True
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                made = self._metas(entry, view, args)
            finally:
                self.in_kernel_invocation = prev
        if made is Unmade:
            return Unmade
        out = [self._wrap(t.elem, t.device) if type(t) is Meta else t for t in made]
        return tuple(out) if entry.is_output_tuple else out[0]

    def _metas(self, entry, view: bool, args) -> list:
        """Each output of a cache entry: an argument (in place), a constant, or a `Meta` to wrap."""
        made = []
        for info in entry.output_infos:
            m = info.metadata
            if info.inplace_idx is not None:
                arg = args[info.inplace_idx]
                if type(arg) is not FakeTensor:
                    return Unmade
                made.append(arg)
            elif m is None:
                if info.view_idx is None:
                    made.append(info.constant_value)
                else:
                    made.append(None)
            elif m.layout is not torch.strided or m.is_conj or m.is_neg or m.device.type != "cpu":
                return Unmade
            else:
                empty = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, layout=m.layout, device="meta",
                                            requires_grad=m.requires_grad)
                if view:
                    base = args[info.view_idx]
                    if type(base) is not FakeTensor:
                        return Unmade
                    empty.set_(base.untyped_storage(), m.storage_offset, m.shape, m.stride)
                made.append(Meta(empty, m.device))
        return made

    def _wrap(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """`FakeTensor(self, elem, device)` for a CPU device: its subclass made the same way and its attributes set
        from the first one made that way (`FakeTensor.__new__` sets each through descriptors and setters)."""
        t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        if not self._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(t)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        template = self.__dict__.get("_fake_attrs")
        if template is None:
            template = self._fake_attrs = dict(FakeTensor(self, torch.empty(0, device="meta"), device).__dict__)
        t.__dict__.update(template)
        t._fake_device = device
        return t

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
