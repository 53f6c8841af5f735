"""Peak memory and FLOPs of the real kvshot code at any shapes, on a CPU, without weights.

`ShapeMeter` is a dispatch mode under which every floating-point tensor is fake (shape,
dtype and strides, no data, no memory: `FakeTensorMode`) while integer and bool tensors
(token ids, masks, anchors, packed rows) stay real and small. The code's data-dependent
steps (`.item()`, `nonzero`, `tolist`, the packed-row bookkeeping) therefore compute on the
real masks the meter is given, not on guesses; only a value read from a fake float tensor
(an argmax of fake logits, a loss) has no data, and gets the worst case (`worst_scalar`,
`nonzero`: every element).

It counts, per op output, the bytes of each new storage (real or fake) until the storage is
freed: `live` and `peak` are what a caching-free allocator would hold, a lower bound on a
CUDA run's reserved memory (no allocator rounding or fragmentation). FLOPs (`flops`) come
from `torch.utils.flop_counter`'s formulas per op (matmuls, convolutions, attention kernels;
elementwise ops are not counted, as MFU conventions do not count them); its FlopCounterMode
is not used: its module hooks fail on some block drafters' graphs.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
# ops that read a fake tensor's value: answered by the worst case (`ShapeMeter._worst`), never
# decomposed (under inference_mode item and is_nonzero arrive whole, composite as they are)
READS_A_VALUE = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default)
GB = 1e9   # reports are in GB of 10^9 bytes


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)
def _cpu_flash_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU flash kernel (the drafters' `flash_cpu` backend): dense over the keys it is given."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)
def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def worst_scalar(t: torch.Tensor):
    """The value `.item()` returns for a fake tensor: a condition holds (True), a count or a
    float is 0 (an argmax of fake logits: token 0, which is always a valid id)."""
    if t.dtype == torch.bool:
        return True
    return 0 if not t.dtype.is_floating_point else 0.0


class ShapeMeter(TorchDispatchMode):
    """Float tensors fake, integer/bool tensors real; live and peak bytes of every storage the
    enclosed code allocates (`live`, `peak`) and the FLOPs of its ops (`flops`)."""

    def __init__(self):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.live = 0
        self.peak = 0
        self._bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.flops = 0
        self.worst_cases: dict[str, int] = {}   # data-dependent ops answered by the worst case

    # ------------------------------------------------------------ memory
    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _track(self, out) -> None:
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st in self._bytes:
                continue
            n = st.nbytes()
            self._bytes[st] = n
            weakref.finalize(st, self._free, n)
            self.live += n
            self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live

    def track(self, *tensors) -> None:
        """Count tensors made outside the meter (none are, if everything is built under it)."""
        self._track(list(tensors))

    # ------------------------------------------------------------ dispatch
    def _worst(self, func, args):
        self.worst_cases[str(func)] = self.worst_cases.get(str(func), 0) + 1
        if func is aten.is_nonzero.default:   # bool(t): a condition holds
            return True
        if func in (aten._local_scalar_dense.default, aten.item.default):
            return worst_scalar(args[0])
        x = args[0]   # nonzero: every element is nonzero
        with self.fake:
            return torch.empty(x.numel(), x.dim(), dtype=torch.long)

    def _worst_index(self, args):
        """x[mask] for a mask read from fake floats: every element selected (the worst case),
        as an index of all positions (a 1-D mask over one dim; others are not needed yet)."""
        x, indices = args[0], list(args[1])
        self.worst_cases["aten.index.Tensor (bool mask)"] = self.worst_cases.get("aten.index.Tensor (bool mask)", 0) + 1
        for d, i in enumerate(indices):
            if isinstance(i, FakeTensor) and i.dtype == torch.bool:
                if i.dim() != 1:
                    raise NotImplementedError(f"ShapeMeter: a {i.dim()}-D mask read from fake floats")
                indices[d] = torch.arange(i.shape[0])
        with self.fake:
            return aten.index.Tensor(x, indices)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten" and func not in READS_A_VALUE and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            # under inference_mode composite ops (linear, matmul, item) arrive whole: run their
            # decomposition through the meter, so its matmuls are counted and its scalars seen
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        faked = any(isinstance(x, FakeTensor) for x in tensors)
        if faked and func in READS_A_VALUE:
            out = self._worst(func, args)
        elif faked and func is aten.index.Tensor and any(
                isinstance(i, FakeTensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            out = self._worst_index(args)
        elif faked:
            with self.fake:
                out = func(*args, **kwargs)
        elif tensors:   # only real inputs: integer/bool bookkeeping (or small real floats)
            out = func(*args, **kwargs)
        else:           # a factory: fake when it makes floats, real otherwise
            with self.fake:
                out = func(*args, **kwargs)
            if all(not t.dtype.is_floating_point for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
                out = func(*args, **kwargs)
        self._track(out)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out

    @contextlib.contextmanager
    def measuring(self):
        """The meter, its peak and FLOPs from here."""
        self.reset_peak()
        self.flops = 0
        with self:
            yield self
