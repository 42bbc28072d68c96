"""``cupy.cuda.nccl`` stand-in: NCCL's API (as ``cupy_backends/cuda/libs/nccl.pyx``) over loopback sockets.

As the real module:

* with NCCL unloadable (``CUPY_STANDIN_NCCL=0``) the import succeeds with
  ``available = False`` and no other names (``cupy/cuda/nccl.py``);
* ``get_unique_id()`` starts a bootstrap root in the calling process that
  serves ONE ``ncclCommInitRank`` round of ``ndev`` ranks and then stops
  listening, so a second communicator from the same id fails (here at once,
  with a system error, where NCCL retries and then fails);
* the id is ``bytes`` under CuPy 14 and a tuple of C ``char`` under 13 (signed
  on x86-64, unsigned on aarch64: a value out of range is ``OverflowError``);
* ``NcclCommunicator(ndev, commId, rank)`` blocks until all ``ndev`` ranks
  joined; two ranks on one device of one machine fail with "Duplicate GPU";
* collectives take integer pointers, counts in ELEMENTS, enum dtypes and ops
  and a stream pointer; they are queued on that stream and run when it runs
  (:mod:`cupy.cuda.streams`); inside ``groupStart()``/``groupEnd()`` they are
  only collected, and are queued at ``groupEnd()``;
* errors of queued work (a peer gone, a bad pointer, mismatched calls) are
  asynchronous: ``check_async_error()`` raises them as ``NcclError``.

Reductions are done in rank order (16-bit floats accumulated in float32,
rounded once), the order distopt's host backends use; NCCL's ring order
differs from it at three or more ranks.
"""
from __future__ import annotations

import os
import pickle
import secrets
import select
import socket
import struct
import threading
from typing import Any

import numpy as np

from .. import _state

if not _state.config.nccl:
    available = False  # what cupy/cuda/nccl.py leaves when libnccl cannot be loaded
else:
    available = True

    NCCL_INT8 = NCCL_CHAR = 0
    NCCL_UINT8 = 1
    NCCL_INT32 = NCCL_INT = 2
    NCCL_UINT32 = 3
    NCCL_INT64 = 4
    NCCL_UINT64 = 5
    NCCL_FLOAT16 = NCCL_HALF = 6
    NCCL_FLOAT32 = NCCL_FLOAT = 7
    NCCL_FLOAT64 = NCCL_DOUBLE = 8
    NCCL_BFLOAT16 = 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    NCCL_UNIQUE_ID_BYTES = 128

    _ERRORS = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error",
               2: "NCCL_ERROR_SYSTEM_ERROR: unhandled system error",
               3: "NCCL_ERROR_INTERNAL_ERROR: internal error",
               4: "NCCL_ERROR_INVALID_ARGUMENT: invalid argument",
               5: "NCCL_ERROR_INVALID_USAGE: invalid usage"}
    _MAGIC = b"SNCL"

    class NcclError(RuntimeError):
        def __init__(self, status: int, detail: str = "") -> None:
            self.status = status
            super().__init__(_ERRORS.get(status, f"NCCL error {status}") + (f" [stand-in: {detail}]" if detail
                                                                           else ""))

        def __reduce__(self):
            return (type(self), (self.status,))

    def get_version() -> int:
        return 22304

    def get_build_version() -> int:
        return 22304

    def _dtype(code: int) -> np.dtype:
        if code == 9:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype([np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32,
                         np.float64][code])

    # -- framing -------------------------------------------------------------------------------
    def _send(sock: socket.socket, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sock.sendall(struct.pack("!Q", len(data)) + data)

    def _recv(sock: socket.socket) -> Any:
        """One message, or None when the peer is gone."""
        try:
            head = _exact(sock, 8)
            return None if head is None else pickle.loads(_exact(sock, struct.unpack("!Q", head)[0]) or b"")
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _exact(sock: socket.socket, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    # -- the bootstrap root and the collectives' rendezvous ------------------------------------
    def get_unique_id() -> Any:
        """A fresh id; starts this process's bootstrap root for it (one init round)."""
        _state.counters.nccl_roots += 1
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        token = secrets.token_bytes(16)
        raw = _MAGIC + struct.pack("!H", listener.getsockname()[1]) + token
        raw += secrets.token_bytes(NCCL_UNIQUE_ID_BYTES - len(raw))
        threading.Thread(target=_root, args=(listener, token), daemon=True, name="standin-nccl-root").start()
        if _state.config.version >= 14:
            return raw
        return tuple(v - 256 if _state.config.char_signed and v > 127 else v for v in raw)

    def _root(listener: socket.socket, token: bytes) -> None:
        conns: dict[int, socket.socket] = {}
        hellos: dict[int, dict] = {}
        listener.settimeout(_state.config.hang_s)
        try:
            while not hellos or len(conns) < next(iter(hellos.values()))["ndev"]:
                conn, _ = listener.accept()
                conn.settimeout(None)
                hello = _recv(conn)
                if not isinstance(hello, dict) or hello.get("token") != token:
                    conn.close()
                    continue
                first = next(iter(hellos.values()), hello)
                if hello["ndev"] != first["ndev"] or not 0 <= hello["rank"] < hello["ndev"] or hello["rank"] in conns:
                    _send(conn, ("error", 5, f"rank {hello['rank']} of {hello['ndev']} does not fit"))
                    conn.close()
                    continue
                conns[hello["rank"]], hellos[hello["rank"]] = conn, hello
        except OSError:
            for conn in conns.values():
                _send(conn, ("error", 2, "bootstrap: not every rank joined"))
            return
        finally:
            listener.close()  # the id is spent
        where = {}
        for rank in sorted(hellos):
            key = (hellos[rank]["host"], hellos[rank]["device"])
            if key in where:
                detail = f"Duplicate GPU detected : rank {rank} and rank {where[key]} both on CUDA device {key[1]}"
                for conn in conns.values():
                    _send(conn, ("error", 5, detail))
                return
            where[key] = rank
        for conn in conns.values():
            _send(conn, ("ok",))
        _serve([conns[r] for r in range(len(conns))])

    def _serve(conns: list[socket.socket]) -> None:
        broken = ""
        while True:
            msgs = [_recv(c) for c in conns]
            live = [r for r, m in enumerate(msgs) if isinstance(m, tuple) and m[0] == "op"]
            if not live:
                return
            if len(live) < len(conns):
                broken = broken or "remote process exited or there was a network error"
            failed = [m[1] for m in msgs if isinstance(m, tuple) and m[0] == "fail"]
            reply: Any = None
            if broken or failed:
                reply = ("error", 2 if broken else 1, broken or failed[0])
            else:
                try:
                    results = _compute([m[1] for m in msgs])
                except ValueError as exc:
                    reply = ("error", 5, str(exc))
            for r in live:
                try:
                    _send(conns[r], reply if reply is not None else ("ok", results[r]))
                except OSError:
                    pass

    def _reduce(parts: list[np.ndarray], op: int) -> np.ndarray:
        wide = np.float32 if parts[0].dtype.itemsize == 2 and parts[0].dtype.kind == "f" or \
            parts[0].dtype.name == "bfloat16" else parts[0].dtype
        acc = parts[0].astype(wide)
        fn = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}[op]
        for p in parts[1:]:
            fn(acc, p.astype(wide, copy=False), out=acc)
        out = acc.astype(parts[0].dtype)
        if op == 4:
            out = (out / len(parts)).astype(parts[0].dtype) if out.dtype.kind == "f" else out // len(parts)
        return out

    def _compute(calls: list[list[tuple]]) -> list[list[Any]]:
        """Every rank's results (one entry per call, None where nothing is received), from every rank's calls.

        A call is ``(kind, count, dtype, extra, data)``; ``extra`` is the op, ``(op, root)``, the root, the
        peer or None; ``data`` what this rank sends (None for a receive, a non-root broadcast)."""
        n = len(calls)
        colls = [[c for c in rank if c[0] not in ("send", "recv")] for rank in calls]
        heads = [[c[:4] for c in rank] for rank in colls]
        for r in range(1, n):
            if heads[r] != heads[0]:
                raise ValueError(f"mismatched collectives: rank 0 called {heads[0]}, rank {r} called {heads[r]}")
        coll_out: list[list[Any]] = [[] for _ in range(n)]
        for i, (kind, count, _, extra) in enumerate(heads[0]):
            datas = [colls[r][i][4] for r in range(n)]
            if kind == "allreduce":
                got = [_reduce(datas, extra)] * n
            elif kind == "reduce":
                red = _reduce(datas, extra[0])
                got = [red if r == extra[1] else None for r in range(n)]
            elif kind == "broadcast":
                got = [datas[extra]] * n
            elif kind == "allgather":
                got = [np.concatenate(datas)] * n
            else:  # reducescatter
                red = _reduce(datas, extra)
                got = [red[r * count:(r + 1) * count] for r in range(n)]
            for r in range(n):
                coll_out[r].append(got[r])
        sends: dict[tuple[int, int], list] = {}
        for r in range(n):
            for c in calls[r]:
                if c[0] == "send":
                    sends.setdefault((r, c[3]), []).append(c)
        out: list[list[Any]] = []
        for r in range(n):
            mine, it = [], iter(coll_out[r])
            for c in calls[r]:
                if c[0] == "send":
                    mine.append(None)
                elif c[0] == "recv":
                    queue = sends.get((c[3], r)) or []
                    if not queue:
                        raise ValueError(f"rank {r} receives from rank {c[3]}, which sends it nothing")
                    sent = queue.pop(0)
                    if sent[1:3] != c[1:3]:
                        raise ValueError(f"rank {c[3]} sends {sent[1:3]} to rank {r}, which receives {c[1:3]}")
                    mine.append(sent[4])
                else:
                    mine.append(next(it))
            out.append(mine)
        return out

    # -- groups ------------------------------------------------------------------------------------
    _group = threading.local()

    def groupStart() -> None:
        _group.depth = getattr(_group, "depth", 0) + 1
        if _group.depth == 1:
            _group.calls = []

    def groupEnd() -> None:
        depth = getattr(_group, "depth", 0)
        if depth == 0:
            raise NcclError(5, "groupEnd without groupStart")
        _group.depth = depth - 1
        if _group.depth == 0:
            by_target: dict[tuple[int, int], list] = {}
            for comm, stream, call in _group.calls:
                by_target.setdefault((id(comm), stream), [comm, stream, []])[2].append(call)
            for comm, stream, calls in by_target.values():
                comm._queue(stream, calls)

    class _Op:
        """One round of a communicator's calls, queued on a stream. A call is
        ``(kind, count, dtype, extra, recv pointer or None, send pointer or None)``."""

        eager = True  # starts when queued if nothing is before it

        def __init__(self, comm: "NcclCommunicator", calls: list[tuple]) -> None:
            from .memory import owner_of

            self.comm, self.calls, self.started, self.failed = comm, calls, False, False
            self.keep = [owner_of(p) for call in calls for p in call[4:] if p is not None]

        def _stuck(self, block: bool) -> bool:
            """A failed call's kernel never finishes (until the communicator is aborted): a poll finds it
            running; a synchronisation on it would wait forever, which the stand-in reports instead."""
            if block:
                raise RuntimeError(f"stand-in: a stream synchronisation waits forever on a failed NCCL call "
                                   f"({self.comm._error}); a real GPU would hang here (poll, check "
                                   "check_async_error() and abort instead)")
            return False

        def _start(self) -> None:
            from .memory import BadPointer, resolve

            self.started = True
            sock = self.comm._sock
            if sock is None:
                self.comm._error = self.comm._error or (2, "communicator aborted")
                return
            try:
                payload = []
                for kind, count, dtype, extra, _, send in self.calls:
                    data = None
                    if send is not None:
                        width = count * (self.comm._ndev if kind == "reducescatter" else 1)
                        size = _dtype(dtype).itemsize
                        data = resolve(send, width * size, self.comm._device).view(_dtype(dtype)).copy()
                    payload.append((kind, count, dtype, extra, data))
                _send(sock, ("op", payload))
            except BadPointer as exc:
                _send(sock, ("fail", f"rank {self.comm._rank}: illegal memory access: {exc}"))

        def advance(self, block: bool) -> bool:
            from .memory import BadPointer, resolve

            if not self.started:
                self._start()
            sock = self.comm._sock
            if sock is None:
                return True  # aborted: ncclCommAbort ends the communicator's kernels
            if self.failed:
                return self._stuck(block)
            try:
                if not block and not select.select([sock], [], [], 0)[0]:
                    return False
                sock.settimeout(_state.config.hang_s if block else None)
                reply = _recv(sock)
                sock.settimeout(None)
            except (OSError, ValueError):  # closed by destroy()/abort() in another thread meanwhile
                reply = None
            if reply is None or reply[0] == "error":
                self.comm._error = self.comm._error or ((2, "connection lost") if reply is None else reply[1:])
                self.failed = True
                return self._stuck(block)
            try:
                for (_, _, _, _, recv, _), got in zip(self.calls, reply[1]):
                    if got is not None and recv is not None:
                        resolve(recv, got.nbytes, self.comm._device)[...] = got.reshape(-1).view(np.uint8)
            except BadPointer as exc:
                self.comm._error = (1, f"illegal memory access: {exc}")
                self.failed = True
                return self._stuck(block)
            self.keep = []
            return True

    class NcclCommunicator:
        """``NcclCommunicator(ndev, commId, rank)``: one rank's communicator on the current device."""

        def __init__(self, ndev: int, commId: Any, rank: int) -> None:
            raw = _id_bytes(commId)
            from . import streams

            device = streams._current_device()
            streams._check_device(device)
            self._device, self._rank, self._ndev = device, int(rank), int(ndev)
            self._sock: socket.socket | None = None
            self._error: tuple[int, str] | None = None
            if raw[:4] != _MAGIC:
                raise NcclError(4, "not an NCCL unique id")
            port = struct.unpack("!H", raw[4:6])[0]
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=_state.config.hang_s)
            except OSError as exc:
                raise NcclError(2, f"bootstrap root at port {port}: {exc} (an id serves one init)") from None
            _send(sock, {"token": raw[6:22], "rank": self._rank, "ndev": self._ndev, "device": device,
                         "host": socket.gethostname(), "pid": os.getpid()})
            reply = _recv(sock)
            if reply is None:
                raise NcclError(2, "bootstrap root went away")
            if reply[0] != "ok":
                sock.close()
                raise NcclError(reply[1], reply[2])
            sock.settimeout(None)
            self._sock = sock

        def _live(self) -> socket.socket:
            if self._sock is None:
                raise NcclError(4, "communicator destroyed or aborted")
            return self._sock

        def _queue(self, stream: int, calls: list[tuple]) -> None:
            from . import streams

            queue = streams._QUEUES.get(stream) if stream else streams._queue(0, self._device, True)
            if queue is None:
                raise NcclError(1, f"unknown stream {stream:#x}")
            if queue.device != self._device:
                raise NcclError(1, f"stream of device {queue.device} on a communicator of device {self._device}")
            queue.put(_Op(self, calls))

        def _call(self, stream: int, call: tuple) -> None:
            self._live()
            op = call[3][0] if call[0] == "reduce" else call[3]
            if call[2] not in range(10) or (call[0] in ("allreduce", "reducescatter", "reduce") and op not in range(5)):
                raise NcclError(4, f"bad datatype or op in {call[:4]}")
            if getattr(_group, "depth", 0):
                _group.calls.append((self, stream, call))
            else:
                self._queue(stream, [call])

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
            self._call(stream, ("allreduce", int(count), int(datatype), int(op), int(recvbuf), int(sendbuf)))

        def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
                   stream: int) -> None:
            recv = int(recvbuf) if self._rank == root else None
            self._call(stream, ("reduce", int(count), int(datatype), (int(op), int(root)), recv, int(sendbuf)))

        def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
            send = int(buff) if self._rank == root else None
            self._call(stream, ("broadcast", int(count), int(datatype), int(root), int(buff), send))

        def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                      stream: int) -> None:
            send = int(sendbuff) if self._rank == root else None
            self._call(stream, ("broadcast", int(count), int(datatype), int(root), int(recvbuff), send))

        def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
            self._call(stream, ("allgather", int(count), int(datatype), None, int(recvbuf), int(sendbuf)))

        def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,
                          stream: int) -> None:
            self._call(stream, ("reducescatter", int(recvcount), int(datatype), int(op), int(recvbuf), int(sendbuf)))

        def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
            if not 0 <= peer < self._ndev:
                raise NcclError(4, f"peer {peer} of {self._ndev}")
            self._call(stream, ("send", int(count), int(datatype), int(peer), None, int(sendbuf)))

        def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
            if not 0 <= peer < self._ndev:
                raise NcclError(4, f"peer {peer} of {self._ndev}")
            self._call(stream, ("recv", int(count), int(datatype), int(peer), int(recvbuf), None))

        def check_async_error(self) -> None:
            if self._error is not None:
                raise NcclError(*self._error)

        def abort(self) -> None:
            if self._sock is not None:
                self._sock.close()  # the peers see the connection drop
                self._sock = None

        def destroy(self) -> None:
            if self._sock is not None:
                try:
                    _send(self._sock, ("destroy",))
                except OSError:
                    pass
                self._sock.close()
                self._sock = None

        def __del__(self) -> None:
            try:
                self.destroy()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass

        def device_id(self) -> int:
            self._live()
            return self._device

        def rank_id(self) -> int:
            self._live()
            return self._rank

        def size(self) -> int:
            self._live()
            return self._ndev

    def _id_bytes(commId: Any) -> bytes:
        """The id as the installed CuPy converts it (see the module docs)."""
        if _state.config.version >= 14:
            if not isinstance(commId, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
            if len(commId) != NCCL_UNIQUE_ID_BYTES:
                raise AssertionError
            return commId
        if not isinstance(commId, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(commId).__name__})")
        assert len(commId) == NCCL_UNIQUE_ID_BYTES
        low, high = (-128, 127) if _state.config.char_signed else (0, 255)
        for v in commId:
            if v < low:
                raise OverflowError("can't convert negative value to char")
            if v > high:
                raise OverflowError("value too large to convert to char")
        return bytes(v % 256 for v in commId)
