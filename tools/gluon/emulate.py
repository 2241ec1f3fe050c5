"""The Hopper tier's kernels run on the CPU: their own Python (``hopper/forward.py``, ``steps.py``,
``backward.py``, ``backward_wide.py``, every ``@gluon.jit`` body as written) executed on torch tensors, with
Gluon's primitives replaced by what they compute.

- ``gl.warp_specialize`` runs each partition in a thread of its own; ``mbarrier`` is a barrier with phases,
  arrivals and transaction bytes, whose ``wait`` blocks its thread (every partition waiting at once is a deadlock,
  raised; a wait that passes on a phase its thread already passed on, a parity that names an old phase, is
  raised too); a TMA copy writes its tile (zero past the tensor) into shared memory, then completes its bytes.
- Shared memory is a tensor poisoned with NaN (``index``, ``slice``, ``permute`` are views; ``store`` writes), so
  a matmul that reads a stage no copy has filled yet gives NaN.
- wgmma is a product in fp32 of its operands as stored (16-bit or e4m3: the FP8 tensor cores' narrower
  accumulation is not modelled); scalars are 0-d int32 tensors, wrapping as the GPU's do; pointers gather,
  scatter and add atomically; the deterministic backward's wait for its turn (``backward_parts._wait_turn``) is a
  wait the deadlock check sees (programs run one after another, so a turn computed wrong never comes).

What it proves without a GPU: the arithmetic the kernels do in Python-level code, from the launchers' real
arguments (``launch_arguments``) to the stored results, and that their barrier protocols neither deadlock nor
read a stage early under the interleavings the threads happen to take. What it does not: layouts, the compiler,
timing, and interleavings the threads never took (the protocols' own models in the tests enumerate those).

    out, lse = emulate_forward(q, k, v, causal=True, scale=0.125, schedule=forward.LAUNCHED[64])
    dq, dk, dv = emulate_backward(q, k, v, out, lse, dout, causal=True, scale=0.125)
"""

from __future__ import annotations

import math
import sys
import threading
import types

import torch

from flashattn.backends.triton.hopper import backward, forward

WAIT_S = 60.0  # a partition blocked this long while others still run: the emulation is stuck, not slow
# fp32 atomic adds (dQ's) and waits for a turn (``backward_parts._wait_turn``) since the last emulate_backward began
COUNTS = {"dq_adds": 0, "turns": 0}


class _Tensor(torch.Tensor):
    """A torch tensor that answers Gluon's ``x.type.layout``."""

    @property
    def type(self):  # noqa: A003 -- Gluon's name
        return types.SimpleNamespace(layout=None)


def _t(x) -> _Tensor:
    return torch.as_tensor(x).as_subclass(_Tensor)


class _Abort(RuntimeError):
    pass


class _Program:
    """One program's threads: the lock every barrier and atomic takes, and who waits for what."""

    def __init__(self):
        self.cond, self.alive, self.waiters, self.failed = threading.Condition(), 0, {}, None

    def block_until(self, ready, then=None) -> None:
        """Block this thread until ``ready()``, then run ``then()`` (under the lock, so that nothing moves between
        the two)."""
        with self.cond:
            me = threading.get_ident()
            self.waiters[me] = ready
            try:
                while not ready():
                    if self.failed:
                        raise _Abort(self.failed)
                    # Stuck: every partition still running waits, and no wait would pass now.
                    if len(self.waiters) == self.alive and not any(r() for r in self.waiters.values()):
                        self.failed = "deadlock: every partition waits on a barrier"
                        self.cond.notify_all()
                        raise _Abort(self.failed)
                    if not self.cond.wait(WAIT_S):
                        self.failed = f"a partition waited {WAIT_S:.0f} s"
                        raise _Abort(self.failed)
                if then is not None:
                    then()
            finally:
                del self.waiters[me]


class _Barrier:
    """An mbarrier: a phase completes once ``count`` arrivals and every expected transaction byte are in; a wait
    on parity p passes once the phase of that parity has completed (a fresh barrier's phase -1 counts)."""

    def __init__(self, program: _Program):
        self.program, self.count, self.pending, self.tx, self.completed = program, 1, 1, 0, 0
        self.consumed = {}  # partition (its thread) -> the last phase a wait of it passed on

    def _settle(self):
        if self.pending == 0 and self.tx == 0:
            self.completed, self.pending = self.completed + 1, self.count
            self.program.cond.notify_all()

    def arrive(self, tx: int = 0):
        with self.program.cond:
            self.pending, self.tx = self.pending - 1, self.tx + tx
            if self.pending < 0:
                raise _Abort("more arrivals than the barrier's count")
            self._settle()

    def complete_tx(self, tx: int):
        with self.program.cond:
            self.tx -= tx
            self._settle()


class _Barriers:
    """A shared-memory array of mbarriers; used whole, it is its first."""

    def __init__(self, program: _Program, shape):
        self.items, self.shape = [_Barrier(program) for _ in range(shape[0])], list(shape)

    def index(self, i):
        return self.items[int(i)]


def _barrier(x) -> _Barrier:
    return x.items[0] if isinstance(x, _Barriers) else x


class _Smem:
    """Shared memory (a view of it): NaN until written."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape, self.dtype = t, list(t.shape), t.dtype

    def index(self, i):
        return _Smem(self.t[int(i)])

    def slice(self, start, length, dim=0):
        return _Smem(self.t.narrow(dim, int(start), int(length)))

    def permute(self, order):
        return _Smem(self.t.permute(*order))

    def store(self, x):
        self.t.copy_(x)

    def load(self, layout=None):
        return _t(self.t.clone())


class _Pointer:
    """A global pointer plus offsets."""

    def __init__(self, flat: torch.Tensor, offsets=0):
        self.flat, self.offsets = flat, offsets
        self.dtype = types.SimpleNamespace(element_ty=flat.dtype)

    def __add__(self, offsets):
        return _Pointer(self.flat, self.offsets + offsets)

    def where(self, mask):
        offsets = torch.as_tensor(self.offsets).long()
        keep = torch.broadcast_to(torch.as_tensor(True if mask is None else mask), offsets.shape)
        return offsets, keep


class _Descriptor:
    """A TMA descriptor: a 2-D tensor read in ``block`` tiles, zero past its edges."""

    def __init__(self, described):
        self.flat, block = described.base, list(described.block_shape)
        nbytes = block[0] * block[1] * self.flat.element_size()
        self.block_type = types.SimpleNamespace(shape=block, nbytes=nbytes)
        self.dtype, self.layout = self.flat.dtype, None

    def tile(self, row, col) -> torch.Tensor:
        (rows, cols), row, col = self.block_type.shape, int(row), int(col)
        out = torch.zeros(rows, cols, dtype=self.flat.dtype)
        part = self.flat[max(row, 0): row + rows, col: col + cols]
        out[: part.shape[0], : part.shape[1]] = part
        return out


def _operand(x) -> torch.Tensor:
    return (x.t if isinstance(x, _Smem) else torch.as_tensor(x)).float()


def _nothing(*args, **kwargs):
    return None


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _t(torch.maximum(torch.as_tensor(a), torch.as_tensor(b)))
    return max(a, b)


def _inline_asm(text, constraints, args, dtype, is_pure, pack):
    (x,) = args
    if "rcp.approx" in text:
        return _t(1.0 / x)
    raise NotImplementedError(f"emulate: no model of {text!r}")


def _load(pointer, mask=None, other=0.0):
    offsets, keep = pointer.where(mask)
    values = pointer.flat[offsets.clamp(0, pointer.flat.numel() - 1)]
    return _t(torch.where(keep, values, torch.as_tensor(other, dtype=values.dtype)))


def _store(pointer, value, mask=None):
    offsets, keep = pointer.where(mask)
    value = torch.broadcast_to(torch.as_tensor(value), offsets.shape)
    pointer.flat[offsets[keep]] = value[keep].to(pointer.flat.dtype)


def _wgmma(a, b, acc, use_acc=True, is_async=True):
    product = _operand(a) @ _operand(b)
    return _t(acc + product if use_acc else product)


# Gluon's arithmetic, layouts and tensor constructors, as torch computes them (layouts are nothing here).
_MATH = dict(
    float32=torch.float32, int64=torch.int64, int32=torch.int32, float8e4nv=torch.float8_e4m3fn,
    bfloat16=torch.bfloat16, float16=torch.float16, static_range=range, minimum=min, maximum=_maximum,
    cdiv=lambda a, b: -(-a // b), where=lambda c, a, b: _t(torch.where(c, a, b)),
    max=lambda x, axis: _t(x.max(axis).values), sum=lambda x, axis: _t(x.sum(axis)),
    exp2=lambda x: _t(torch.exp2(torch.as_tensor(x))), exp=lambda x: _t(torch.exp(x)),
    log2=lambda x: _t(torch.log2(x)), arange=lambda a, b, layout=None: _t(torch.arange(a, b, dtype=torch.int32)),
    full=lambda shape, value, dtype, layout=None: _t(torch.full(shape, value, dtype=dtype)),
    zeros=lambda shape, dtype, layout=None: _t(torch.zeros(shape, dtype=dtype)),
    permute=lambda x, order: _t(x.permute(*order)), reshape=lambda x, shape: _t(x.reshape(shape)),
    convert_layout=lambda x, layout: x, SliceLayout=_nothing, DotOperandLayout=_nothing, BlockedLayout=_nothing,
    thread_barrier=_nothing, inline_asm_elementwise=_inline_asm, load=_load, store=_store,
    NVMMASharedLayout=types.SimpleNamespace(get_default_for=_nothing),
)


def _warp_specialize(program: _Program):
    """Each partition in a thread of its own; the first error raised (a deadlock only if nothing else went wrong)."""
    def warp_specialize(partitions, warps, registers):
        errors = []

        def run(fn, args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 -- carried to the caller below
                errors.append(e)
                with program.cond:
                    program.failed = program.failed or f"{type(e).__name__}: {e}"
            finally:
                with program.cond:
                    program.alive -= 1
                    program.cond.notify_all()

        threads = [threading.Thread(target=run, args=partition) for partition in partitions]
        program.alive = len(threads)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, _Abort)), errors[0])
    return warp_specialize


def _primitives(program: _Program, pid: tuple, grid: tuple) -> dict:
    """The names Gluon's kernels call, as this program computes them."""
    def atomic_add(pointer, value, mask=None, sem=None):
        offsets, keep = pointer.where(mask)
        with program.cond:
            old = pointer.flat[offsets.clamp(0, pointer.flat.numel() - 1)].clone()
            value = torch.broadcast_to(torch.as_tensor(value), offsets.shape)
            pointer.flat.index_add_(0, offsets[keep], value[keep].to(pointer.flat.dtype))
            program.cond.notify_all()  # (a semaphore some partition waits on: ``wait_turn``)
            COUNTS["dq_adds"] += pointer.flat.dtype == torch.float32
        return _t(old)

    def wait_turn(sem_ptr, turn, seen):  # backward_parts._wait_turn's poll, as a wait the deadlock check sees
        offset = int(sem_ptr.where(None)[0])
        program.block_until(lambda: int(sem_ptr.flat[offset]) == int(turn))
        with program.cond:
            COUNTS["turns"] += 1

    def allocate(dtype, shape, layout=None):
        if dtype is torch.int64:  # mbarriers
            return _Barriers(program, shape)
        return _Smem(torch.full(shape, float("nan"), dtype=dtype))

    def wait(bar, parity):
        bar = _barrier(bar)
        me = threading.current_thread()  # (not its ident: a finished partition's ident goes to the next one started)

        def consume():  # the phase this wait passed on: the latest completed; a thread never passes one twice
            phase = bar.completed - 1
            if phase <= bar.consumed.get(me, -2):
                caller = sys._getframe(3)  # (consume, block_until, wait): the kernel's line that waited
                program.failed = (f"stale wait: parity {int(parity)} passed on phase {phase} again "
                                  f"({caller.f_code.co_name}, line {caller.f_lineno})")
                program.cond.notify_all()
                raise _Abort(program.failed)
            bar.consumed[me] = phase
        program.block_until(lambda: bar.completed % 2 != int(parity), consume)

    def init(bar, count):
        _barrier(bar).count = _barrier(bar).pending = count

    def copy(desc, at, bar, dest):
        dest.store(desc.tile(*at))
        _barrier(bar).complete_tx(desc.block_type.nbytes)

    gl = types.SimpleNamespace(
        **_MATH, atomic_add=atomic_add, allocate_shared_memory=allocate, warp_specialize=_warp_specialize(program),
        program_id=lambda axis: torch.tensor(pid[axis], dtype=torch.int32),
        num_programs=lambda axis: torch.tensor(grid[axis], dtype=torch.int32))
    mbarrier = types.SimpleNamespace(
        wait=wait, init=init, arrive=lambda bar, pred=True: _barrier(bar).arrive() if bool(pred) else None,
        expect=lambda bar, nbytes: _barrier(bar).arrive(tx=nbytes), MBarrierLayout=_nothing)
    return {"gl": gl, "mbarrier": mbarrier, "tma": types.SimpleNamespace(async_copy_global_to_shared=copy),
            "warpgroup_mma": _wgmma, "fence_async_shared": _nothing, "_mma_layout": _nothing,
            "_instr_k": lambda dtype: 16, "range": range, "_wait_turn": wait_turn,
            "warpgroup_mma_wait": lambda num_outstanding=0, deps=(): deps if len(deps) > 1 else deps[0]}


def _kernel(kernel, program: _Program, pid: tuple, grid: tuple):
    """``kernel``'s body, and every ``@gluon.jit`` body it reaches, rebound to this program's primitives: each
    module's functions see their own module's names, with Gluon's replaced."""
    primitives = _primitives(program, pid, grid)
    spaces: dict[str, dict] = {}

    def space(module_name: str) -> dict:
        if module_name not in spaces:
            names = spaces[module_name] = dict(vars(sys.modules[module_name]))
            names.update(primitives)
            for attr, value in list(names.items()):
                if attr not in primitives and callable(getattr(value, "fn", None)):
                    names[attr] = rebound(value)
        return spaces[module_name]

    def rebound(jitted):
        fn = jitted.fn
        return types.FunctionType(fn.__code__, space(fn.__module__), fn.__name__, fn.__defaults__)

    return rebound(kernel)


def _run(kernel, grid: tuple, kwargs: dict) -> None:
    """Every program of the grid, one after another (each one's partitions in threads; axis 1 fastest, where the GPU
    starts axis 0's first: the same order within each axis-0 index, all the backward's turns depend on); int
    arguments as the GPU holds them (int32 where they fit), tensors as pointers, descriptors as TMA reads."""
    arguments = {}
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    for key, value in kwargs.items():
        if key == "num_warps":
            continue
        if hasattr(value, "block_shape"):
            value = _Descriptor(value)
        elif isinstance(value, torch.Tensor):
            value = _Pointer(value.reshape(-1))
        elif isinstance(value, int) and not isinstance(value, bool) and key not in constexprs:
            value = torch.tensor(value, dtype=torch.int32 if -2**31 <= value < 2**31 else torch.int64)
        arguments[key] = value
    grid = (*grid, 1)[:2]  # (a persistent grid is one-dimensional)
    for pid in ((x, y) for x in range(grid[0]) for y in range(grid[1])):
        program = _Program()
        _kernel(kernel, program, pid, grid)(**arguments)


def emulate_forward(q, k, v, **arguments) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the tier's forward on CPU tensors as ``forward.launch_arguments(q, k, v, out, lse,
    **arguments)`` launches it, out and lse poisoned with NaN first (what no program writes stays NaN). FP8: q, k
    float8_e4m3fn, v as ``attend.interleaved_values`` returns it, ``descale`` (batch, kv_heads) in ``arguments``;
    out float32, before v's descale."""
    fp8 = q.dtype == torch.float8_e4m3fn
    if q.dtype not in (torch.bfloat16, torch.float16) and not fp8:
        raise ValueError(f"emulate_forward: q.dtype {q.dtype}: the emulation covers the 16-bit and e4m3 forwards")
    packed = arguments.get("cu_seqlens") is not None
    out = torch.full(q.shape, float("nan"), dtype=torch.float32 if fp8 else q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    grid, kwargs = forward.launch_arguments(q, k, v, out, lse, **arguments)
    _run(forward.attention_forward_ws_kernel, grid, kwargs)
    return out, lse


def emulate_backward(q, k, v, out, lse, dout, *, deterministic: bool = False,
                     **arguments) -> tuple[torch.Tensor, ...]:
    """(dq fp32, dk, dv) of the tier's one-pass backward (d 64, 128: ``backward.py``; 256: ``backward_wide.py``)
    as ``backward.launch_arguments(..., **arguments)`` launches it (causal, scale, window, top_left, softcap, ...),
    from the forward's out and lse (natural log, (batch, heads, seqlen_q), packed (heads, total_q)), the statistics
    as the portable preprocess writes them; dk and dv poisoned with NaN first. ``deterministic``: dQ's adds ordered
    on zeroed counters, which must end at zero, every add having waited for its turn (else ``RuntimeError``)."""
    neg_lse2 = torch.where(torch.isneginf(lse), -math.inf, -lse.float() * forward.LOG2E).contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # (batch, seqlen_q, heads), packed (total, heads)
    delta = (delta.T if arguments.get("cu_seqlens") is not None else delta.transpose(1, 2)).contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    sequences = arguments["cu_seqlens"][0].numel() - 1 if arguments.get("cu_seqlens") is not None else 0
    semaphores = torch.zeros(backward.semaphores_needed(q, sequences=sequences), dtype=torch.int32)
    kernel, grid, kwargs = backward.launch_arguments(q, k, v, dout, (neg_lse2, delta), (dq, dk, dv),
                                                     dq_semaphores=semaphores if deterministic else None, **arguments)
    COUNTS.update(dq_adds=0, turns=0)
    _run(kernel, grid, kwargs)
    if deterministic and COUNTS["turns"] != COUNTS["dq_adds"]:
        raise RuntimeError(f"emulate_backward: {COUNTS['dq_adds']} dQ adds, {COUNTS['turns']} of them in turn")
    if semaphores.any():
        raise RuntimeError(f"emulate_backward: {int(semaphores.count_nonzero())} dQ semaphores left nonzero "
                           f"(first at {int(semaphores.nonzero()[0])}: {int(semaphores[semaphores != 0][0])})")
    return dq, dk, dv
