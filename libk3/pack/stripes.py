"""A trunk laid over several drives (formats/pack.md "Striped trunk"): the stripe layout,
each stripe file's identity header, and the objects that write and read the striped
trunk as if it were one file.

Owns: where logical trunk byte x lives (which stripe file, at which offset), the stripe
files' names and headers, the `stripes` manifest field's form, the checks that refuse a
missing stripe directory, a missing, truncated or foreign stripe file or a damaged header
(one line naming the file), ``StripedOut`` (the writer's and compressor's output: split
writes, resume reads, rename at the end) and ``StripedFile`` (the reader: a
``DirectFile``-shaped object whose reads fan out over the drives' queues,
``libk3.io.direct.DriveQueue``). Does not own: the rest of the manifest
(``libk3.pack.schema``), what is copied (``libk3.pack.writer``) or when a layer's CRC is
checked (``libk3.stream.trunk``).

Why fixed-size stripes, round robin: every layer (and every piece a reader asks for)
spreads over all drives in proportion, whatever the layers' sizes, so N drives read one
layer N at a time; per-layer placement would leave a drive idle while the other reads a
big layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import zlib
from pathlib import Path

from ..errors import FormatError, K3IOError, UsageError
from ..io.atomic import fsync_dir
from ..io.direct import ALIGN, HUGE_PAGE

STRIPE_BYTES = HUGE_PAGE              # formats/pack.md "Striped trunk": why 2 MiB
HEADER_BYTES = ALIGN                  # the identity header; data starts aligned after it
STRIPE_MAGIC = b"K3STRIPE"
STRIPE_FORMAT, STRIPE_VERSION = "k3-stripe", 1
_KEYS = ("pack_id", "stripe_bytes", "header_bytes", "files")
_FILE_KEYS = ("dir", "name", "data_bytes")
_HEADER_KEYS = ("format", "version", "pack_id", "index", "count", "stripe_bytes",
                "data_bytes", "trunk_file")
MOVED_HINT = ("mount the drive, or pass the stripe directories where they are now with "
              "--stripe-dir (in order)")


def new_pack_id() -> str:
    return secrets.token_hex(8)


def stripe_name(trunk_file: str, pack_id: str, index: int) -> str:
    return f"{trunk_file}.{pack_id}.{index}"


def data_bytes(total: int, count: int, index: int, stripe: int = STRIPE_BYTES) -> int:
    """Bytes of a ``total``-byte trunk that stripe file ``index`` of ``count`` holds."""
    full, rem = divmod(total, stripe)
    n = (full // count + (1 if index < full % count else 0)) * stripe
    return n + (rem if index == full % count else 0)


def segments(off: int, n: int, count: int, stripe: int = STRIPE_BYTES):
    """(stripe index, offset in its file, offset in the request, length) of the logical
    range [off, off + n), in order."""
    pos = 0
    while pos < n:
        k, within = divmod(off + pos, stripe)
        take = min(stripe - within, n - pos)
        yield k % count, HEADER_BYTES + (k // count) * stripe + within, pos, take
        pos += take


@dataclasses.dataclass
class Layout:
    """A striped trunk: its pack id, stripe size, and each stripe file's path (index 0 in
    the pack directory), data bytes and manifest entry."""
    pack_id: str
    stripe_bytes: int
    paths: list
    sizes: list
    trunk_file: str

    @property
    def count(self) -> int:
        return len(self.paths)

    def header(self, index: int) -> bytes:
        doc = {"format": STRIPE_FORMAT, "version": STRIPE_VERSION, "pack_id": self.pack_id,
               "index": index, "count": self.count, "stripe_bytes": self.stripe_bytes,
               "data_bytes": self.sizes[index], "trunk_file": self.trunk_file}
        blob = json.dumps(doc, sort_keys=True).encode()
        head = STRIPE_MAGIC + len(blob).to_bytes(4, "little") + \
            zlib.crc32(blob).to_bytes(4, "little") + blob
        return head + bytes(HEADER_BYTES - len(head))

    def holding(self, off: int, n: int) -> str:
        """The stripe files holding logical bytes [off, off + n), for an error line."""
        idx = sorted({i for i, *_ in segments(off, n, self.count, self.stripe_bytes)})
        return " or ".join(str(self.paths[i]) for i in idx)


def plan_layout(pack_dir, stripe_dirs, trunk_file: str, total: int, pack_id: str) -> tuple:
    """(Layout, manifest field) for a new striped trunk of ``total`` bytes over the pack
    directory and ``stripe_dirs``; a relative stripe directory is recorded relative to the
    pack directory (so the two can move together)."""
    d = Path(pack_dir)
    dirs = [d] + [Path(s) for s in stripe_dirs]
    recorded = ["."] + [s if os.path.isabs(s) else
                        os.path.relpath(os.path.abspath(s), os.path.abspath(d))
                        for s in map(str, stripe_dirs)]
    n = len(dirs)
    names = [stripe_name(trunk_file, pack_id, i) for i in range(n)]
    sizes = [data_bytes(total, n, i) for i in range(n)]
    field = {"pack_id": pack_id, "stripe_bytes": STRIPE_BYTES, "header_bytes": HEADER_BYTES,
             "files": [{"dir": r, "name": nm, "data_bytes": s}
                       for r, nm, s in zip(recorded, names, sizes)]}
    return Layout(pack_id, STRIPE_BYTES, [p / nm for p, nm in zip(dirs, names)], sizes,
                  trunk_file), field


def check_field(f, v, trunk_file: str, total: int) -> None:
    """The manifest's ``stripes`` field (``f``: schema's field checker)."""
    f.obj(v, "stripes", _KEYS)
    pid = v["pack_id"]
    if type(pid) is not str or len(pid) != 16 or any(c not in "0123456789abcdef" for c in pid):
        f.fail("stripes.pack_id", "must be 16 lowercase hex digits", found=pid)
    sb = f.int(v["stripe_bytes"], "stripes.stripe_bytes", HUGE_PAGE, 1 << 40)
    if sb % HUGE_PAGE:
        f.fail("stripes.stripe_bytes", f"must be a multiple of {HUGE_PAGE}", found=sb)
    f.eq(v["header_bytes"], HEADER_BYTES, "stripes.header_bytes")
    files = f.list(v["files"], "stripes.files")
    if len(files) < 2:
        f.fail("stripes.files", "a striped trunk has two stripe files or more", found=len(files))
    for i, e in enumerate(files):
        fld = f"stripes.files[{i}]"
        f.obj(e, fld, _FILE_KEYS)
        if type(e["dir"]) is not str or not e["dir"] or "\0" in e["dir"] \
                or (i == 0 and e["dir"] != "."):
            f.fail(f"{fld}.dir", "must be a directory ('.' for the first)", found=e["dir"])
        f.eq(e["name"], stripe_name(trunk_file, pid, i), f"{fld}.name")
        f.eq(e["data_bytes"], data_bytes(total, len(files), i, sb), f"{fld}.data_bytes",
             "is not this stripe's share of trunk_bytes")


def open_layout(pack_dir, man: dict, stripe_dirs=None) -> Layout:
    """The checked stripe files of manifest ``man`` (its ``stripes`` field already checked
    by ``check_field``): each directory there, each file there, of its exact size, with
    this pack's header. ``stripe_dirs`` overrides where stripes 1.. are (in order)."""
    d = Path(pack_dir)
    v = man["stripes"]
    files = v["files"]
    if stripe_dirs:
        if len(stripe_dirs) != len(files) - 1:
            raise UsageError(f"{d}: the pack has {len(files) - 1} stripe directories besides "
                             f"itself; --stripe-dir was given {len(stripe_dirs)} times")
        dirs = [d] + [Path(s) for s in stripe_dirs]
    else:
        dirs = [d if e["dir"] == "." else (d / e["dir"]) for e in files]
    lay = Layout(v["pack_id"], v["stripe_bytes"], [p / e["name"] for p, e in zip(dirs, files)],
                 [e["data_bytes"] for e in files], man["trunk_file"])
    for i, path in enumerate(lay.paths):
        if not path.parent.is_dir():
            raise FormatError(f"stripe directory {i} of {lay.count} is missing (drive not "
                              "mounted?)", path=path.parent, hint=MOVED_HINT)
        check_stripe_file(path, lay, i)
    return lay


def check_stripe_file(path: Path, lay: Layout, i: int) -> None:
    """Refuse a missing, truncated or foreign stripe file or a damaged header."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER_BYTES)
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise FormatError(f"stripe file {i} of {lay.count} is missing", path=path,
                          hint=MOVED_HINT) from None
    except OSError as e:
        raise K3IOError(f"cannot read stripe file: {e.strerror}", path=path) from None
    doc = None
    n = int.from_bytes(head[8:12], "little")
    blob = head[16:16 + n]
    if head[:8] == STRIPE_MAGIC and 16 + n <= len(head) \
            and zlib.crc32(blob) == int.from_bytes(head[12:16], "little"):
        try:
            doc = json.loads(blob)
        except (ValueError, RecursionError):
            doc = None
    if type(doc) is not dict or sorted(doc) != sorted(_HEADER_KEYS) \
            or doc["format"] != STRIPE_FORMAT or doc["version"] != STRIPE_VERSION:
        raise FormatError("not a k3 stripe file, or its header is damaged", path=path,
                          hint="re-pack: k3-pack CHECKPOINT NEW_OUT --stripe DIR")
    if doc["pack_id"] != lay.pack_id or doc["trunk_file"] != lay.trunk_file:
        raise FormatError("stripe file belongs to another pack", path=path,
                          expected=f"pack {lay.pack_id} {lay.trunk_file}",
                          found=f"pack {doc['pack_id']} {doc['trunk_file']}")
    want = {"index": i, "count": lay.count, "stripe_bytes": lay.stripe_bytes,
            "data_bytes": lay.sizes[i]}
    for k, w in want.items():
        if doc[k] != w:
            raise FormatError(f"stripe header field {k} does not match the manifest "
                              "(stripes given out of order?)", path=path, expected=w,
                              found=doc[k], hint=MOVED_HINT)
    if size != HEADER_BYTES + lay.sizes[i]:
        raise FormatError("stripe file size does not match the manifest (truncated?)",
                          path=path, expected=HEADER_BYTES + lay.sizes[i], found=size)


def _io_error(e: OSError, path, doing: str) -> K3IOError:
    import errno

    why = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system",
           errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied"}
    return K3IOError(f"cannot {doing}: {why.get(e.errno, e.strerror)}", path=path)


class StripedOut:
    """Writing a striped trunk: one ``.partial`` file per stripe (header written when it
    is created), ``pwrite`` / ``preadv`` at logical offsets, ``finish`` renames them."""

    def __init__(self, lay: Layout, direct: bool = True, header_now: bool = True):
        self.lay, self.header_now = lay, header_now
        self.partial = [p.with_name(p.name + ".partial") for p in lay.paths]
        self.fds: list = []
        self.rfds: list = []            # buffered: resume reads any length at any offset
        try:
            for i, p in enumerate(self.partial):
                self.fds.append(self._open(p, i, direct))
        except BaseException:
            self.close()
            raise

    def _open(self, p: Path, i: int, direct: bool) -> int:
        try:
            if not p.is_file() or (self.header_now and not self.header_ok(i)):
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.pwrite(fd, self.lay.header(i) if self.header_now else
                              bytes(HEADER_BYTES), 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    return os.open(p, os.O_RDWR | os.O_DIRECT)
                except OSError:
                    pass
            return os.open(p, os.O_RDWR)
        except OSError as e:
            raise _io_error(e, p, "create the stripe file") from None

    def header_ok(self, i: int) -> bool:
        try:
            with open(self.partial[i], "rb") as fh:
                return fh.read(HEADER_BYTES) == self.lay.header(i)
        except OSError:
            return False

    def allocate(self, total: int | None = None) -> None:
        for i, fd in enumerate(self.fds):
            n = HEADER_BYTES + self.lay.sizes[i]
            if os.fstat(fd).st_size < n:
                try:
                    os.posix_fallocate(fd, 0, n)
                except OSError as e:
                    raise _io_error(e, self.partial[i], "reserve the stripe file") from None

    def _each(self, view, off: int, op, doing: str) -> int:
        done = 0
        for i, at, pos, n in segments(off, len(view), self.lay.count, self.lay.stripe_bytes):
            try:
                k = op(i, view[pos:pos + n], at)
            except OSError as e:
                raise _io_error(e, self.partial[i], doing) from None
            done += k
            if k != n:
                if doing.startswith("write"):
                    raise K3IOError("short write (disk full?)", path=self.partial[i])
                break
        return done

    def pwrite(self, view, off: int) -> int:
        return self._each(memoryview(view), off, lambda i, v, a: os.pwrite(self.fds[i], v, a),
                          "write the stripe file")

    def preadv(self, bufs, off: int) -> int:
        if not self.rfds:
            self.rfds = [os.open(p, os.O_RDONLY) for p in self.partial]
        return self._each(memoryview(bufs[0]), off,
                          lambda i, v, a: os.preadv(self.rfds[i], [v], a),
                          "read the stripe file")

    def truncate(self, total: int) -> None:
        """The trunk ends at ``total`` (a compressed one, known only now): each file cut
        to its share, and its header (``header_now`` False) written."""
        self.lay.sizes = [data_bytes(total, self.lay.count, i, self.lay.stripe_bytes)
                          for i in range(self.lay.count)]
        for i, fd in enumerate(self.fds):
            os.ftruncate(fd, HEADER_BYTES + self.lay.sizes[i])
            os.pwrite(fd, self.lay.header(i), 0)

    def field(self, old: dict) -> dict:
        """The manifest's ``stripes`` field for these files (directories as ``old``)."""
        return {**old, "files": [{**e, "name": p.name, "data_bytes": n} for e, p, n
                                 in zip(old["files"], self.lay.paths, self.lay.sizes)]}

    def fsync(self) -> None:
        for fd in self.fds:
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds + self.rfds:
            os.close(fd)
        self.fds, self.rfds = [], []

    def finish(self) -> None:
        """Every stripe durable, then renamed to its final name (directories fsynced)."""
        for p, final in zip(self.partial, self.lay.paths):
            os.replace(p, final)
            fsync_dir(final.parent)

    def discard(self) -> None:
        for p in self.partial:
            p.unlink(missing_ok=True)


class StripedFile:
    """The striped trunk read as one file: ``read_window`` as ``DirectFile``'s, each
    stripe segment sent to its drive's queue (``files.get(stripe path)``: a DirectFile
    bound to the drive's ``DriveQueue``), all drives reading at once."""

    def __init__(self, lay: Layout, files, logical_path):
        self.lay = lay
        self.path = str(logical_path)
        self.size = sum(lay.sizes)
        self.files, self.owned = files, False
        self.parts = [files.get(p) for p in lay.paths]
        self.direct = all(p.direct for p in self.parts)
        self.drives = tuple(d for p in self.parts for d in (p.drives or ()))
        self._plain = None

    def where(self, off: int, n: int) -> str:
        return self.lay.holding(off, n)

    def read_window(self, offset: int, nbytes: int, buf, what: str = "", yield_to=None,
                    pool=None, depth: int = 1, cancel=None, on_piece=None) -> int:
        start = offset - offset % ALIGN
        end = min(-(-(offset + nbytes) // ALIGN) * ALIGN, self.size)
        if offset + nbytes > self.size:
            raise FormatError("read past the end of the striped trunk", path=self.path,
                              tensor=what, expected=f"<= {self.size}", found=offset + nbytes)
        view = memoryview(buf)[:end - start]
        if yield_to is not None:
            yield_to.wait_clear(drives=self.drives)
        if cancel is not None and cancel.is_set():
            from ..io.direct import ReadCancelled
            raise ReadCancelled()
        futs = [(i, n, self.parts[i].submit(view[pos:pos + n], at, what))
                for i, at, pos, n in segments(start, end - start, self.lay.count,
                                              self.lay.stripe_bytes)]
        short = None
        for i, n, fut in futs:
            got = fut.result()
            if got != n and short is None:
                short = i
        if short is not None:
            raise FormatError("stripe file ends early (truncated?)", path=self.lay.paths[short],
                              tensor=what)
        if on_piece is not None:
            on_piece(0, end - start)
        return offset - start

    def preadv(self, bufs, off: int) -> int:
        """Buffered read of any range (verify's and compress's resume reads)."""
        if self._plain is None:
            self._plain = [os.open(p, os.O_RDONLY) for p in self.lay.paths]
        view, done = memoryview(bufs[0]), 0
        n = max(0, min(len(view), self.size - off))
        for i, at, pos, k in segments(off, n, self.lay.count, self.lay.stripe_bytes):
            try:
                got = os.preadv(self._plain[i], [view[pos:pos + k]], at)
            except OSError as e:
                raise _io_error(e, self.lay.paths[i], "read the stripe file") from None
            done += got
            if got != k:
                break
        return done

    def close(self) -> None:            # the parts belong to the FileSet
        for fd in self._plain or ():
            os.close(fd)
        self._plain = None
        if self.owned:
            self.files.close()


def renamed(lay: Layout, trunk_file: str) -> Layout:
    """The same pack's stripes of another trunk file (trunk.kz beside trunk.bin), in the
    same directories; their sizes are set when written (``StripedOut.truncate``)."""
    return Layout(lay.pack_id, lay.stripe_bytes,
                  [p.with_name(stripe_name(trunk_file, lay.pack_id, i))
                   for i, p in enumerate(lay.paths)], [0] * lay.count, trunk_file)


def open_reader(lay: Layout, logical_path, use_direct: bool = True):
    """A StripedFile over its own FileSet (for verify and compress, outside a run),
    closing it when closed."""
    from ..io.direct import FileSet

    f = StripedFile(lay, FileSet(use_direct=use_direct), logical_path)
    f.owned = True
    return f

