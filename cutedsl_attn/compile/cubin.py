"""The resources the assembler recorded in a cubin (registers and stack frame per kernel), read from its ELF
``.nv.info`` section: no CUDA tools needed.  Host code of the compile layer."""

from __future__ import annotations

# ELF .nv.info attributes (CUDA's EIATTR ids): kernel-wide register count and per-thread stack frame
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11


def cubin_kernel_resources(cubin: bytes) -> dict[str, dict[str, int]]:
    """``{kernel symbol: {"registers": ..., "stack_bytes": ...}}`` of every kernel in ``cubin``.

    Read from the ELF ``.nv.info`` section the assembler writes (no CUDA tools needed); each attribute names its
    kernel by symbol index (device functions with a frame size but no register count are not kernels and are not
    listed).  ``registers`` is the launch register count (``cuobjdump -res-usage``'s ``REG``;
    kernels that rebalance with ``setmaxnreg`` report the launch value), ``stack_bytes`` its ``STACK`` (> 0
    means spills or a local array).  Raises ``ValueError`` for a blob that is not a 64-bit ELF or whose kernels
    lack the attributes.
    """
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQI", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off = heads[shstrndx][4]

    def cstr(at: int) -> str:
        return cubin[at: cubin.index(b"\0", at)].decode(errors="replace")

    symbols: list[str] = []
    for name, typ, _flags, _addr, off, size, link in heads:
        if typ == 2:  # SHT_SYMTAB: Elf64_Sym entries, names in the linked string table
            str_off = heads[link][4]
            symbols = [cstr(str_off + struct.unpack_from("<I", cubin, off + j)[0]) for j in range(0, size, 24)]
    found: dict[int, dict[str, int]] = {}
    for name, _typ, _flags, _addr, off, size, _link in heads:
        if cstr(names_off + name) != ".nv.info":
            continue
        i, blob = 0, cubin[off: off + size]
        while i + 2 <= len(blob):
            fmt, attr = blob[i], blob[i + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size + payload
                n = struct.unpack_from("<H", blob, i + 2)[0]
                payload, i = blob[i + 4: i + 4 + n], i + 4 + n
                if n == 8 and attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
                    sym, val = struct.unpack("<II", payload)
                    found.setdefault(sym, {})["registers" if attr == _EIATTR_REGCOUNT else "stack_bytes"] = val
            else:  # EIFMT_NVAL (2 bytes), EIFMT_BVAL / EIFMT_HVAL (4 bytes)
                i += 2 if fmt == 1 else 4
    kernels = {k: v for k, v in found.items() if "registers" in v}  # callees carry a frame size only
    if not kernels or any("stack_bytes" not in v for v in kernels.values()):
        raise ValueError(f"cubin .nv.info lacks the register/frame attributes (found {found})")
    return {(symbols[k] if k < len(symbols) else f"symbol {k}"): v for k, v in kernels.items()}


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack-frame bytes per thread of the kernel in ``cubin``; for a cubin of several
    kernels (a launch of two kernels, e.g. the chunked GDN prep + main) the largest of each over its kernels
    (:func:`cubin_kernel_resources` has them per kernel).  Raises ``ValueError`` as that function."""
    per = cubin_kernel_resources(cubin).values()
    return {k: max(v[k] for v in per) for k in ("registers", "stack_bytes")}
