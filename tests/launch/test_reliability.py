"""Reliability: failures on one rank end the whole job, promptly and clearly; checkpoints resume exactly.

Covers shared cases H02 (an exception on one rank), H18 (error-feedback
state across save/restore, in fresh processes), H24 (one checkpoint writer,
fresh directory, immediate load) and the neighbouring faults: a rank killed
by SIGKILL, a rank that skips a collective, mismatched strategies, a
non-finite gradient on one rank, and bitwise resume equivalence.

Multi-process tests run under a hard wall clock: MPI jobs through
:func:`tests.support.harness.run_job` (``mpiexec -l``; the process group is killed
and the stalled ranks named on overrun), shm jobs through
:func:`distopt.launch.spawn` with a job timeout, plus pytest-timeout. Where a
timeout is the expected outcome, the collective deadline is 3 s.

The programs run under ``mpiexec`` are plain scripts in ``tests/support/faults/``
(so an uncaught exception reaches ``sys.excepthook``); the shm workers are
in :mod:`tests.support.faults.shm_faults`; the inner MPI suite for NaN skipping, H24
and strategy-mismatch messages (``tests/support/mpi/mpi_checkpoint.py``) runs on the MPI pool
(tests/face/test_checkpoint_mpi.py).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from distopt.launch import WorkerFailedError, spawn
from distopt.launch.nccl_id import NcclIdHolder
from tests.support.faults import shm_faults
from tests.support.harness import rank_streams, run_job
from tests.support.shm_workers import job_segments, pid_alive, run_with_killed_rank

pytestmark = pytest.mark.job

FAULTS = Path(__file__).resolve().parents[1] / "support" / "faults"
DEADLINE = 3.0  # collective timeout where a timeout is the expected outcome
JOB_LIMIT = 30.0  # H02: "the whole job terminates within 30 s"


# ------------------------------------------------------------------ helpers
def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(FAULTS / name), *args]


def _leftovers(tag: str) -> list[str]:
    """Command lines of live processes whose command line contains ``tag`` (none expected)."""
    res = subprocess.run(["pgrep", "-a", "-f", tag], capture_output=True, text=True)
    return [line for line in res.stdout.splitlines() if str(os.getpid()) != line.split()[0]]


def _no_leftovers(tag: str) -> None:
    deadline = time.monotonic() + 3  # processes the launcher killed may take a moment to be reaped
    while (left := _leftovers(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the job still running: {left}"


def _timed_job(argv: list[str], n: int, limit: float = JOB_LIMIT,
               **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    res = run_job(argv, n, limit, **kwargs)  # raises naming stalled ranks on overrun
    return res, time.monotonic() - start


def _results(out: str) -> dict[int, str]:
    """``RESULT rank R: text`` lines printed by the fault scripts, by rank."""
    found = {}
    for rank, text in rank_streams(out).items():
        m = re.search(r"RESULT rank (\d+): (.*)", text)
        if m:
            assert int(m.group(1)) == rank
            found[rank] = m.group(2)
    return found


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def _spawn_ctx():
    return multiprocessing.get_context("spawn")


# ---------------------------------------------------------------------- H02
@pytest.mark.timeout(60)
def test_h02_mpi_uncaught_exception_aborts_job():
    """H02 under mpiexec -n 3: rank 1 raises ValueError("boom") uncaught while ranks 0 and 2 step.

    abort_on_exception=True (default): the job ends within 30 s with a
    non-zero status, rank 1's traceback is in the output, no process is left.
    The collective deadline is 60 s, so only the abort can end the job in time.
    """
    tag = f"h02-{uuid.uuid4().hex}"
    res, secs = _timed_job(_script("h02_raise.py", "--timeout", "60", "--tag", tag), 3)
    out, streams = res.stdout, rank_streams(res.stdout)
    assert secs < JOB_LIMIT
    assert res.returncode != 0, out[-3000:]
    rank1 = streams.get(1, "")
    assert "Traceback (most recent call last)" in rank1, out[-3000:]  # rank 1's traceback
    assert 'raise ValueError("boom")' in rank1 and "ValueError: boom" in rank1, out[-3000:]
    assert "aborting the MPI job" in rank1
    _no_leftovers(tag)


@pytest.mark.timeout(60)
def test_h02_mpi_no_abort_survivors_time_out():
    """H02 with abort_on_exception=False and DistOpt(timeout=3): ranks 0 and 2 end with a CollectiveTimeoutError.

    It names step 1, the deadline and rank 1 as the rank that did not arrive;
    the job still ends (no collective at exit waits for the dead rank).
    """
    tag = f"h02-noabort-{uuid.uuid4().hex}"
    res, secs = _timed_job(_script("h02_raise.py", "--no-abort", "--timeout", str(DEADLINE), "--tag", tag), 3)
    out, streams = res.stdout, rank_streams(res.stdout)
    assert secs < JOB_LIMIT
    assert res.returncode != 0, out[-3000:]
    assert "ValueError: boom" in streams.get(1, ""), out[-3000:]
    for rank in (0, 2):
        assert re.search(rf"CollectiveTimeoutError: step 1, .* on rank {rank} did not complete within 3 s"
                         r".*did not arrive: 1\b", streams.get(rank, "")), out[-4000:]
    _no_leftovers(tag)


@pytest.mark.timeout(60)
def test_h02_shm_spawn_distopt_worker_raises(tmp_path):
    """H02 with spawn and DistOpt over shm (nccl_id, gpu_num, gpu_per_node): WorkerFailedError naming rank 1.

    (tests/launch/test_launch.py covers the same with a bare ShmCommunicator; here
    the survivors are inside DistOpt.step.) The collective deadline (20 s) is
    longer than the limit, so only fail-fast can end the job in time.
    """
    holder = NcclIdHolder()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        spawn(shm_faults.boom_worker, 3, (str(tmp_path), 20.0), nccl_id=holder, timeout=50, join_timeout=5)
    assert time.monotonic() - start < JOB_LIMIT
    err = info.value
    assert err.rank == 1 and err.exitcode == 1, str(err)
    assert str(err).startswith("rank 1 raised an exception")
    assert "ValueError: boom" in err.traceback and "boom_worker" in err.traceback
    pids = _pids(tmp_path)
    assert len(pids) == 3
    assert not [pid for pid in pids if pid_alive(pid)], "worker processes left running"
    assert job_segments(holder.job_id) == []


# ------------------------------------------------------------------ SIGKILL
@pytest.mark.timeout(60)
def test_sigkill_mid_training_mpi():
    """mpiexec -n 3: rank 1 SIGKILLs itself at step 5 of 20: the job ends within 30 s, non-zero, nothing left."""
    tag = f"sigkill-{uuid.uuid4().hex}"
    res, secs = _timed_job(_script("sigkill_rank.py", "--steps", "20", "--kill-at", "5",
                                   "--timeout", str(DEADLINE), "--tag", tag), 3)
    assert secs < JOB_LIMIT
    assert res.returncode != 0, res.stdout[-3000:]
    assert "rank 1: SIGKILL at step 5" in rank_streams(res.stdout).get(1, ""), res.stdout[-3000:]
    assert "finished 20 steps" not in "".join(rank_streams(res.stdout).values())
    _no_leftovers(tag)


@pytest.mark.timeout(60)
def test_sigkill_mid_training_shm_spawn(tmp_path):
    """spawn, DistOpt over shm, 3 workers: rank 1 SIGKILLed at step 5 of 20 -> WorkerFailedError naming it."""
    holder = NcclIdHolder()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 was killed by signal SIGKILL") as info:
        spawn(shm_faults.sigkill_worker, 3, (20, 5, DEADLINE, str(tmp_path)), nccl_id=holder, timeout=50)
    assert time.monotonic() - start < JOB_LIMIT
    assert info.value.rank == 1 and info.value.exitcode == -9
    assert not [pid for pid in _pids(tmp_path) if pid_alive(pid)], "worker processes left running"
    assert job_segments(holder.job_id) == []


@pytest.mark.timeout(60)
def test_sigkill_shm_survivors_name_dead_rank(tmp_path):
    """Without a fail-fast launcher: the survivors' DistOpt.step raises naming step 5 and the dead rank 1.

    The collective deadline is 10 s; the shm backend's liveness check must
    notice the exit well before it.
    """
    holder = NcclIdHolder()
    outcomes, procs = run_with_killed_rank(
        shm_faults.sigkill_worker, lambda r, results: (holder, r, 3, 20, 5, 10.0, str(tmp_path), results), 3,
        survivors=[0, 2])
    assert sorted(outcomes) == [0, 2]
    assert procs[1].exitcode == -9
    for rank, (text, secs) in outcomes.items():
        assert text.startswith("CollectiveTimeoutError: step 5, "), f"rank {rank}: {text}"
        assert "rank 1 (pid" in text and "has exited" in text, f"rank {rank}: {text}"
        assert secs < 5, f"rank {rank} took {secs:.1f} s to notice"
    from distopt.comm.shm import unlink_segments

    leftovers = unlink_segments(holder.job_id, untrack=True)  # only the killed rank's own segments
    assert all(".r1." in name for name in leftovers), leftovers


# ------------------------------------------------------- skipped collective
MISMATCH_WORDS = ("element count differs", "different collectives", "operation differs")


def _names_mismatch(text: str) -> bool:
    """The error says what differed: the element count, or that the ranks are in different collectives."""
    return any(w in text for w in MISMATCH_WORDS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["agree", "idle"])
def test_skipped_collective_mpi(then):
    """mpiexec -n 2, DistOpt(timeout=3): rank 1 runs 4 steps, rank 0 runs 5.

    agree: rank 1's agree(True) meets rank 0's 5th step: CollectiveMismatchError
    on both, rank 0's naming 'step 5', both saying what differs ('different
    collectives' now that a step starts with its header all_gather;
    'element count differs' when it started with the gradient-flag
    all-reduce, before commit 94a27ec).
    idle: rank 1 calls nothing: rank 0 raises CollectiveTimeoutError naming
    'step 5', 'did not complete within 3 s' and the rank that did not arrive.
    """
    res, secs = _timed_job(_script("skip_collective.py", "--then", then, "--timeout", str(DEADLINE)), 2)
    results = _results(res.stdout)
    print(results)
    assert secs < JOB_LIMIT
    assert res.returncode != 0, res.stdout[-3000:]
    assert sorted(results) == [0, 1], res.stdout[-3000:]
    if then == "agree":
        assert results[0].startswith("CollectiveMismatchError: step 5, "), results
        assert _names_mismatch(results[0]) and _names_mismatch(results[1]), results
        assert results[1].startswith("CollectiveMismatchError: "), results
    else:
        assert results[0].startswith("CollectiveTimeoutError: step 5, "), results
        assert "did not complete within 3 s" in results[0], results
        assert re.search(r"did not arrive: 1\b", results[0]), results  # names the missing rank
        assert results[1] == "ok", results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["agree", "idle"])
def test_skipped_collective_shm(then):
    """The same over shm (spawn, DistOpt via nccl_id, timeout 3 s).

    idle: rank 0's error names the missing rank: 'rank 1 did not arrive'.
    """
    ctx = _spawn_ctx()
    holder, results, release = NcclIdHolder(), ctx.Queue(), ctx.Event()
    start = time.monotonic()
    spawn(shm_faults.skip_worker, 2, (then, 5, DEADLINE, results, release), nccl_id=holder, timeout=40)
    assert time.monotonic() - start < JOB_LIMIT
    seen = dict(results.get(timeout=5) for _ in range(2))
    print(seen)
    if then == "agree":
        assert seen[0].startswith("CollectiveMismatchError: step 5, "), seen
        assert _names_mismatch(seen[0]) and _names_mismatch(seen[1]), seen
        assert seen[1].startswith("CollectiveMismatchError: "), seen
    else:
        assert seen[0].startswith("CollectiveTimeoutError: step 5, "), seen
        assert "timed out after 3 s; rank 1 did not arrive" in seen[0], seen
        assert seen[1] == "ok", seen
    assert job_segments(holder.job_id) == []


# -------------------------------------------------------- strategy mismatch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("warm", [False, True], ids=["first_step", "after_dense_step"])
def test_mismatched_strategy_shm(warm):
    """spawn, 2 workers over shm: rank 0 step_half, rank 1 step: CollectiveMismatchError on both naming 'strategy'."""
    ctx = _spawn_ctx()
    holder, results = NcclIdHolder(), ctx.Queue()
    spawn(shm_faults.strategy_mismatch_worker, 2, (warm, results), nccl_id=holder, timeout=40)
    seen = {rank: (text, unchanged) for rank, text, unchanged in (results.get(timeout=5) for _ in range(2))}
    print(seen)
    step = 2 if warm else 1
    for rank, (text, unchanged) in seen.items():
        assert unchanged, f"rank {rank}: parameters changed by the failed step"
        assert text.startswith(f"CollectiveMismatchError: step {step}, "), f"rank {rank}: {text}"
    for rank, (text, _) in seen.items():
        assert "strategy" in text and "'half'" in text and "'plain'" in text, f"rank {rank}: {text}"


# ---------------------------------------------------------- H18 and resume
#: the resume cases: test id -> resume_job.py's case arguments
RESUME_CASES = {"h18-3": ["--case", "h18", "--n", "3"], "h18-100": ["--case", "h18", "--n", "100"],
                **{f"mlp-{s}": ["--case", "mlp", "--strategy", s] for s in ("dense", "half", "sparse")}}


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> dict[str, tuple[Path, list, list, list]]:
    """For every case of RESUME_CASES: run A (every step), then B: B1 (first part + save), B2 (a fresh
    DistOpt and optimizer load the checkpoint and run the rest).

    Three jobs in all, not three per case: one runs every case's A, the next every B1, the last every
    B2 (``resume_job.py --many``), so each B2 still loads in a new job, not the one that saved.
    Returns, per case, its folder and per-rank records ``{"params": [...], **json}`` of A, B1 and B2.
    """
    base = tmp_path_factory.mktemp("resume")
    runs: dict[str, dict[str, list]] = {case: {} for case in RESUME_CASES}
    for name, phase in [("A", "full"), ("B1", "first"), ("B2", "second")]:
        many = [[*args, "--phase", phase, "--ckpt", str(base / case / "ckpt" / "state.pkl"),
                 "--out", str(base / case / name)] for case, args in RESUME_CASES.items()]
        (base / f"{name}.json").write_text(json.dumps(many))
        res = run_job(_script("resume_job.py", "--many", str(base / f"{name}.json")), 2, 60 + 20 * len(many),
                      collective_timeout=10.0)
        assert res.returncode == 0, f"{name} failed (exit {res.returncode}):\n{res.stdout[-6000:]}"
        for case in RESUME_CASES:
            out = base / case / name
            runs[case][name] = []
            for r in range(2):
                with np.load(out / f"rank{r}.npz") as z:
                    params = [z[f"arr_{i}"] for i in range(len(z.files))]
                runs[case][name].append({"params": params, **json.loads((out / f"rank{r}.json").read_text())})
    return {case: (base / case, r["A"], r["B1"], r["B2"]) for case, r in runs.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 100])
def test_h18_resume_in_fresh_processes(resume_runs, n):
    """H18 through distopt.save/load with a new mpiexec job.

    B (1 step, save; new job: fresh DistOpt + SGD, load, steps 2-3) == A
    (3 steps uninterrupted) == [-2,-1,-1] to 1e-6 on every rank.

    n=3 is the stated case; n=100 zero-pads it so the top-1 selection travels
    sparsely (the residual [0,0,1,0,...] must survive the checkpoint).
    """
    folder, a, b1, b2 = resume_runs[f"h18-{n}"]
    want = np.zeros(n)
    want[:3] = [-2, -1, -1]
    assert [rec["wrote"] for rec in b1] == [True, False]
    for r in range(2):
        np.testing.assert_allclose(a[r]["params"][0], want, rtol=0, atol=1e-6, err_msg=f"A, rank {r}")
        np.testing.assert_allclose(b2[r]["params"][0], want, rtol=0, atol=1e-6, err_msg=f"B, rank {r}")
        assert b2[r]["stats"]["steps"] == 3
    assert sorted(os.listdir(folder / "ckpt")) == ["state.pkl", "state.pkl.rank0.residuals",
                                                      "state.pkl.rank1.residuals"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["dense", "half", "sparse"])
def test_resume_equivalence(resume_runs, strategy):
    """MLP, SGD momentum 0.9 + weight decay, shuffling DistributedSampler on opt.sampler, W=2:
    4 epochs (8 steps) in one job == 2 epochs + save + fresh job + load + 2 epochs.

    dense: bitwise; half and sparse (top-K 0.1 with error feedback): 1e-6
    (bitwise is in fact observed, but not promised). The sampler's epoch is
    restored by load (2, the epoch to run next), and so are the counters.
    """
    _, a, b1, b2 = resume_runs[f"mlp-{strategy}"]
    assert [rec["wrote"] for rec in b1] == [True, False]
    for r in range(2):
        assert b2[r]["loaded_epoch"] == 2, b2[r]
        assert b2[r]["epoch"] == a[r]["epoch"] == 3
        assert b2[r]["stats"] == a[r]["stats"], (b2[r]["stats"], a[r]["stats"])
        assert len(a[r]["params"]) == len(b2[r]["params"]) == 4
        for i, (pa, pb) in enumerate(zip(a[r]["params"], b2[r]["params"])):
            assert pa.dtype == pb.dtype == np.float32
            if strategy == "dense":
                assert np.array_equal(pa, pb), f"rank {r} param {i}: max diff {np.abs(pa - pb).max()}"
            else:
                np.testing.assert_allclose(pb, pa, rtol=0, atol=1e-6, err_msg=f"rank {r} param {i}")
            np.testing.assert_array_equal(pa, a[0]["params"][i])  # identical on every rank
    # the run really moved (a no-op training would pass trivially)
    assert not np.array_equal(a[0]["params"][0], b1[0]["params"][0])
