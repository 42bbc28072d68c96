"""The consensus helper (distopt.comm.consensus) in a simulated world: agreement returns, a difference or
a rank's own error raises on every rank, naming the ranks and their values."""
from __future__ import annotations

import numpy as np
import pytest

from distopt.comm.consensus import agree, check_agreed, digest, gather_objects
from distopt.errors import CollectiveMismatchError
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


def _outcome(fn):
    """``fn()``'s result, or ``(exception class name, message)``."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return type(exc).__name__, str(exc)


def test_agreement_returns_every_ranks_extra_and_costs_one_small_all_gather():
    def body(rank, comm):
        extra = agree(comm, {"shape": (2, 3), "dtype": "float32"}, call="test", extra=[rank, 10 * rank])
        return extra.tolist(), list(comm.calls)

    for extra, calls in run_world(3, body):
        assert extra == [[0, 0], [1, 10], [2, 20]]
        assert calls == [("all_gather", 4)]  # (problem?, digest, 2 extra) int64, nothing more


def test_different_values_raise_on_every_rank_naming_the_field_and_every_ranks_value():
    def body(rank, comm):
        return _outcome(lambda: agree(comm, {"dtype": "float32", "shape": (4,) if rank != 2 else (5,)},
                                      call="all_reduce", hint="same model everywhere"))

    results = run_world(4, body)
    assert results == [("CollectiveMismatchError", "all_reduce: shape differs across ranks (ranks 0-1: (4,), "
                        "rank 2: (5,), rank 3: (4,)); same model everywhere")] * 4


def test_the_first_differing_field_is_named_and_shown_values_replace_compared_ones():
    def body(rank, comm):
        shape = (rank + 1, 3 if rank else 4)
        return _outcome(lambda: agree(comm, {"collective": "all_gather", "rest": shape[1:], "dtype": str(rank)},
                                      call="all_gather", shown={"rest": shape}, error=TypeError))

    assert run_world(2, body) == [("TypeError", "all_gather: rest differs across ranks (rank 0: (1, 4), "
                                   "rank 1: (2, 3))")] * 2


def test_a_problem_on_one_rank_raises_its_class_on_every_rank_naming_the_rank():
    def body(rank, comm):
        problem = ValueError("root must be in [0, 3), got 7") if rank == 1 else None
        return _outcome(lambda: agree(comm, {"root": 7 if rank == 1 else 0}, call="broadcast", problem=problem,
                                      kinds=(ValueError, TypeError)))

    assert run_world(3, body) == [("ValueError", "broadcast on rank 1: root must be in [0, 3), got 7")] * 3


def test_problems_on_several_ranks_are_all_named_and_the_class_resolves_by_name():
    def body(rank, comm):
        problem = {0: None, 1: FileNotFoundError("no file a"), 2: KeyError("mean names 'z'"), 3: RuntimeError("x")}
        return _outcome(lambda: agree(comm, {}, call="load", problem=problem[rank], kinds=(ValueError, OSError)))

    want = ("FileNotFoundError", "load on rank 1: no file a; on rank 2: KeyError: mean names 'z'; "
            "on rank 3: RuntimeError: x")
    assert run_world(4, body) == [want] * 4


def test_a_problem_raised_on_its_own_rank_is_chained_to_the_original():
    def body(rank, comm):
        original = TypeError("op='avg' on int64") if rank == 0 else None
        try:
            agree(comm, {}, call="all_reduce", problem=original, kinds=(ValueError, TypeError))
        except TypeError as exc:
            return exc.__cause__ is original and (rank == 0) == (original is not None)
        return False

    assert run_world(2, body) == [True, True]


def test_a_builtin_class_that_takes_other_arguments_falls_back_to_its_kind():
    def body(rank, comm):
        problem = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad") if rank == 1 else None
        return _outcome(lambda: agree(comm, {}, call="load", problem=problem, kinds=(ValueError,)))

    kind, text = run_world(2, body)[0]
    assert kind == "ValueError" and text.startswith("load on rank 1: UnicodeDecodeError: ")


def test_a_lazy_value_with_its_key_is_built_only_when_the_ranks_differ():
    built = []

    def body(rank, comm):
        def fields():
            built.append(rank)
            return {"settings": {"lr": 0.1 if rank == 0 else 0.2}}

        agree(comm, fields, call="step", key=digest({"lr": 0.1}))  # equal keys: fields() is never called
        return _outcome(lambda: agree(comm, fields, call="step", key=rank))

    results = run_world(2, body)
    assert results == [("CollectiveMismatchError", "step: settings differs across ranks (rank 0: {'lr': 0.1}, "
                        "rank 1: {'lr': 0.2})")] * 2
    assert sorted(built) == [0, 1]


def test_equal_values_behind_different_keys_still_raise_on_every_rank():
    def body(rank, comm):
        return _outcome(lambda: agree(comm, lambda: {"a": 1}, call="step", key=100 + rank))

    kind, text = run_world(2, body)[0]
    assert kind == "CollectiveMismatchError" and text.startswith("step: digest of the values differs across ranks")


def test_check_agreed_on_a_gathered_table_uses_per_field_show_and_hint():
    table = {"collective": [(0, 3), (0, 3)], "element count": [8, 9]}
    show = {"collective": lambda ks: f"kind {ks[0]} #{ks[1]}"}
    with pytest.raises(CollectiveMismatchError, match=r"^mpi all_reduce #3 on rank 0: element count differs "
                       r"across ranks \(rank 0: 8, rank 1: 9\); different buffers$"):
        check_agreed("mpi all_reduce #3 on rank 0", table, show=show, hint={"element count": "different buffers"})
    check_agreed("x", {"collective": [(0, 3)] * 3, "element count": [8] * 3})  # agreement: no error


def test_gather_objects_and_digest():
    assert run_world(3, lambda rank, comm: gather_objects(comm, {"rank": rank}))[2] == [{"rank": r} for r in range(3)]
    assert digest({"b": 1, "a": (1, 2)}) == digest({"a": [1, 2], "b": 1}) and 0 <= digest("x") < 2 ** 63
    assert digest({"dtype": np.dtype("float32")}) == digest({"dtype": "float32"})
