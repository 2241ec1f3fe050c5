"""Reading a compiled kernel's SASS (``cuobjdump --dump-sass``): its loops and what their instructions do.

What the health report measures from it, per kernel:

- **main loop**: the innermost loop (a backward branch) that holds tensor-core instructions (HGMMA on sm_90,
  UTC*MMA on sm_100, HMMA otherwise; QGMMA and QMMA for FP8 operands), the leanest one when several do (the
  unmasked path of a kernel that splits its loop into an unmasked and a masked part); its length in instructions,
  and that length times the warps of a program divided by the score elements one trip computes: warp-instructions
  per score element;
- **HGMMA**: how many wgmma instructions, in how many groups (a group ends with one that signals ``gsb0``), and
  how many groups are waited on at once (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` within a few instructions of the
  group: no other work overlaps that matmul);
- **TMA**: bulk tensor copies (``UTMALDG``), i.e. tensor descriptors in use;
- **spills in loops**: local-memory loads and stores (``LDL``/``STL``) inside any loop. A value spilled once
  before the loops and reloaded after them costs a few instructions per program; one spilled in a loop costs
  memory traffic every trip.

Example::

    >>> text = '''
    ...         /*0000*/                   MOV R1, c[0x0][0x28] ;
    ...         /*0010*/                   WARPGROUP.ARRIVE ;
    ...         /*0020*/                   HGMMA.64x64x16.F32 R88, gdesc[UR48], RZ, !UPT, gsb0 ;
    ...         /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    ...         /*0040*/               @P2 BRA 0x10 ;
    ...         /*0050*/                   EXIT ;
    ... '''
    >>> s = Sass.parse(text)
    >>> loop = s.main_loop()
    >>> loop.length, s.hgmma_groups(), s.hgmma_waited_at_once()
    (4, 1, 1)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WAITED_AT_ONCE = 8  # a group retired within this many instructions of its issue overlaps no real work
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_TCGEN05 = re.compile(r"UTC[A-Z]?MMA")
WGMMA = ("HGMMA", "QGMMA")  # sm_90's wgmma: 16-bit (and tf32) operands, FP8 operands
MMA_SYNC = ("HMMA", "QMMA")  # mma.sync: 16-bit (and tf32) operands, FP8 operands (sm_89 and sm_120)


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str
    operands: str


@dataclass(frozen=True)
class Loop:
    """Instructions [start, end] (inclusive indices into ``Sass.instructions``), end being the backward branch."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    def contains(self, other: Loop) -> bool:
        return self.start <= other.start and other.end <= self.end and self != other


@dataclass(frozen=True)
class Sass:
    instructions: tuple[Instruction, ...]

    @classmethod
    def parse(cls, text: str) -> Sass:
        out = []
        for match in _LINE.finditer(text):
            address, _, opcode, operands = match.groups()
            out.append(Instruction(int(address, 16), opcode, operands.strip()))
        return cls(tuple(out))

    def _index(self, address: int) -> int | None:
        return next((i for i, ins in enumerate(self.instructions) if ins.address == address), None)

    def loops(self) -> list[Loop]:
        """Every loop: a branch whose target lies before it."""
        found = []
        for i, ins in enumerate(self.instructions):
            if ins.opcode != "BRA":
                continue
            target = _TARGET.search(ins.operands)
            start = None if target is None else self._index(int(target.group(1), 16))
            if start is not None and start < i:
                found.append(Loop(start, i))
        return found

    def innermost_loops(self) -> list[Loop]:
        loops = self.loops()
        return [a for a in loops if not any(a.contains(b) for b in loops)]

    def count(self, prefix: str | tuple[str, ...], loop: Loop | None = None) -> int:
        """Instructions whose opcode starts with ``prefix`` (or one of several; in ``loop``, or anywhere)."""
        body = self.instructions if loop is None else self.instructions[loop.start : loop.end + 1]
        return sum(ins.opcode.startswith(prefix) for ins in body)

    def spills_in_loops(self) -> int:
        """Local-memory loads and stores inside any loop.

        >>> Sass.parse('''
        ...         /*0000*/                   STL [R1], R2 ;
        ...         /*0010*/                   LDL R3, [R1] ;
        ...         /*0020*/               @P0 BRA 0x10 ;
        ... ''').spills_in_loops()
        1
        """
        inside = {i for loop in self.loops() for i in range(loop.start, loop.end + 1)}
        return sum(self.instructions[i].opcode.startswith(("LDL", "STL")) for i in inside)

    def count_tcgen05(self, loop: Loop | None = None) -> int:
        """sm_100's tensor-core matmuls: UTCHMMA (fp16/bf16), UTCQMMA, UTCIMMA, ... (tcgen05.mma)."""
        body = self.instructions if loop is None else self.instructions[loop.start : loop.end + 1]
        return sum(_TCGEN05.match(ins.opcode) is not None for ins in body)

    def main_loop(self) -> Loop | None:
        """The leanest innermost loop with tensor-core instructions (see the module docstring)."""
        mma = [loop for loop in self.innermost_loops()
               if self.count(WGMMA, loop) or self.count(MMA_SYNC, loop) or self.count_tcgen05(loop)]
        return min(mma, key=lambda loop: loop.length, default=None)

    def hgmma_groups(self) -> int:
        return sum(ins.opcode.startswith(WGMMA) and "gsb0" in ins.operands for ins in self.instructions)

    def hgmma_overlap(self) -> list[int]:
        """For each HGMMA group, how many instructions run between its last HGMMA and the wait that retires every
        group in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x0``): the work that overlaps the matmul."""
        gaps, pending = [], []
        for i, ins in enumerate(self.instructions):
            if ins.opcode.startswith(WGMMA) and "gsb0" in ins.operands:
                pending.append(i)
            elif ins.opcode == "WARPGROUP.DEPBAR.LE" and ins.operands.replace(" ", "") == "gsb0,0x0":
                gaps += [i - p - 1 for p in pending]
                pending = []
        return gaps

    def hgmma_waited_at_once(self, within: int = WAITED_AT_ONCE) -> int:
        """HGMMA groups retired within ``within`` instructions of their issue: nothing useful overlaps them."""
        return sum(gap <= within for gap in self.hgmma_overlap())
