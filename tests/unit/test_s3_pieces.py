"""Cutting a response body, in chunks of any size, into pieces of exactly one size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from cachefsd.store.s3 import _cut


async def _chunks(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _pieces(chunks: list[bytes], piece: int, length: int) -> list[bytearray]:
    """Kept as yielded, as the reader keeps blocks: a buffer reused for the
    next piece would change one kept already."""
    return [cut async for cut in _cut(_chunks(chunks), piece, length)]


@given(
    chunks=st.lists(st.binary(max_size=300), max_size=12),
    piece=st.integers(min_value=1, max_value=200),
    short=st.integers(min_value=0, max_value=50),
)
def test_pieces_hold_the_body_exactly_in_pieces_of_one_size(
    chunks: list[bytes], piece: int, short: int
) -> None:
    """``short``: the body ended that many bytes before the range did (the end of the object)."""
    body = b"".join(chunks)
    pieces = asyncio.run(_pieces(chunks, piece, len(body) + short))
    assert b"".join(pieces) == body
    assert all(len(cut) == piece for cut in pieces[:-1])
    assert not pieces or 0 < len(pieces[-1]) <= piece
    assert len(pieces) == -(-len(body) // piece)
