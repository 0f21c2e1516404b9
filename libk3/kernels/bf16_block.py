"""The coded trunk block's layout (formats/pack.md "Compressed trunk"), without numba.

Owns: the header's size and fields, the code's window and the decoder's status codes, so
that manifest checks (``libk3.pack.codec``) and the kernels
(``libk3.kernels.bf16_planes``) share them without the checks loading numba.
"""

HEADER_BYTES = 8                   # mode u8, base u8, two zero bytes, escape count u32
NIBBLE, VERBATIM = 0, 1            # the header's mode byte
WINDOW = 15                        # codes 0..14: exponents base .. base + 14
ESCAPE = 15                        # the code of an exponent outside the window
MAX_BASE = 255 - (WINDOW - 1)
OK, BAD_LENGTH, BAD_HEADER, BAD_ESCAPE = 0, 1, 2, 3      # decode status of a block
PROBLEMS = {
    BAD_LENGTH: "its stored length is not the one its header implies",
    BAD_HEADER: "its header is not a valid block header",
    BAD_ESCAPE: "an escape's position is outside the block, out of order or not marked",
}


def nibble_bytes(k, n_escapes):
    """Stored bytes of a NIBBLE block of k values with ``n_escapes`` escapes (plain
    arithmetic: the kernels compile this same function)."""
    return HEADER_BYTES + k + (k + 1) // 2 + 5 * n_escapes


def verbatim_bytes(k):
    """Stored bytes of a VERBATIM block of k values."""
    return HEADER_BYTES + 2 * k


def coded_range(k: int) -> tuple:
    """(fewest, most) stored bytes of a coded block of k values: the nibble form with no
    escape, and the verbatim form."""
    return nibble_bytes(k, 0), verbatim_bytes(k)
