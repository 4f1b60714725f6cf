"""HPACK (RFC 7541) for agent.proxy.h2codec: header lists to blocks and back.

The `hpack` package's own Encoder and Decoder cost about a third of a proxied h2
stream (tuple subclasses per field, str/bytes conversions, Huffman-coding every
literal in Python); this keeps their tables (the static table, the Huffman decoder)
and does the rest in a few dict lookups per field.

Rules:
1. `Decoder.decode(block)` returns the fields as `(bytes, bytes)` tuples, a
   never-indexed one as `hpack.NeverIndexedHeaderTuple` (RFC 7541 7.1.3: an
   intermediary forwards it as never indexed); a malformed block raises
   `HpackError`, a list over `max_list` bytes (RFC 9113 6.5.2 accounting)
   `HpackTooLargeError`. Either leaves the decoder unusable (a connection error).
2. A table size update above the size we allow (`allowed`, our SETTINGS value,
   4096 by default) or after the first field of a block is an error.
3. `Encoder.encode(headers)` indexes a field found in the static or dynamic
   table; otherwise it sends a literal, indexed for next time unless the field
   is never-indexed (a `NeverIndexedHeaderTuple`, h2msg rule 4) or larger than
   a quarter of the table. Literals are sent without Huffman coding (valid
   HPACK: a few bytes more, no per-byte Python work).
4. `Encoder.resize(n)` follows the peer's SETTINGS_HEADER_TABLE_SIZE (at most
   4096 used): the change goes out at the start of the next block.
5. The encoder remembers the blocks of lists whose encoding inserted nothing
   (up to `MEMO` of them): while the dynamic table is unchanged (same insert
   count, no resize), the same list encodes to the same block, so a repeated
   list costs one dict lookup. A list holding a never-indexed field is not
   remembered (it compares equal to its plain twin). The list encoded last is also
   remembered by identity: the same list object again, with the table unchanged, is
   one identity check, where the lookup hashed and compared a tuple of its fields
   (3.8% of a cross-node request, bench/RESULTS.md fifty-fifth pass). Callers treat a
   list they gave to `encode` as read-only, as decoded lists are (rule 6).
6. The decoder remembers the lists of blocks whose decoding changed nothing in
   the table (no insert, no size update; up to `MEMO` of them): while the table
   is unchanged, the same block is the same list, returned again as the same
   object (a repeat is then an identity check for the memos above it, e.g.
   agent.proxy.h2route). Callers treat a decoded list as read-only.
"""

from __future__ import annotations

from typing import Any, Final, cast

from hpack import NeverIndexedHeaderTuple
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from agent.errors import AgentError

Field = tuple[bytes, bytes]
DEFAULT_TABLE: Final = 4096
ENTRY_OVERHEAD: Final = 32
_STATIC: Final[tuple[Field, ...]] = tuple(HeaderTable.STATIC_TABLE)
_FIRST_DYNAMIC: Final = len(_STATIC) + 1  # 62
_STATIC_EXACT: Final[dict[Field, int]] = {}
_STATIC_NAME: Final[dict[bytes, int]] = {}
for _i, (_n, _v) in enumerate(_STATIC, start=1):
    _STATIC_EXACT.setdefault((_n, _v), _i)
    _STATIC_NAME.setdefault(_n, _i)
MEMO: Final = 64  # blocks the encoder remembers (rule 5)
_MAX_INT_SHIFT: Final = 28  # no index or length we accept needs more than 4 continuation bytes


class HpackError(AgentError):
    """A header block does not decode (rule 1)."""


class HpackTooLargeError(HpackError):
    """A decoded header list is over the size we accept (rule 1)."""


def _read_int(block: bytes, pos: int, bits: int) -> tuple[int, int]:
    """The integer with a `bits`-bit prefix at `pos`, and the offset after it."""
    mask = (1 << bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            msg = "integer past the end of the block"
            raise HpackError(msg)
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > _MAX_INT_SHIFT:
            msg = "integer too large"
            raise HpackError(msg)


def _read_str(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        msg = "string past the end of the block"
        raise HpackError(msg)
    huffman = block[pos] & 0x80
    size, pos = _read_int(block, pos, 7)
    end = pos + size
    if end > len(block):
        msg = "string past the end of the block"
        raise HpackError(msg)
    raw = block[pos:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as exc:  # the package raises its own error types
            msg = f"bad Huffman string: {exc}"
            raise HpackError(msg) from exc
    return raw, end


_BYTES: Final = [bytes((i,)) for i in range(256)]


def _int(value: int, bits: int, flags: int) -> bytes:
    """`value` with a `bits`-bit prefix, the first byte or-ed with `flags`."""
    mask = (1 << bits) - 1
    if value < mask:
        return _BYTES[flags | value]
    out = bytearray((flags | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _str(raw: bytes) -> bytes:
    return _int(len(raw), 7, 0) + raw


class _Table:
    """The dynamic table: newest entry last; entry `k` (0-based insert count) is at
    HPACK index 62 + (inserts - 1 - k) while it is still held."""

    __slots__ = ("entries", "inserts", "max", "size")

    def __init__(self) -> None:
        self.entries: list[Field] = []
        self.size = 0
        self.max = DEFAULT_TABLE
        self.inserts = 0

    def add(self, field: Field) -> list[Field]:
        """Insert `field`; the entries evicted for it, oldest first."""
        cost = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        evicted = self.shrink(self.max - cost)
        self.inserts += 1
        if cost <= self.max:
            self.entries.append(field)
            self.size += cost
        else:  # larger than the table: it empties the table and is not held
            evicted += self.entries
            self.entries.clear()
            self.size = 0
        return evicted

    def shrink(self, room: int) -> list[Field]:
        evicted: list[Field] = []
        entries = self.entries
        while entries and self.size > room:
            old = entries.pop(0)
            evicted.append(old)
            self.size -= len(old[0]) + len(old[1]) + ENTRY_OVERHEAD
        return evicted


class Decoder:
    """Header blocks to header lists; see the module rules."""

    def __init__(self, *, max_list: int, allowed: int = DEFAULT_TABLE) -> None:
        self.max_list = max_list
        self.allowed = allowed
        self._table = _Table()
        self._memo: dict[bytes, list[Field]] = {}  # block -> list (rule 6)
        self._memo_at = 0  # the table's insert count the memo holds for

    def _field(self, index: int) -> Field:
        if 0 < index < _FIRST_DYNAMIC:
            return _STATIC[index - 1]
        back = index - _FIRST_DYNAMIC + 1
        entries = self._table.entries
        if index <= 0 or back > len(entries):
            msg = f"index {index} is not in the table"
            raise HpackError(msg)
        return entries[-back]

    def _name(self, block: bytes, pos: int, bits: int) -> tuple[bytes, int]:
        index, pos = _read_int(block, pos, bits)
        if index:
            return self._field(index)[0], pos
        return _read_str(block, pos)

    def decode(self, block: bytes) -> list[Field]:
        """The header list of `block` (rules 1, 2 and 6), not to be changed by the caller.

        Raises:
            HpackError: the block is malformed.
            HpackTooLargeError: the list is over `max_list`.
        """
        inserts = self._table.inserts
        if self._memo_at != inserts:
            self._memo.clear()
            self._memo_at = inserts
        got = self._memo.get(block)
        if got is not None:
            return got
        out = self._decode(block)
        if self._table.inserts == inserts and not (block and block[0] & 0xE0 == 0x20):
            if len(self._memo) >= MEMO:
                self._memo.clear()
            self._memo[block] = out
        return out

    def _decode(self, block: bytes) -> list[Field]:
        out: list[Any] = []  # objects: see `Encoder.encode`
        pos = 0
        end = len(block)
        total = 0
        field: Any
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _read_int(block, pos, 7)
                field = self._field(index)
            elif byte & 0x40:  # literal, indexed
                name, pos = self._name(block, pos, 6)
                value, pos = _read_str(block, pos)
                field = (name, value)
                self._table.add(field)
            elif byte & 0x20:  # table size update
                if out:
                    msg = "table size update after a field"
                    raise HpackError(msg)
                size, pos = _read_int(block, pos, 5)
                if size > self.allowed:
                    msg = f"table size {size} over {self.allowed}"
                    raise HpackError(msg)
                self._table.max = size
                self._table.shrink(size)
                continue
            else:  # literal, not indexed (0x00) or never indexed (0x10)
                name, pos = self._name(block, pos, 4)
                value, pos = _read_str(block, pos)
                if byte & 0x10:  # noqa: SIM108 - compiled, a conditional expression is a tuple
                    field = NeverIndexedHeaderTuple(name, value)
                else:
                    field = (name, value)
            total += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if total > self.max_list:
                msg = f"header list over {self.max_list} bytes"
                raise HpackTooLargeError(msg)
            out.append(field)
        return out


class Encoder:
    """Header lists to header blocks; see the module rules."""

    def __init__(self) -> None:
        self._table = _Table()
        self._exact: dict[Field, int] = {}  # field -> insert number
        self._names: dict[bytes, int] = {}  # name -> insert number of its newest entry
        self._resized: int | None = None
        self._memo: dict[tuple[Any, ...], bytes] = {}  # list -> block (rule 5)
        self._memo_at = 0  # the table's insert count the memo holds for
        self._last: object = None  # the list encoded last, by identity (rule 5)
        self._last_block = b""

    def resize(self, size: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE (rule 4)."""
        size = min(size, DEFAULT_TABLE)
        if size == self._table.max:
            return
        self._memo.clear()
        self._last = None
        self._table.max = size
        self._forget(self._table.shrink(size))
        self._resized = size

    def _forget(self, evicted: list[Field]) -> None:
        oldest = self._table.inserts - len(self._table.entries)  # first insert still held
        for name, value in evicted:
            key = (name, value)
            if self._exact.get(key, oldest) < oldest:
                del self._exact[key]
            if self._names.get(name, oldest) < oldest:
                del self._names[name]

    def _dynamic(self, number: int | None) -> int:
        """The HPACK index of insert `number`, 0 when it is no longer held."""
        if number is None:
            return 0
        table = self._table
        back = table.inserts - number
        return _FIRST_DYNAMIC - 1 + back if back <= len(table.entries) else 0

    def encode(self, headers: list[Field]) -> bytes:
        """The header block of `headers` (rules 3, 5)."""
        inserts = self._table.inserts
        if headers is self._last and self._memo_at == inserts and self._resized is None:
            return self._last_block
        fields = cast("list[Any]", headers)
        if self._resized is not None or not all(type(x) is tuple for x in fields):
            return self._encode(headers)
        if self._memo_at != inserts:
            self._memo.clear()
            self._memo_at = inserts
            self._last = None
        key = tuple(fields)
        block = self._memo.get(key)
        if block is None:
            block = self._encode(headers)
            if self._table.inserts == inserts:
                if len(self._memo) >= MEMO:
                    self._memo.clear()
                self._memo[key] = block
        if self._table.inserts == inserts:
            self._last = headers
            self._last_block = block
        return block

    def _encode(self, headers: list[Field]) -> bytes:
        out = bytearray()
        if self._resized is not None:
            out += _int(self._resized, 5, 0x20)
            self._resized = None
        # Fields as objects: compiled, a tuple-typed one would be copied into a plain
        # tuple, dropping the never-indexed mark (agent.proxy.h2msg rule 4).
        for field in cast("list[Any]", headers):
            name: bytes = field[0]
            value: bytes = field[1]
            never = isinstance(field, NeverIndexedHeaderTuple)
            if not never:
                key = (name, value)
                index = _STATIC_EXACT.get(key) or self._dynamic(self._exact.get(key))
                if index:
                    if index < 0x7F:  # the common case: one byte
                        out.append(0x80 | index)
                    else:
                        out += _int(index, 7, 0x80)
                    continue
            name_index = _STATIC_NAME.get(name) or self._dynamic(self._names.get(name))
            cost = len(name) + len(value) + ENTRY_OVERHEAD
            if never or cost > self._table.max // 4:
                out += _int(name_index, 4, 0x10 if never else 0)
            else:
                out += _int(name_index, 6, 0x40)
                self._insert(name, value)
            if not name_index:
                out += _str(name)
            out += _str(value)
        return bytes(out)

    def _insert(self, name: bytes, value: bytes) -> None:
        number = self._table.inserts
        evicted = self._table.add((name, value))
        self._exact[name, value] = number
        self._names[name] = number
        self._forget(evicted)
