"""Launch plans: a call's launches worked out once per signature, then replayed at a few microseconds.

Building a launch in Python costs more than a short call's kernel: shapes, strides, tiles, TMA descriptors and
about seventy keyword arguments per kernel, then Triton's binding of them. None of it changes between calls of one
signature (shapes, strides, dtypes, devices, pointer alignment, options). So the first call of a signature runs the
path's Python and records what it launches (``recording``): each kernel's compiled binary, grid and arguments, every
tensor among them traced to where it comes from (an input, a view of one, an output, or a workspace the call
allocates). Later calls with that signature (``key``) replay the record (``Plan.run``): allocate the outputs and
workspaces, put the new tensors in their places, and call each compiled kernel's launcher directly.

Calls that do other host work besides launching (FP8 scales, block-mask lists, returned probabilities, empty
inputs) are never planned (``plannable``), and a record with an argument it cannot trace is dropped: those calls
keep the path's full Python. Plans apply to compiled kernels on a GPU (or stubbed launches, ``stub.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from ..direct import hooked
from ..environ import Variable
from ..spec import AttentionSpec, aliases
from . import configs, hopper, tma
from .entry import Entry, TensorMaps, descriptor_kinds, entry, expansion, fill_tma_descriptor
from .tickets import tickets


class Launch(NamedTuple):
    """One kernel launch as recorded: the JIT function, its compiled binary, the grid and the keyword arguments."""

    kernel: object
    compiled: object
    grid: tuple[int, ...]
    kwargs: dict


@dataclass
class Recording:
    launches: list[Launch] = field(default_factory=list)
    scratch: set[int] = field(default_factory=set)  # storages the call allocated for its kernels to fill
    counters: dict[int, tuple] = field(default_factory=dict)  # storage -> (count, the ``tickets`` counters)


_recording: ContextVar[Recording | None] = ContextVar("flashattn_triton_recording", default=None)
_enabled: ContextVar[bool] = ContextVar("flashattn_triton_plans", default=True)


@contextmanager
def disabled() -> Iterator[None]:
    """Every call inside the block runs the path's full Python (to compare a plan against what it replays)."""
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)


def scratch(t: torch.Tensor) -> torch.Tensor:
    """``t``, a buffer the call allocates and its kernels write before reading (a workspace, or an output): a
    replay allocates it anew. Any other tensor an argument, not an input or a view of one, makes a record
    unplannable (it holds values the host computed)."""
    recording = _recording.get()
    if recording is not None:
        recording.scratch.add(_storage_of(t))
    return t


def counters(t: torch.Tensor, count: int) -> torch.Tensor:
    """``t``, ``tickets.tickets(device, count)``'s counters: a replay asks ``tickets`` again, for its own stream."""
    recording = _recording.get()
    if recording is not None:
        recording.counters[_storage_of(t)] = count, t
    return t


def record(kernel, compiled, grid: tuple[int, ...], kwargs: dict) -> None:
    """Called by ``launch.launch`` after each launch; kept when a recording is active."""
    recording = _recording.get()
    if recording is not None:
        recording.launches.append(Launch(kernel, compiled, grid, kwargs))


# --- where a tensor argument comes from, and how a replay finds it -------------------------------------------------
# A slot is (kind, index, view): kind "in" (an input), "out" (an output), "work" (a workspace) or "tickets" (index:
# the count of ``tickets`` counters), and view None (the tensor itself) or (dtype, shape, stride, offset from the
# base's storage offset).


class _Storage(NamedTuple):
    kind: str
    index: int
    base: torch.Tensor


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _view(t: torch.Tensor, base: torch.Tensor):
    if t is base:
        return None
    return t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset()


def _resolve(base: torch.Tensor, view) -> torch.Tensor:
    if view is None:
        return base
    dtype, shape, stride, offset = view
    typed = base if base.dtype == dtype else base.view(dtype)
    return typed.as_strided(shape, stride, base.storage_offset() + offset)


def _descriptor(base: torch.Tensor, fields: dict, kind: type = TensorDescriptor):
    """A TMA descriptor of class ``kind`` with a recorded one's fields (shape, strides, tile, a Gluon one's shared
    layout) around ``base``: built without its checks (alignment, strides), which held when it was recorded and
    hold for every call of the key."""
    desc = kind.__new__(kind)
    desc.__dict__.update(fields, base=base)
    return desc


class Plan:
    """A signature's launches: the outputs and workspaces to allocate, then each compiled kernel launched with
    its recorded arguments and the call's tensors in their places, by one function written for the plan (a
    generic loop over seventy arguments a launch costs more than the launch)."""

    def __init__(self, outputs: list[tuple], workspaces: list[tuple], launches: list[tuple]):
        self.outputs = outputs  # (shape, stride, dtype) of each output, in the order the path returns them
        self.workspaces = workspaces  # the same of each workspace (bytes: ((n,), (1,), torch.uint8))
        self._launch = _writer(outputs, workspaces, launches)

    def run(self, inputs: Sequence[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, ...]:
        active = driver.active
        stream = active.get_current_stream(active.get_current_device())
        runtime = knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        return self._launch(inputs, device, stream, enter, leave, hooked(enter, leave))


def _literal(value: object) -> bool:
    """Whether ``repr(value)`` is ``value`` in the plan's source: None, bools, ints, finite floats, tuples of them."""
    kind = type(value)
    if kind is tuple:
        return all(_literal(x) for x in value)
    return kind in (type(None), bool, int) or (kind is float and math.isfinite(value))


class _Source:
    """The text of a plan's launch function and the objects it names (``_writer``)."""

    _BASES = {"in": "inputs[{}]", "out": "o{}", "work": "w{}", "tickets": "_tickets(device, {}, stream)"}

    def __init__(self):
        self.names: dict[str, object] = {"_resolve": _resolve, "_descriptor": _descriptor,
                                         "_empty": torch.empty_strided, "_tickets": tickets}
        self.maps: dict[tuple, str] = {}  # tensor maps by what they encode: the backward's kernels share k's, v's

    def constant(self, value: object) -> str:
        if _literal(value):
            return repr(value)
        name = f"c{len(self.names)}"
        self.names[name] = value
        return name

    def tensor(self, slot: tuple) -> str:
        kind, index, view = slot
        base = self._BASES[kind].format(index)
        return base if view is None else f"_resolve({base}, {self.constant(view)})"

    def arguments(self, arguments: tuple, tensors: tuple) -> list[str]:
        terms = [self.constant(value) for value in arguments]
        for position, slot in tensors:
            terms[position] = self.tensor(slot)
        return terms

    def by_launcher(self, compiled, grid, arguments, tensors, descriptors) -> list[str]:
        """The launch by ``compiled.run``, Triton's launcher, descriptors as objects."""
        terms = self.arguments(arguments, tensors)
        for position, (slot, fields, kind, _) in descriptors:
            terms[position] = f"_descriptor({self.tensor(slot)}, {self.constant(fields)}, {self.constant(kind)})"
        kernel = self.constant(compiled)
        return [f"args = ({', '.join(terms)},)",
                f"meta = {kernel}.launch_metadata({self.constant(grid)}, stream, *args) if hooked else None",
                f"{self.constant(compiled.run)}({', '.join(map(str, grid))}, stream, "
                f"{self.constant(compiled.function)}, {self.constant(compiled.packed_metadata)}, meta, enter, leave, "
                f"*args)"]

    def by_entry(self, found: Entry, compiled, grid, arguments, tensors, descriptors) -> list[str]:
        """The launch by the kernel's C entry, each descriptor expanded as the launcher expands it."""
        terms, body = self.arguments(arguments, tensors), []
        for position, (slot, fields, _, offset) in descriptors:
            encode, after = expansion(fields, found.descriptors[position])
            if encode is None:
                terms[position] = ", ".join((self.tensor(slot), *map(self.constant, after)))
                continue
            same = (slot, repr(encode))
            if same not in self.maps:
                name = self.maps[same] = f"m{len(self.maps)}"
                maps = self.constant(TensorMaps(fill_tma_descriptor(), encode))
                # The map needs the view's address alone: its base's plus the bytes between them (fixed by the
                # key), without building the view.
                base = self.tensor((*slot[:2], None))
                body.append(f"{name} = {maps}({base}.data_ptr(){f' + {offset}' if offset else ''})")
            terms[position] = ", ".join((self.maps[same], *map(self.constant, after)))
        return [*body, f"{self.constant(found.launch)}({', '.join(map(str, grid))}, stream, "
                       f"{self.constant(compiled.function)}, {found.cooperative}, {found.pdl}, None, None, "
                       f"{self.constant(compiled.packed_metadata)}, None, enter, leave, {', '.join(terms)})"]


def _writer(outputs: list[tuple], workspaces: list[tuple], launches: list[tuple]) -> Callable:
    """``launch(inputs, device, stream, enter, leave, hooked) -> outputs``: the outputs' and workspaces'
    allocations and every recorded launch, written out: by the compiled kernel's launcher where launch hooks
    want each launch's metadata, else by its C entry with the descriptors expanded (``entry.py``) where it has
    one."""
    source = _Source()
    lines = ["def launch(inputs, device, stream, enter, leave, hooked):"]
    for prefix, layouts in (("o", outputs), ("w", workspaces)):
        lines += [f"    {prefix}{i} = _empty({shape!r}, {stride!r}, dtype={source.constant(dtype)}, device=device)"
                  for i, (shape, stride, dtype) in enumerate(layouts)]
    hooked_lines, direct_lines = [], []
    for compiled, grid, arguments, tensors, descriptors in launches:
        launch = compiled, grid, arguments, tensors, descriptors
        found = entry(compiled)
        if found is not None and set(found.descriptors) != {position for position, _ in descriptors}:
            found = None  # descriptors where the recorded launch had none, or none where it had some
        hooked_lines += (by_launcher := source.by_launcher(*launch))
        direct_lines += by_launcher if found is None else source.by_entry(found, *launch)
    lines += ["    if hooked:", *(f"        {line}" for line in hooked_lines),
              "    else:", *(f"        {line}" for line in direct_lines),
              f"    return ({''.join(f'o{i}, ' for i in range(len(outputs)))})"]
    names = source.names
    exec(compile("\n".join(lines) + "\n", f"<flashattn launch plan of {len(launches)} launches>", "exec"), names)
    return names["launch"]


class _Untraceable(Exception):
    """A tensor argument that is neither an input, an output, a workspace nor a view of one."""


def _tracer(inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor], scratch: set[int],
            counters: dict[int, tuple] | None = None):
    """Slots for tensor arguments: inputs and outputs by storage; a buffer the call allocated (``scratch``) a
    workspace, allocated anew per call; ``counters`` (storage -> (count, tensor)) the ``tickets`` counters."""
    storages = {storage: _Storage("tickets", count, t) for storage, (count, t) in (counters or {}).items()}
    shared: set[int] = set()  # storages of two or more inputs (k and v unbound from one kv tensor)
    for kind, tensors in (("in", inputs), ("out", outputs)):
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                if _storage_of(t) in storages:
                    shared.add(_storage_of(t))
                else:
                    storages[_storage_of(t)] = _Storage(kind, i, t)
    workspaces: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> tuple:
        for kind, tensors in (("in", inputs), ("out", outputs)):  # the tensor itself first: cheapest to replay
            for i, known in enumerate(tensors):
                if known is t:
                    return kind, i, None
        found = storages.get(_storage_of(t))
        if _storage_of(t) in shared:
            # A view of one of several inputs on one storage: which one it views is not known, and a later call
            # of the same signature may bring them on separate storages.
            raise _Untraceable
        if found is None:
            if _storage_of(t) not in scratch:
                raise _Untraceable
            # The workspace as the tensor that first uses it when that tensor is all of it (then the replay passes
            # the allocation itself), else as bytes that its users view.
            workspace = t if _owns_storage(t) else torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage())
            found = storages[_storage_of(t)] = _Storage("work", len(workspaces), workspace)
            workspaces.append(workspace)
        return found.kind, found.index, _view(t, found.base)

    return slot, workspaces


def _constant(value) -> bool:
    """None, a number, a string or tuples of them: what a plan may keep (no tensor, no descriptor of unknown type)."""
    plain = (bool, int, float, str, type(None))
    return all(map(_constant, value)) if isinstance(value, tuple) else isinstance(value, plain)


def build(recording: Recording, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor]) -> Plan | None:
    """The plan of a recorded call, or None when a tensor argument cannot be traced."""
    slot, workspaces = _tracer(inputs, outputs, recording.scratch, recording.counters)
    kinds = descriptor_kinds()
    bases = {"in": inputs, "out": outputs, "work": workspaces}
    launches = []
    try:
        for kernel, compiled, grid, kwargs in recording.launches:
            arguments, tensors, descriptors = [], [], []
            for position, (name, param) in enumerate(kernel.signature.parameters.items()):
                value = kwargs.get(name, param.default)
                if isinstance(value, torch.Tensor):
                    tensors.append((position, slot(value)))
                    value = None
                elif type(value) in kinds:
                    fields = {k: v for k, v in vars(value).items() if k != "base"}
                    where = slot(value.base)
                    offset = value.base.data_ptr() - bases[where[0]][where[1]].data_ptr()
                    descriptors.append((position, (where, fields, type(value), offset)))
                    value = None
                elif not _constant(value):
                    raise _Untraceable  # a bundle of tensors (block-mask lists), another kind of descriptor
                arguments.append(value)
            grid3 = (*grid, 1, 1)[:3]
            launches.append((compiled, grid3, tuple(arguments), tuple(tensors), tuple(descriptors)))
    except _Untraceable:
        return None
    if not all(_storage_of(t) in recording.scratch for t in outputs if t.numel()):
        return None  # an output the call did not allocate (an input handed back)
    if not all(_owns_storage(t) for t in outputs) or len({_storage_of(t) for t in outputs if t.numel()}) < sum(
            1 for t in outputs if t.numel()):
        return None  # an output that is a view of a larger buffer, or two sharing one: not replayed as allocations
    return Plan([(tuple(t.shape), tuple(t.stride()), t.dtype) for t in outputs],
                [(tuple(w.shape), tuple(w.stride()), w.dtype) if w.numel() else ((w.untyped_storage().nbytes(),), (1,),
                                                                                   torch.uint8) for w in workspaces],
                launches)


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage's whole tensor, as ``torch.empty_strided`` of its shape and strides makes it."""
    if t.numel() == 0:
        return True
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == span * t.element_size()


# --- which calls are planned, and their signature --------------------------------------------------------------------

_TENSOR_FIELDS = tuple(i for i, leaf in enumerate(AttentionSpec(scale=1.0).as_args()) if leaf is None)
_SCALAR_FIELDS = tuple(i for i, leaf in enumerate(AttentionSpec(scale=1.0).as_args()) if leaf is not None)
_CACHE_LENGTH = _SCALAR_FIELDS.index(AttentionSpec.arg_index("cache_max_seqlen_k"))  # among the scalars


PLANS_ENV = "FLASHATTN_LAUNCH_PLANS"
_PLANS = Variable(PLANS_ENV)


def plannable(spec: AttentionSpec) -> bool:
    """Calls whose host work is launches only (no FP8, no block mask: its lists are built on the host), plans on."""
    return spec.descale is None and not spec.fp8_training and spec.block_sparse is None and enabled()


def enabled() -> bool:
    """Plans are on: not ``disabled``, nor turned off by ``FLASHATTN_LAUNCH_PLANS=0``."""
    return _enabled.get() and _PLANS.get("1") != "0"


def spec_tensors(spec: AttentionSpec, *, cache_keys: int | None = None) -> tuple[list, tuple]:
    """(the spec's tensors, its other arguments) in ``as_args`` order; with ``cache_keys`` (the key count a cache
    call's launch is sized for, ``launch.cache_keys``) in place of the cache's exact longest length, which the
    launches do not depend on."""
    args = spec.as_args()
    scalars = tuple(args[i] for i in _SCALAR_FIELDS)
    if cache_keys is not None:
        scalars = (*scalars[:_CACHE_LENGTH], cache_keys, *scalars[_CACHE_LENGTH + 1:])
    return [args[i] for i in _TENSOR_FIELDS], scalars


def tensor_slot(field: str) -> int:
    """Where the spec's tensor field ``field`` (an ``AttentionSpec.op_schema`` name, e.g. "cache_k_end") sits among
    ``spec_tensors``'s tensors."""
    return _TENSOR_FIELDS.index(AttentionSpec.arg_index(field))


def key(kind: str, tensors: Sequence[torch.Tensor | None], scalars: tuple, extra: tuple = ()) -> tuple:
    """What decides every launch of a call: the tensors' shapes, strides, dtypes, devices, 16-byte alignment and
    ``aliases`` (a record traces a tensor to its first input), the options, the context that chooses tiles."""
    facts = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                  for t in tensors)
    return kind, facts, aliases(tensors), scalars, extra, *context()


def context() -> tuple:
    """What besides a call's arguments decides its launches: the forced tiles, descriptors and tier and the current
    device; with the plans' generation (``PlanCache.clear``), so that a plan handed out is known to be current."""
    return configs.context(), tma.forced(), hopper.TIER.get(), driver.active.get_current_device(), _generation


def context_if_enabled() -> tuple | None:
    """``context()`` where plans are ``enabled``, else None: inlined, as kept plans check it every call (fastpath)."""
    if not _enabled.get() or _PLANS.get("1") == "0":
        return None
    return configs.context(), tma.forced(), hopper.TIER.get(), driver.active.get_current_device(), _generation


_generation = 0  # bumped whenever a cache forgets its plans


class PlanCache:
    """Plans by key; keys whose record could not be traced map to None (always the full Python)."""

    LIMIT = 4096  # signatures kept; past it the cache starts over (a model has a handful)

    def __init__(self):
        self._plans: dict[tuple, Plan | None] = {}
        self.replays = 0  # calls that ran by their plan

    def run(self, signature: tuple, inputs: Sequence[torch.Tensor | None], device: torch.device,
            slow: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        """The outputs of the call: by its plan when there is one, else by ``slow()`` (the path's Python),
        recorded into a plan for the next call."""
        plan = self._plans.get(signature, _MISSING)
        if plan is not _MISSING:
            if plan is None:
                return slow()
            self.replays += 1
            return plan.run(inputs, device)
        recording = Recording()
        token = _recording.set(recording)
        try:
            outputs = slow()
        finally:
            _recording.reset(token)
        if len(self._plans) >= self.LIMIT:
            self.clear()
        self._plans[signature] = build(recording, inputs, outputs) if recording.launches else None
        return outputs

    def get(self, signature: tuple) -> Plan | None:
        """The plan recorded for ``signature``, if any (a caller that replays it itself counts ``replays``)."""
        return self._plans.get(signature)

    def clear(self) -> None:
        global _generation
        _generation += 1
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


_MISSING = object()
