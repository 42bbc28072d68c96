"""The NCCL backend at world size 1 (one GPU), and the review's communicator findings (F1, F3, F4, F8-F11,
F18, F19, F22) on the stand-in where a real GPU cannot show them.

NCCL refuses two ranks on one GPU, so on a single-GPU machine only world
size 1 runs on the device; the multi-rank tests need as many devices (the
stand-in has them; elsewhere they skip), see ``test_nccl_world.py``.
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.unit]

from tests.support.gpu import devices, is_standin, load_cupy, run_nccl_world  # noqa: E402

cupy = load_cupy()
standin_only = pytest.mark.skipif(not is_standin(cupy), reason="observes the stand-in's counters or faults")


@pytest.fixture(scope="module")
def gpu():
    with devices(1) as module:
        yield module


@pytest.fixture(scope="module")
def comm(gpu):  # noqa: ARG001
    from distopt.comm.nccl import NcclCommunicator, new_unique_id

    c = NcclCommunicator(rank=0, size=1, unique_id=new_unique_id(), device=0)
    yield c
    c.close()


def busy(seconds: float) -> None:
    """Queue about ``seconds`` of device work on the current stream, without waiting for it."""
    if is_standin(cupy):
        cupy._standin.launch(seconds=seconds)
        return
    a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
    for _ in range(max(1, int(seconds / 0.02))):
        a = a @ a


def test_all_reduce_sum_avg_bool(comm):
    a = cupy.arange(10, dtype=cupy.float32)
    comm.all_reduce(a)
    np.testing.assert_array_equal(a.get(), np.arange(10))
    comm.all_reduce(a, op="avg")
    np.testing.assert_array_equal(a.get(), np.arange(10))
    b = cupy.array([True, False])
    comm.all_reduce(b)
    np.testing.assert_array_equal(b.get(), [True, False])
    with pytest.raises(TypeError, match="avg"):
        comm.all_reduce(cupy.arange(3, dtype=cupy.int32), op="avg")


def test_h30_stream_ordered_after_producer(comm):
    """H30: a large kernel writes the buffer right before the all-reduce, no explicit sync."""
    expect = np.arange(2**20, dtype=np.float32)
    for _ in range(5):
        g = cupy.arange(2**20, dtype=cupy.float32) * 1
        comm.all_reduce(g, op="avg")
        np.testing.assert_array_equal(g.get(), expect)


def test_broadcast_gather(comm):
    a = cupy.ones((2, 3), dtype=cupy.float64)
    comm.broadcast(a)
    assert comm.all_gather(a).shape == (1, 2, 3)
    parts = comm.all_gather_v(cupy.arange(4, dtype=cupy.float32))
    np.testing.assert_array_equal(parts[0].get(), np.arange(4))
    comm.barrier()


def test_steady_state_plain_and_half_steps_never_wait_on_the_host(gpu):  # noqa: ARG001
    """The spawn mode's NCCL DistOpt has a shared-memory control plane: after the first step, plain and
    half steps add no host synchronisation (``stats.host_syncs``)."""
    import distopt

    opt = distopt.DistOpt(distopt.SGD(lr=0.1), nccl_id=distopt.NcclIdHolder(), gpu_num=0, gpu_per_node=1)
    assert opt.comm.name == "nccl" and opt.comm.control is not None and opt.comm.control.name == "shm"
    p = [cupy.zeros(1000, dtype=cupy.float32), cupy.zeros(10, dtype=cupy.float32)]
    opt.step(p, [cupy.ones_like(x) for x in p])
    first = opt.stats.host_syncs
    for _ in range(3):
        opt.step(p, [cupy.ones_like(x) for x in p])
        opt.step_half(p, [cupy.ones_like(x) for x in p])
    assert opt.stats.host_syncs == first == 0
    np.testing.assert_allclose(p[0].get(), -0.7, rtol=1e-3)
    opt.close()


def test_distopt_from_nccl_id_holder_all_strategies(gpu):  # noqa: ARG001
    """The multiprocessing mode's ticket builds a 1-process NCCL DistOpt; every strategy runs on CuPy."""
    import distopt

    opt = distopt.DistOpt(distopt.SGD(lr=1.0), nccl_id=distopt.NcclIdHolder(), gpu_num=0, gpu_per_node=1)
    assert opt.comm.name == "nccl"
    p = cupy.zeros(1000, dtype=cupy.float32)
    g = cupy.arange(1000, dtype=cupy.float32) / 1000
    opt.step([p], [g.copy()])
    np.testing.assert_allclose(p.get(), -np.arange(1000) / 1000, rtol=1e-6)
    opt.step_half([p], [g.copy()])
    np.testing.assert_allclose(p.get(), -2 * np.arange(1000) / 1000, rtol=1e-3, atol=1e-3)
    before = p.copy()
    opt.step_sparse([p], [g.copy()], spars=0.01, topK=True)
    assert int(cupy.count_nonzero(p - before)) == 10  # exactly k = 1% of 1000 entries moved
    opt.step_partial([p], [g.copy()])
    opt.close()


def test_host_wait_bounded_and_aborts(gpu):  # noqa: ARG001
    """Host waits are bounded: with the device still busy past the deadline, barrier() aborts and raises."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id
    from distopt.errors import CollectiveTimeoutError

    c = NcclCommunicator(rank=0, size=1, unique_id=new_unique_id(), device=0, timeout=5)
    flags = np.array([1, 2, 3], dtype=np.int32)
    c.all_reduce(flags)  # a host array: staged through the device, bounded host wait
    np.testing.assert_array_equal(flags, [1, 2, 3])
    busy(0.5)
    c.timeout = 0.0
    with pytest.raises(CollectiveTimeoutError, match="aborted"):
        c.barrier()
    c.close()  # idempotent after the abort
    cupy.cuda.Device().synchronize()


def test_sharded_collectives_at_world_size_1(comm):
    """reduce_scatter(_async), all_gather_into(_async), all_to_all on CuPy and (staged) NumPy arrays, and
    the shared argument checks; the conformance suite's sharded checks at world size 1."""
    from tests.support import conformance

    a = cupy.arange(7, dtype=cupy.float32)
    got = comm.reduce_scatter(a, op="avg")
    assert isinstance(got, cupy.ndarray) and got is not a
    np.testing.assert_array_equal(got.get(), np.arange(7))
    np.testing.assert_array_equal(comm.reduce_scatter_async(a, [7], op="max").wait().get(), np.arange(7))
    assert comm.all_gather_into(a) is a and comm.all_gather_into_async(a, [7]).wait() is a
    rows = comm.all_to_all(cupy.arange(6, dtype=cupy.int64).reshape(1, 2, 3))
    np.testing.assert_array_equal(rows.get(), np.arange(6).reshape(1, 2, 3))
    with pytest.raises(ValueError, match="counts must sum"):
        comm.reduce_scatter(a, [6])
    with pytest.raises(ValueError, match="shape .size=1"):
        comm.all_to_all(cupy.ones((2, 2)))
    for check in conformance.SHARD_CHECKS:  # NumPy arrays, staged through the device
        check(comm)


def test_host_arrays_without_a_control_plane_are_staged_through_the_device(gpu):  # noqa: ARG001
    """Without a host control plane, NumPy arrays travel through the device, one bounded host wait each."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id

    c = NcclCommunicator(0, 1, new_unique_id(), 0)
    host = np.arange(6, dtype=np.float32)
    assert c.broadcast(host) is host
    np.testing.assert_array_equal(c.all_gather(host), host[None])
    np.testing.assert_array_equal(c.all_gather_v(host)[0], host)
    np.testing.assert_array_equal(c.all_gather_into(host.copy()), host)
    assert c.host_syncs >= 4
    c.close()
    with pytest.raises(Exception, match="closed"):
        c.all_reduce(cupy.ones(1, dtype=cupy.float32))


def test_bad_arguments_are_clear_and_close_the_control_plane(gpu):  # noqa: ARG001
    from distopt.comm.nccl import NcclCommunicator
    from distopt.comm.nccl_types import nccl_dtype
    from tests.support.simworld import second_world

    with pytest.raises(ValueError, match="unique_id or a control"):
        NcclCommunicator(0, 1)
    control = second_world(2)(1)
    with pytest.raises(ValueError, match="control communicator is rank 1 of 2"):
        NcclCommunicator(0, 1, control=control)
    assert control.closed
    with pytest.raises(TypeError, match="takes CuPy arrays"):
        nccl_dtype(np.zeros(2))
    with pytest.raises(TypeError, match="complex64 is not supported by the NCCL backend"):
        nccl_dtype(cupy.zeros(2, dtype=cupy.complex64))


def test_bfloat16_over_nccl_needs_cupy_14(gpu, monkeypatch):  # noqa: ARG001
    """F7: CuPy 14 carries bfloat16 (NCCL_BFLOAT16), summed as NCCL does it; CuPy 13 has no bfloat16."""
    from distopt.comm import nccl_types

    ml_dtypes = pytest.importorskip("ml_dtypes")
    if nccl_types.bfloat16_supported():
        def rank_fn(rank, comm):
            x = cupy.asarray(np.full(5, rank + 0.5, dtype=ml_dtypes.bfloat16))
            comm.all_reduce(x, op="avg")
            return x.get().astype(np.float32)

        with devices(2):
            for got in run_nccl_world(2, rank_fn):
                np.testing.assert_array_equal(got, 1.0)
    monkeypatch.setattr(cupy, "__version__", "13.6.0")
    assert not nccl_types.bfloat16_supported()


@standin_only
def test_a_peer_gone_is_an_error_on_the_host_wait_naming_nccl(gpu):  # noqa: ARG001
    """A peer that aborts its communicator: the other rank's next host wait reads NCCL's asynchronous error,
    aborts its own communicator and raises."""
    from distopt.errors import DistOptError

    def rank_fn(rank, comm):
        if rank == 1:
            comm._abort("test: this rank is gone")
            return "gone"
        with pytest.raises(DistOptError, match="NCCL error .*communicator aborted"):
            comm.barrier()
        return "raised"

    with devices(2):
        assert run_nccl_world(2, rank_fn) == ["raised", "gone"]


@standin_only
def test_cupy_without_nccl_module_is_backend_unavailable(gpu, monkeypatch):  # noqa: ARG001
    """No ``cupy.cuda.nccl`` at all (a CuPy built without it): the backend is unavailable, naming CuPy."""
    from distopt.comm import backend_class
    from distopt.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    monkeypatch.delattr(cupy.cuda, "nccl")
    for name in ("distopt.comm.nccl", "distopt.comm.nccl_types", "distopt.comm.nccl_shards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(BackendUnavailableError, match="needs CuPy with NCCL"):
        backend_class("nccl")


# -- the review's findings ------------------------------------------------------------------------------

@standin_only
def test_f1_cupy_without_loadable_nccl_is_backend_unavailable(gpu, monkeypatch):  # noqa: ARG001
    """F1: ``cupy.cuda.nccl`` imports with ``available = False`` and no names when libnccl cannot load: the
    backend is unavailable (a clear error naming the fix), and the job's ticket is still made."""
    import distopt
    from distopt.comm import backend_class
    from distopt.errors import BackendUnavailableError

    broken = types.ModuleType("cupy.cuda.nccl")
    broken.available = False
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", broken)
    monkeypatch.setattr(cupy.cuda, "nccl", broken, raising=False)
    for name in ("distopt.comm.nccl", "distopt.comm.nccl_types", "distopt.comm.nccl_shards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(BackendUnavailableError, match="cannot load NCCL.*nvidia-nccl"):
        backend_class("nccl")
    assert distopt.NcclIdHolder().job_id
    from distopt.launch.backend_rule import nccl_unfit

    assert "cannot load NCCL" in nccl_unfit(1)


def test_f3_a_second_distopt_from_one_ticket_gets_a_fresh_nccl_id(gpu):  # noqa: ARG001
    """F3: an NCCL id serves one init round; every DistOpt of one job (a second model, one made after
    close()) agrees on a fresh id over the control plane, so reusing the ticket works."""
    import distopt

    holder = distopt.NcclIdHolder()
    for _ in range(3):
        opt = distopt.DistOpt(distopt.SGD(lr=1.0), nccl_id=holder, gpu_num=0, gpu_per_node=1)
        assert opt.comm.name == "nccl"
        p = cupy.zeros(4, dtype=cupy.float32)
        opt.step([p], [cupy.ones(4, dtype=cupy.float32)])
        np.testing.assert_array_equal(p.get(), -1.0)
        opt.close()


@standin_only
def test_f3_an_nccl_id_serves_one_communicator(gpu):  # noqa: ARG001
    """F3 (the stand-in's half): a second communicator from a spent id fails at once, as NCCL's closed
    bootstrap root makes it fail."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id

    uid = new_unique_id()
    NcclCommunicator(0, 1, uid, 0).close()
    with pytest.raises(cupy.cuda.nccl.NcclError, match="SYSTEM_ERROR"):
        NcclCommunicator(0, 1, uid, 0)


@standin_only
@pytest.mark.parametrize("version,signed", [(14, True), (13, True), (13, False)],
                         ids=["cupy14-bytes", "cupy13-x86", "cupy13-aarch64"])
def test_f4_unique_id_converted_for_every_cupy_and_cpu(version, signed):
    """F4: the id is ``bytes`` in CuPy 14 and a tuple of C ``char`` in 13, which is unsigned on aarch64
    (a negative value is OverflowError there); the id built by rank 0 opens on every layout."""
    with devices(1, version=version, char_signed=signed):
        from distopt.comm.nccl import NcclCommunicator, new_unique_id

        uid = new_unique_id()
        assert any(v > 127 for v in uid) or any(v < 0 for v in uid)  # the sign matters for this id
        c = NcclCommunicator(0, 1, uid, 0)
        x = cupy.arange(3, dtype=cupy.float32)
        c.all_reduce(x)
        np.testing.assert_array_equal(x.get(), [0, 1, 2])
        c.close()


@standin_only
def test_f8_a_rank_missing_at_setup_is_a_bounded_error_naming_it(gpu, monkeypatch):  # noqa: ARG001
    """F8: a rank that died before the NCCL init leaves the others in a bounded wait on the control plane
    (CollectiveTimeoutError naming the missing rank), not in an init that blocks for good; the control
    communicator is closed on the failure."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id
    from distopt.errors import CollectiveTimeoutError
    from tests.support.simworld import RankFailed, run_world

    monkeypatch.setattr(cupy._state.config, "hang_s", 6.0)
    controls = {}

    def rank_fn(rank, control):
        controls[rank] = control
        if rank == 1:
            return None  # dies before the init
        NcclCommunicator(0, 2, new_unique_id(), 0, control=control)

    with pytest.raises(RankFailed, match="rank 0") as failed:
        run_world(2, rank_fn, timeout=4)
    assert isinstance(failed.value.__cause__, CollectiveTimeoutError)
    assert "elsewhere: 1 " in str(failed.value.__cause__)  # the control plane names the missing rank
    assert controls[0].closed


def test_f9_broadcast_refuses_a_strided_view(comm):
    """F9: NCCL reads ``size`` elements from the first one's address: a column would broadcast the wrong
    memory, so it is refused."""
    m = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    with pytest.raises(TypeError, match="C-contiguous"):
        comm.broadcast(m[:, 1])


def test_f10_a_failing_send_still_ends_the_group(gpu, monkeypatch):  # noqa: ARG001
    """F10: a send that raises inside ``groupStart()`` ... ``groupEnd()`` still ends the group: the
    thread's later collectives run (they would be collected forever)."""
    def rank_fn(rank, comm):
        real = comm._comm

        class Failing:
            def __getattr__(self, name):
                return getattr(real, name)

            def send(self, *args):
                raise cupy.cuda.nccl.NcclError(4)

        comm._comm = Failing()
        with pytest.raises(cupy.cuda.nccl.NcclError):
            comm.all_to_all(cupy.arange(4, dtype=cupy.float32).reshape(2, 2))
        comm._comm = real
        x = cupy.full(3, rank + 1.0, dtype=cupy.float32)
        comm.all_reduce(x)
        return x.get()

    with devices(2):
        for got in run_nccl_world(2, rank_fn):
            np.testing.assert_array_equal(got, 3.0)


def test_f11_a_call_after_an_abort_says_so(gpu):  # noqa: ARG001
    """F11: after an abort (here a host wait past its deadline) every call raises a DistOptError naming
    the cause, not an AttributeError on a None communicator."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id
    from distopt.errors import CollectiveTimeoutError, DistOptError

    c = NcclCommunicator(0, 1, new_unique_id(), 0)
    c.timeout = 0.0
    busy(0.5)
    with pytest.raises(CollectiveTimeoutError):
        c.barrier()
    with pytest.raises(DistOptError, match="aborted .*deadline.*build a new one"):
        c.all_reduce(cupy.ones(2, dtype=cupy.float32))
    with pytest.raises(DistOptError, match="aborted"):
        c.reduce_scatter(cupy.ones(2, dtype=cupy.float32))
    c.close()
    cupy.cuda.Device().synchronize()


@standin_only
def test_f18_collectives_make_no_new_events(comm):
    """F18: the ordering events are made once, without timing: none per collective."""
    counters = cupy._state.counters
    before, timing = counters.events, counters.timing_events
    x = cupy.ones(8, dtype=cupy.float32)
    for _ in range(10):
        comm.all_reduce(x)
        comm.reduce_scatter(x)
    assert (counters.events, counters.timing_events) == (before, timing)


@standin_only
def test_f19_the_collective_waits_for_the_producer_and_the_consumer_for_it(gpu):  # noqa: ARG001
    """F19: on a non-default stream, a kernel that has not run yet writes the buffer; the all-reduce must
    read it after that kernel, and the next kernel must read the result after the all-reduce. The
    stand-in's streams run queued work only when something orders it, so a missing wait gives a wrong
    number here instead of passing by luck."""
    def rank_fn(rank, comm):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            g = cupy.zeros(1000, dtype=cupy.float32)
            cupy._standin.launch(lambda: g._a.__setitem__(Ellipsis, rank + 1), seconds=0.2)  # still running
            comm.all_reduce(g)
            return (g * 1).get()  # a kernel after the collective, on the same stream

    with devices(2):
        for got in run_nccl_world(2, rank_fn):
            np.testing.assert_array_equal(got, 3.0)


@standin_only
@pytest.mark.parametrize("dropped", ["before", "after"])
def test_f19_removing_either_event_wait_is_caught(gpu, monkeypatch, dropped):  # noqa: ARG001
    """A collective without its first wait reads the buffer before the producer; without its second, the
    consumer reads the buffer before the collective: the stand-in gives wrong numbers for both."""
    from distopt.comm.nccl import NcclCommunicator

    def run_without(self, fn):
        caller = cupy.cuda.get_current_stream()
        self._ready.record(caller)
        if dropped != "before":
            self._stream.wait_event(self._ready)
        fn(self._stream.ptr)
        self._finished.record(self._stream)
        if dropped != "after":
            caller.wait_event(self._finished)

    monkeypatch.setattr(NcclCommunicator, "_run", run_without)

    def rank_fn(rank, comm):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            g = cupy.zeros(4, dtype=cupy.float32)
            cupy._standin.launch(lambda: g._a.__setitem__(Ellipsis, rank + 1), seconds=0.2)
            comm.all_reduce(g)
            got = (g * 1).get()
        s.synchronize()
        comm._stream.synchronize()
        return got

    with devices(2):
        results = run_nccl_world(2, rank_fn)
    assert any(not np.array_equal(got, np.full(4, 3.0)) for got in results)


@standin_only
def test_f22_a_collective_from_another_thread_uses_the_communicators_device(gpu):  # noqa: ARG001
    """F22: CuPy's current device is per host thread; a collective called from a thread whose current
    device is 0 still allocates its temporaries on the communicator's device (else NCCL gets memory of
    another GPU)."""
    def rank_fn(rank, comm):
        x = cupy.full(3, rank + 1.0, dtype=cupy.float32)
        rows = cupy.full((2, 1), rank + 1.0, dtype=cupy.float32)
        out = {}

        def other_thread():  # its current device is 0
            out["gathered"] = comm.all_gather(x)
            out["rows"] = comm.all_to_all(rows)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(30)
        comm.barrier()
        return out["gathered"].get(), out["rows"].get()

    with devices(2):
        for gathered, rows in run_nccl_world(2, rank_fn):
            np.testing.assert_array_equal(gathered, [[1, 1, 1], [2, 2, 2]])
            np.testing.assert_array_equal(rows, [[1], [2]])
