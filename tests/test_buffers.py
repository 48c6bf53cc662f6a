"""Buffers walked as one stream (tiering.backends.buffers): what partial vectored reads and
writes, and the S3 tier's uploads and downloads, rely on."""

from tiering.backends.buffers import advance, spans


def test_advance_drops_the_bytes_a_partial_call_moved():
    data = bytearray(b"abcdefghij")
    buffers = [memoryview(data)[0:3], memoryview(data)[3:7], memoryview(data)[7:10]]
    advance(buffers, 5)  # the first buffer and 2 bytes of the second
    assert [bytes(b) for b in buffers] == [b"fg", b"hij"]
    advance(buffers, 2)
    assert [bytes(b) for b in buffers] == [b"hij"]
    advance(buffers, 3)
    assert buffers == []


def test_spans_cover_a_range_across_buffers_and_stop_at_the_end():
    buffers = [memoryview(bytearray(3)), memoryview(bytearray(4)), memoryview(bytearray(3))]
    which = {id(b): i for i, b in enumerate(buffers)}
    assert [(which[id(b)], start, n) for b, start, n in spans(buffers, 2, 6)] == [(0, 2, 1), (1, 0, 4), (2, 0, 1)]
    assert [(start, n) for _, start, n in spans(buffers, 8, 100)] == [(1, 2)]  # up to the stream's end
    assert list(spans(buffers, 10, 5)) == [] and list(spans(buffers, 0, 0)) == []
