"""The Hopper tier's forward kernel run on the CPU: its own Python (``hopper/forward.py`` and ``steps.py``, every
``@gluon.jit`` body as written) executed on torch tensors, with Gluon's primitives replaced by what they compute.

What it proves without a GPU: the arithmetic the kernel does in Python-level code, from the launcher's real
arguments (``forward.launch_arguments``) to the stored out and lse: the program's sequence and rows (packed offsets,
the causal grid reversal), the key tiles it visits and where the producer loads them from, the masks of the band
and the key end, the softcap, the online softmax, the lse and the stores' offsets. What it does not: the barriers
(modelled in the tests), layouts, the compiler, timing. The producer runs first and queues its TMA tiles (zero
past the tensor, as TMA fills them); each consumer then takes its ring's tiles in the order it issues its matmuls,
P rounded to the inputs' dtype before P V as on the GPU, products accumulated in fp32.

    out, lse = emulate(q, k, v, causal=True, scale=0.125, schedule=forward.LAUNCHED[64])

The keyword arguments are ``launch_arguments``'s (window, top_left, softcap, cu_seqlens, max_seqlen_q, ...).
"""

from __future__ import annotations

import types

import torch

from flashattn.backends.triton.hopper import forward, steps


class _Tensor(torch.Tensor):
    """A torch tensor that answers Gluon's ``x.type.layout`` (``_rescale``, ``_store``)."""

    @property
    def type(self):  # noqa: A003 -- Gluon's name
        return types.SimpleNamespace(layout=None)


def _t(x: torch.Tensor) -> _Tensor:
    return x.as_subclass(_Tensor)


class _Pointer:
    """A global pointer (plus offsets): ``gl.load`` reads it, ``gl.store`` writes through it."""

    def __init__(self, flat: torch.Tensor, offsets=0):
        self.flat, self.offsets = flat, offsets
        self.dtype = types.SimpleNamespace(element_ty=flat.dtype)

    def __add__(self, offsets):
        return _Pointer(self.flat, self.offsets + offsets)


class _Descriptor:
    """A TMA descriptor: a 2-D tensor read in ``block`` tiles, zero past its edges."""

    def __init__(self, described):
        self.flat, block = described.base, list(described.block_shape)
        self.block_type = types.SimpleNamespace(shape=block, nbytes=0)
        self.dtype, self.layout = self.flat.dtype, None

    def tile(self, row: int, col: int) -> torch.Tensor:
        rows, cols = self.block_type.shape
        out = torch.zeros(rows, cols, dtype=self.flat.dtype)
        part = self.flat[max(row, 0): row + rows, col: col + cols]
        out[: part.shape[0], : part.shape[1]] = part
        return out


class _Buffer:
    """Shared memory: ``index(i)`` names stage i; TMA loads land in order (a ring's consumers read them in order)."""

    def __init__(self, dtype, shape):
        self.dtype, self.shape, self.loads = dtype, shape, []

    def index(self, i):
        return _Stage(self, i)


class _Stage:
    def __init__(self, buffer: _Buffer, i, transposed: bool = False):
        self.buffer, self.i, self.transposed = buffer, i, transposed

    def permute(self, order):
        return _Stage(self.buffer, self.i, not self.transposed)


class _Machine:
    """The state the primitives share: the program's ids, the warpgroup running, each one's place in the rings."""

    def __init__(self, grid):
        self.grid, self.pid, self.wg, self.taken = grid, (0, 0), 0, {}

    def operand(self, x):
        if not isinstance(x, _Stage):
            return x.float()
        if x.buffer.shape[0] == 2 and len(x.buffer.loads) == 2 and x.buffer is self.q_smem:
            tile = x.buffer.loads[x.i]  # the two Q tiles, by warpgroup
        else:  # a ring: this warpgroup's next tile of it
            n = self.taken.get((self.wg, id(x.buffer)), 0)
            self.taken[(self.wg, id(x.buffer))] = n + 1
            tile = x.buffer.loads[n]
        tile = tile.float()
        return tile.T if x.transposed else tile

    def wgmma(self, a, b, acc, use_acc=True, is_async=True):
        product = self.operand(a) @ self.operand(b)
        return _t(acc + product if use_acc else product)


def _gl(machine: _Machine):
    def maximum(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return _t(torch.maximum(torch.as_tensor(a), torch.as_tensor(b)))
        return max(a, b)

    def store(pointer, value, mask=None):
        offsets = torch.as_tensor(pointer.offsets)
        keep = torch.broadcast_to(torch.as_tensor(True) if mask is None else mask, offsets.shape)
        value = torch.broadcast_to(torch.as_tensor(value), offsets.shape)
        pointer.flat[offsets[keep]] = value[keep].to(pointer.flat.dtype)

    def allocate(dtype, shape, layout=None):
        buffer = _Buffer(dtype, shape)
        if dtype is not torch.int64 and len(shape) == 3 and shape[0] == 2 and not hasattr(machine, "q_smem"):
            machine.q_smem = buffer  # the kernel allocates the two Q tiles first
        return buffer

    def asm(text, constraints, args, dtype, is_pure, pack):
        (x,) = args
        if "rcp.approx" in text:
            return _t(1.0 / x)
        if "tanh.approx" in text:
            return _t(torch.tanh(x))
        raise NotImplementedError(text)

    def warp_specialize(partitions, warps, registers):
        *consumers, (producer, producer_args) = partitions
        producer(*producer_args)
        for fn, args in consumers:
            machine.wg = args[0]
            fn(*args)

    return types.SimpleNamespace(
        float32=torch.float32, int64=torch.int64, float8e4nv="float8e4nv", bfloat16=torch.bfloat16,
        program_id=lambda axis: machine.pid[axis], num_programs=lambda axis: machine.grid[axis],
        load=lambda pointer: pointer.flat[pointer.offsets].item(), store=store, allocate_shared_memory=allocate,
        static_range=range, warp_specialize=warp_specialize, minimum=min, maximum=maximum,
        cdiv=lambda a, b: -(-a // b), where=lambda c, a, b: _t(torch.where(c, a, b)),
        max=lambda x, axis: _t(x.max(axis).values), sum=lambda x, axis: _t(x.sum(axis)),
        exp2=lambda x: _t(torch.exp2(torch.as_tensor(x))), log2=lambda x: _t(torch.log2(x)),
        arange=lambda a, b, layout=None: _t(torch.arange(a, b)),
        full=lambda shape, value, dtype, layout=None: _t(torch.full(shape, value, dtype=dtype)),
        zeros=lambda shape, dtype, layout=None: _t(torch.zeros(shape, dtype=dtype)),
        convert_layout=lambda x, layout: x, SliceLayout=lambda *a: None, DotOperandLayout=lambda **kw: None,
        inline_asm_elementwise=asm,
    )


def _functions(machine: _Machine) -> dict:
    """Every ``@gluon.jit`` body of the two modules, rebound to the emulated primitives."""
    nothing = lambda *a, **kw: None  # noqa: E731
    names = {
        "gl": _gl(machine), "range": range,
        "mbarrier": types.SimpleNamespace(wait=nothing, arrive=nothing, expect=nothing, init=nothing,
                                          MBarrierLayout=nothing),
        "tma": types.SimpleNamespace(async_copy_global_to_shared=lambda desc, at, bar, stage:
                                     stage.buffer.loads.append(desc.tile(*at))),
        "warpgroup_mma": machine.wgmma,
        "warpgroup_mma_wait": lambda num_outstanding=0, deps=(): deps if len(deps) > 1 else deps[0],
        "_mma_layout": nothing, "_instr_k": lambda dtype: 16,
    }
    for module in (steps, forward):
        for name, value in vars(module).items():
            if name not in names and hasattr(value, "fn") and callable(value.fn):
                fn = value.fn
                names[name] = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__)
    return names


def emulate(q, k, v, **arguments) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the tier's forward on CPU tensors as ``launch_arguments(q, k, v, out, lse, **arguments)``
    launches it (out and lse poisoned with NaN first: what no program writes stays NaN). 16-bit inputs only."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"emulate: q.dtype {q.dtype}: the emulation covers the 16-bit forward")
    packed = arguments.get("cu_seqlens") is not None
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    grid, kwargs = forward.launch_arguments(q, k, v, out, lse, **arguments)
    kwargs.pop("num_warps")
    for name in ("q_desc", "k_desc", "v_desc"):
        kwargs[name] = _Descriptor(kwargs[name])
    for name in ("o_ptr", "lse_ptr", "cu_seqlens_q", "cu_seqlens_k", "descale_ptr"):
        if kwargs[name] is not None:
            kwargs[name] = _Pointer(kwargs[name].reshape(-1))
    for pid_bh in range(grid[0]):
        for pid_m in range(grid[1]):
            machine = _Machine(grid)
            machine.pid = (pid_bh, pid_m)
            _functions(machine)["attention_forward_ws_kernel"](**kwargs)
    return out, lse
