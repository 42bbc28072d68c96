"""``distopt.elastic.run``: start or resume ``fn(state)`` in the world torchrun's elastic agent formed.

Membership belongs to torch's elastic agent (``torchrun --nnodes MIN:MAX
--rdzv-backend c10d``): when a worker dies, or a new node waits at the
rendezvous, the agents stop every worker, form a new world of the nodes alive,
and start the workers again. ``run`` makes that restart a rollback to the last
commit instead of a restart from scratch: at start every rank reports the
commit parts on its node, the newest commit whose every part is held somewhere
wins, each part a rank's node lacks (a node that just joined) is broadcast from
the lowest rank that holds it, one part at a time, and every rank loads the
commit into its ``State``: the DistOpt built in the new world re-shards ZeRO
state from the old world's shards without any rank holding it whole, and the
sampler splits the rest of the epoch among the new ranks. Only the steps since
the last commit are lost.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint import dumps
from ..errors import DistOptError
from ..launch.info import RESTART_COUNT_ENV, RUN_ID_ENV
from ..launch.ranks import under_mpi
from .heartbeat import DEFAULT_LOST_AFTER_S, PeerLostError, check_lost_after, torchrun_heartbeat
from .regroup import grow_check
from .sampler import ElasticSampler
from .snapshot import SnapshotDir
from .state import State

__all__ = ["ElasticLaunchError", "check_launch", "run"]

log = logging.getLogger("distopt")
T = TypeVar("T")

_LAUNCH_HINT = ("launch with torchrun's elastic agent, e.g. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun "
                "--nnodes 2:4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB "
                "--max-restarts 10 train.py, or on one machine python -m distopt.launch -n 3 --min-np 2 "
                "--max-np 4 --run-id JOB train.py (docs/elastic.md)")


class ElasticLaunchError(DistOptError, ValueError):
    """:func:`distopt.elastic.run` was started by a launcher that cannot change the world (mpiexec, python -m
    distopt.launch, plain python), or torchrun without what a restart needs; the message names the fix."""


def check_launch(env: Mapping[str, str]) -> str:
    """The run id of an elastic launch described by ``env``: torchrun's (``TORCHELASTIC_RUN_ID``), or
    ``python -m distopt.launch --min-np/--max-np --run-id ID``'s (``DISTOPT_RUN_ID``).

    Raises:
        ElasticLaunchError: not torchrun (mpiexec: an MPI communicator cannot shrink or grow without ULFM;
            python -m distopt.launch without --min-np/--max-np and plain python: no elastic agent), the
            default run id ``none`` (commits would be found by an unrelated job), or
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` not ``1`` (torch's agent shares one store across restarts
            and the restarted workers read the previous world's addresses, pytorch/pytorch#135712).
    """
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        if under_mpi(env):
            raise ElasticLaunchError("distopt.elastic.run does not work under mpiexec/mpirun: an MPI "
                                     "communicator cannot lose or gain a process without ULFM; " + _LAUNCH_HINT)
        if "DISTOPT_JOB_ID" in env:
            if env.get(RUN_ID_ENV):  # python -m distopt.launch --min-np/--max-np: its --run-id
                return env[RUN_ID_ENV]
            raise ElasticLaunchError("distopt.elastic.run does not work under python -m distopt.launch without "
                                     "its elastic mode (--min-np/--max-np and --run-id): a fail-fast world "
                                     "cannot re-form; " + _LAUNCH_HINT)
        raise ElasticLaunchError("distopt.elastic.run needs torchrun's elastic agent (TORCHELASTIC_RUN_ID is "
                                 "not set); " + _LAUNCH_HINT)
    if run_id == "none":
        raise ElasticLaunchError("distopt.elastic.run needs an explicit --rdzv-id (the run id names the "
                                 "commits in /dev/shm; 'none' would be shared by unrelated jobs); " + _LAUNCH_HINT)
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        raise ElasticLaunchError("distopt.elastic.run needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
                                 "environment: otherwise torch's agent keeps one store across restarts and the "
                                 "restarted workers connect to the previous world's addresses "
                                 "(pytorch/pytorch#135712); " + _LAUNCH_HINT)
    return run_id


def _optimizer(state: State) -> Any:
    from ..opt import DistOpt

    opt = state._objects.get("optimizer")
    if not isinstance(opt, DistOpt):
        raise ValueError("distopt.elastic.run: State(optimizer=...) must be the job's distopt.DistOpt, got "
                         f"{type(opt).__name__}")
    return opt


def _restore(state: State, opt: Any, snapshots: SnapshotDir, writer: bool) -> tuple[int | None, list[Any]]:
    """Agree on the world's newest complete commit and load it; its sequence number (None for a fresh start)
    and each rank's node (its host and commit directory).

    At the world size of a commit of ``zero=3`` optimizers (whose parameters live in their shards), with every
    rank's own part on its node, each rank reads only its own part's file. Otherwise each part is read from this
    node's file where every rank has one, else broadcast from the lowest rank that holds it, one part at a time. The
    node's writer stores the parts its node lacked, so that every node of the new world holds the commit it resumed
    from, even if the nodes that sent them are lost before the next commit."""
    held = snapshots.held()
    me = (socket.gethostname(), str(snapshots.run.resolve()))
    everyone = opt.all_gather_object((me, {k: sorted(v) for k, v in held.items()}))
    nodes = [node for node, _ in everyone]
    holders: dict[tuple[int, int], dict[int, int]] = {}
    for rank, (_, listing) in enumerate(everyone):
        for key, parts in listing.items():
            for k in parts:
                holders.setdefault(key, {}).setdefault(k, rank)
    complete = [key for key, got in holders.items() if sorted(got) == list(range(key[1]))]
    if not complete:
        return None, nodes
    seq, parts = max(complete)
    local = held.get((seq, parts), {})
    rank = opt.global_rank
    if parts > 1 and parts == opt.world_size and all(o.zero == 3 for o in state.sharded().values()) and all(
            r in listing.get((seq, parts), ()) for r, (_, listing) in enumerate(everyone)):
        state.load(seq, rank, parts, lambda: iter([local[rank]]), own=True)  # each rank its own part, from its file
        return seq, nodes
    stores = writer if parts == 1 else nodes.index(me) == opt.global_rank
    stored: set[int] = set()

    def read() -> Iterator[bytes | Path]:
        for k in range(parts):
            if all(k in listing.get((seq, parts), ()) for _, listing in everyone):
                yield local[k]
                continue
            root = holders[(seq, parts)][k]
            raw = opt.broadcast_object(local[k].read_bytes() if opt.global_rank == root else None, root=root)
            if stores and k not in local and k not in stored:
                snapshots.write(seq, k, parts, raw)
                stored.add(k)
            yield raw

    state.load(seq, 0, parts, read)
    return seq, nodes


def _store(state: State, opt: Any, snapshots: SnapshotDir, writer: bool, nodes: list[Any],
           after_commit: Callable[[], None] | None) -> Callable[[int, dict[str, Any]], Path | None]:
    """What stores each commit (collective): with one part, every agent's writer stores it; with one part per
    rank, each rank stores its own and, where the job spans several nodes, every part is broadcast and each
    node's writer (its lowest rank) stores the parts of the other nodes' ranks, so any one node can restore
    the world. Then every rank reports its error, if any (raised on every rank), and the writers remove
    what is older."""
    rank = opt.global_rank
    node_writer = nodes.index(nodes[rank]) == rank
    several = len(set(nodes)) > 1

    def store(seq: int, part: dict[str, Any]) -> Path | None:
        parts = state.parts()
        errors: list[str] = []
        own: list[Path] = []

        def write(k: int, raw: bytes | dict[str, Any]) -> None:
            try:
                path = snapshots.write(seq, k, parts, raw)
            except OSError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            if parts == 1 or k == rank:  # this rank's own part
                own.append(path)

        if parts == 1 and writer:
            write(0, part)
        elif parts > 1 and not several:
            write(rank, part)
        elif parts > 1:  # part k travels to every node, where its writer stores it after the broadcast
            for k in range(parts):
                raw = opt.broadcast_object(dumps(part, "distopt.elastic.State") if k == rank else None, root=k)
                if k == rank or (node_writer and nodes[k] != nodes[rank]):
                    write(k, raw)
        failed = [(r, e) for r, e in enumerate(opt.all_gather_object(errors[:1])) if e]
        if failed:
            raise OSError(f"distopt.elastic: commit {seq} could not be stored: " +
                          "; ".join(f"on rank {r}: {e[0]}" for r, e in failed))
        if writer:
            snapshots.prune(seq)
        if parts == 1 and not own:  # this node's writer stored the one part
            own = list(snapshots.held().get((seq, 1), {}).values())
        if after_commit is not None:
            after_commit()
        return own[0] if own else None

    return store


def _lost_world(exc: BaseException, rank: int, world: int, snapshots: SnapshotDir, run_id: str,
                torchrun: bool) -> str:
    """The line a worker writes before it exits on a lost peer (``exc``): what its launcher does next, and,
    for the case where too few nodes are left to go on (under torchrun, ``torchrun`` True: its agent stops
    after the rendezvous ``join_timeout``), where this node's commit stays and how to resume from it."""
    newest = snapshots.newest()
    flag = "--rdzv-id" if torchrun else "--run-id"
    kept = ("nothing is committed on this node yet" if newest is None else
            f"commit {newest} stays in {snapshots.run} on this node, and a job relaunched with {flag} "
            f"{run_id} resumes from it")
    below = (". If fewer nodes than torchrun's --nnodes MIN are left, torchrun's agent stops instead, with "
             "RendezvousTimeoutError, after its rendezvous join_timeout (600 s unless --rdzv-conf "
             "join_timeout=S);" if torchrun else ";")
    return (f"distopt.elastic: rank {rank} of {world} lost the world ({type(exc).__name__}: {str(exc)[:300]}); "
            f"exiting so that the launcher re-forms the world, which resumes from its newest commit{below} "
            f"{kept}.\n")


def run(fn: Callable[..., T] | None = None, *, commit_dir: str | os.PathLike = "/dev/shm",
        lost_after: float | None = DEFAULT_LOST_AFTER_S) -> Any:
    """Decorate ``fn(state, *args, **kwargs)`` so that it resumes from the last commit after a world change
    (``@run`` or ``@run(commit_dir=..., lost_after=...)``).

    Args:
        fn: the training function; its first argument is the :class:`~distopt.elastic.State`.
        commit_dir: where each node keeps its commits: a node-local directory, memory-backed
            (``/dev/shm``) so that a commit costs no disk write; the run's files go in a subdirectory
            named by the run id.
        lost_after: under torchrun, seconds after which a peer whose heartbeat did not move (a frozen or
            cut-off node: its connections stay open, so no collective fails) is lost, and so is the job's
            store when it does not answer (:mod:`distopt.elastic.heartbeat`; a beat every second, so at least
            2 s). The worker then writes ``distopt.elastic: rank R of W lost the world (PeerLostError: no
            heartbeat from rank P for S s ...)`` and exits at once with status 1 (``os._exit``: its main
            thread may be stuck in a collective). A slow rank still beats (a thread of its own; torch ops and
            collectives release the GIL, Python code yields it every 5 ms) unless one call holds the GIL that
            long. None: no heartbeat (a silent peer is then seen at ``DistOpt(timeout=...)``).

    On every (re)start, before ``fn``: the world's newest commit is restored (see the module docstring),
    every :class:`~distopt.elastic.ElasticSampler` in the state is reset to this rank and world size, and
    when a commit was restored the reset callbacks run. Then ``fn(state)`` runs; when a peer is lost (in the
    restore, in ``fn`` or in the final barrier) its collective raises a :class:`~distopt.errors.DistOptError`
    (at once when the peer's process died: the transport reports the closed connection); ``run`` writes one
    line to stderr (``distopt.elastic: rank R of W lost the world (...)``) and lets the error end the
    process, so that torchrun's agent re-forms the world and restarts this worker, which resumes here. The
    line also says where the node's commit stays (``commit_dir``), from which a job relaunched with the same
    run id resumes, and, under torchrun, what happens when fewer nodes than ``--nnodes MIN`` are left:
    torchrun's agent stops with ``RendezvousTimeoutError`` after its rendezvous ``join_timeout``. After ``fn`` returns
    on every rank, the run's commits are removed from shared memory.

    Raises:
        ElasticLaunchError: see :func:`check_launch`.
        ValueError: ``state.optimizer`` is not a :class:`distopt.DistOpt`; ``lost_after`` is neither None nor
            a finite number of seconds >= 2.
    """
    lost_after = check_lost_after(lost_after)
    if fn is None:
        return functools.partial(run, commit_dir=commit_dir, lost_after=lost_after)

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        run_id = check_launch(os.environ)
        opt = _optimizer(state)
        snapshots = SnapshotDir(run_id, commit_dir)
        writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
        began = time.time()
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ

        def on_lost(reason: str) -> None:  # in the heartbeat's thread: the main one may be stuck in a collective
            sys.stderr.write(_lost_world(PeerLostError(reason), opt.global_rank, opt.world_size, snapshots,
                                         run_id, torchrun))
            sys.stderr.flush()
            os._exit(1)

        heartbeat = torchrun_heartbeat(opt.global_rank, opt.world_size, lost_after, os.environ, on_lost)
        if heartbeat is not None:
            heartbeat.start()
        try:
            seq, nodes = _restore(state, opt, snapshots, writer)
            state._attach(_store(state, opt, snapshots, writer, nodes, grow_check(opt, os.environ)))
            if heartbeat is not None:  # every rank started its heartbeat before the restore's all-gather
                heartbeat.arm()
            for obj in state._objects.values():
                if isinstance(obj, ElasticSampler):
                    obj.reset(opt.global_rank, opt.world_size)
            if seq is not None:
                state._reset()
                if opt.global_rank == 0:
                    log.warning("distopt.elastic: restored commit %d into a world of %d (restart %s) in %.2f s",
                                seq, opt.world_size,
                                os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get(RESTART_COUNT_ENV)),
                                time.time() - began)
            result = fn(state, *args, **kwargs)
            opt.all_gather_object(None)  # every rank is done reading the commits before they go
        except DistOptError as exc:
            sys.stderr.write(_lost_world(exc, opt.global_rank, opt.world_size, snapshots, run_id, torchrun))
            raise
        finally:
            if heartbeat is not None:
                heartbeat.stop()
        if writer:
            snapshots.remove()
        return result

    return wrapper
