"""agent.proxy.h2hpack against the `hpack` package as the reference, both ways."""

from __future__ import annotations

import random

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.proxy.h2hpack import Decoder, Encoder, HpackError, HpackTooLargeError

NAMES = [b":method", b":path", b"x-a", b"x-b", b"cookie", b"user-agent", b"content-type"]


def _lists(seed: int, count: int) -> list[list[tuple[bytes, bytes]]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        size = rnd.randint(0, 300 if rnd.random() < 0.1 else 12)
        fields = [
            (rnd.choice(NAMES), bytes(rnd.choice(b"abcxyz") for _ in range(size)))
            for _ in range(rnd.randint(1, 8))
        ]
        out.append(fields)
    return out


def test_what_we_encode_the_hpack_package_decodes_through_table_churn_and_resizes() -> None:
    ours, theirs = Encoder(), hpack.Decoder()
    for i, fields in enumerate(_lists(1, 2000)):
        if i % 400 == 0:
            size = (0, 256, 4096, 1024, 4096)[i // 400]
            ours.resize(size)
            theirs.header_table_size = size
        got = [(bytes(k), bytes(v)) for k, v in theirs.decode(ours.encode(fields), raw=True)]
        assert got == fields


def test_what_the_hpack_package_encodes_we_decode_huffman_and_all() -> None:
    theirs, ours = hpack.Encoder(), Decoder(max_list=1 << 20)
    for fields in _lists(2, 2000):
        assert ours.decode(theirs.encode(fields, huffman=True)) == fields


def test_a_repeated_list_is_all_indexed_the_second_time() -> None:
    enc = Encoder()
    fields = [(b":method", b"GET"), (b"x-trace", b"abc"), (b"user-agent", b"bench/1")]
    first = enc.encode(fields)
    second = enc.encode(fields)
    assert len(second) == len(fields)  # one byte per field: indexed
    assert len(first) > len(second)
    assert all(byte & 0x80 for byte in second)


def test_never_indexed_fields_stay_out_of_both_tables_and_keep_their_mark() -> None:
    enc, dec = Encoder(), Decoder(max_list=1 << 16)
    secret = hpack.NeverIndexedHeaderTuple(b"authorization", b"Bearer t")
    for _ in range(2):
        block = enc.encode([secret])
        assert block[0] & 0xF0 == 0x10  # literal never indexed, both times
        (got,) = dec.decode(block)
        assert got == secret
        assert isinstance(got, hpack.NeverIndexedHeaderTuple)


def test_remembered_blocks_stay_right_through_repeats_inserts_resizes_and_marks() -> None:
    # Few distinct lists, each sent many times (what the encoder remembers, rule 5), as
    # equal copies or as the very same objects (the last list is remembered by identity
    # too; the workers share their upgraded requests' lists, agent.proxy.h1toh2 rule 4),
    # between new fields (inserts), resizes and never-indexed twins of the same lists.
    rnd = random.Random(7)
    pool = _lists(3, 12)
    ours, theirs = Encoder(), hpack.Decoder()
    for i in range(3000):
        if i % 500 == 250:
            size = rnd.choice((0, 128, 1024, 4096))
            ours.resize(size)
            theirs.header_table_size = size
        picked = rnd.choice(pool)
        fields = picked if rnd.random() < 0.5 else list(picked)
        if rnd.random() < 0.1:
            fields = [*fields, (b"x-new", b"%d" % i)]  # inserted: the table changes
        never = rnd.random() < 0.1
        sent = [hpack.NeverIndexedHeaderTuple(*fields[0]), *fields[1:]] if never else fields
        block = ours.encode(sent)
        got = theirs.decode(block, raw=True)
        assert [(bytes(k), bytes(v)) for k, v in got] == fields
        assert isinstance(got[0], hpack.NeverIndexedHeaderTuple) == never


def test_the_last_list_is_encoded_again_after_a_resize_evicts_its_fields() -> None:
    # The same object again right after a shrink (whose size update went out with
    # another list): its remembered block named dynamic entries that are gone.
    fields = [(b":method", b"GET"), (b"x-trace", b"abc"), (b"x-span", b"def")]
    ours, theirs = Encoder(), hpack.Decoder()
    for _ in range(3):  # inserted, then indexed (remembered by identity)
        assert theirs.decode(ours.encode(fields), raw=True) == fields
    ours.resize(0)
    theirs.header_table_size = 0
    other = [(b":method", b"POST")]
    assert theirs.decode(ours.encode(other), raw=True) == other
    assert theirs.decode(ours.encode(fields), raw=True) == fields


def test_a_repeated_list_is_one_remembered_block_until_the_table_changes() -> None:
    enc = Encoder()
    fields = [(b":method", b"GET"), (b"x-trace", b"abc")]
    enc.encode(fields)  # inserts x-trace
    second = enc.encode(fields)
    assert enc.encode(fields) is second  # remembered
    enc.encode([(b"x-other", b"1")])  # an insert: indexes move
    third = enc.encode(fields)
    assert third is not second
    assert third != second  # x-trace is one entry further back now


def test_decoded_lists_stay_right_through_repeats_inserts_and_resizes() -> None:
    # The decoder's memo (rule 6) against the `hpack` package's decoder: few distinct
    # lists sent many times by hpack's encoder, between inserts and size updates.
    rnd = random.Random(11)
    pool = _lists(4, 10)
    theirs_enc, ours, reference = hpack.Encoder(), Decoder(max_list=1 << 20), hpack.Decoder()
    for i in range(3000):
        if i % 500 == 250:
            theirs_enc.header_table_size = rnd.choice((0, 128, 1024, 4096))
        fields = list(rnd.choice(pool))
        if rnd.random() < 0.1:
            fields.append((b"x-new", b"%d" % i))
        block = theirs_enc.encode(fields, huffman=rnd.random() < 0.5)
        want = [(bytes(k), bytes(v)) for k, v in reference.decode(block, raw=True)]
        assert ours.decode(block) == want == fields


def test_a_repeated_block_is_the_same_list_until_the_table_changes() -> None:
    dec = Decoder(max_list=1 << 16)
    inserting = b"\x82\x40\x07x-trace\x03abc"  # :method GET, x-trace: abc (indexed)
    assert dec.decode(inserting) == [(b":method", b"GET"), (b"x-trace", b"abc")]
    repeat = b"\x82\xbe"  # :method GET, dynamic entry 62
    first = dec.decode(repeat)
    assert first == [(b":method", b"GET"), (b"x-trace", b"abc")]
    assert dec.decode(repeat) is first  # the same object: an identity check above us
    assert dec.decode(inserting) is not dec.decode(inserting)  # inserts: never remembered
    dec.decode(b"\x40\x07x-other\x011")  # a new entry 62: x-trace moves back
    assert dec.decode(repeat) == [(b":method", b"GET"), (b"x-other", b"1")]


def test_a_block_with_a_size_update_is_decoded_each_time() -> None:
    dec = Decoder(max_list=1 << 16)
    block = b"\x3f\xe1\x1f\x82"  # table size 4096, then :method GET
    first = dec.decode(block)
    assert first == [(b":method", b"GET")]
    dec.allowed = 1024  # our SETTINGS value lowered: the same update is now over it
    with pytest.raises(HpackError):
        dec.decode(block)


def test_a_field_larger_than_the_table_is_sent_literal_and_not_indexed() -> None:
    enc, theirs = Encoder(), hpack.Decoder()
    big = [(b"x-big", b"v" * 2000)]
    block = enc.encode(big)
    assert block[0] & 0xC0 == 0  # literal without indexing
    assert [(bytes(k), bytes(v)) for k, v in theirs.decode(block, raw=True)] == big


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b"\x80", id="index-0"),
        pytest.param(b"\xbf", id="index-63-on-an-empty-table"),
        pytest.param(b"\xff\xff\xff\xff\xff\xff", id="endless-integer"),
        pytest.param(b"\x40\x85ab", id="string-past-the-end"),
        pytest.param(b"\x00\x81\xff\x00", id="bad-huffman"),
        pytest.param(b"\x3f\xe1\xff\x03", id="table-size-over-ours"),
        pytest.param(b"\x82\x20", id="table-size-update-after-a-field"),
    ],
)
def test_malformed_blocks_raise_hpack_error(block: bytes) -> None:
    with pytest.raises(HpackError):
        Decoder(max_list=1 << 16).decode(block)


def test_a_list_past_the_limit_raises_too_large() -> None:
    block = hpack.Encoder().encode([(b"x-a", b"v" * 100)] * 10)
    with pytest.raises(HpackTooLargeError):
        Decoder(max_list=1000).decode(block)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_hpack_error(block: bytes) -> None:
    try:
        fields = Decoder(max_list=1 << 16).decode(block)
    except HpackError:
        return
    assert all(type(name) is bytes and isinstance(value, bytes) for name, value in fields)
