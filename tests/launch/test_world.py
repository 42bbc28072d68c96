"""Backend choice from the launch environment; torchrun on one node and as two nodes; the CLI; no MPI."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from distopt.launch import world
from distopt.comm.single import SingleCommunicator
from tests.support import conformance
from tests.support.harness import ROOT, run_job
from tests.support.torch_workers import free_port

LAUNCHED = ROOT / "tests" / "support" / "launched"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", DISTOPT_TIMEOUT="30",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(argv: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} overran {timeout:.0f} s (a rank stalled):\n{(exc.stdout or b'')[-3000:]!r}"
                    f"\n{(exc.stderr or b'')[-3000:]!r}")


def _run_together(jobs: list[tuple[str, list[str], dict[str, str]]], timeout: float = 90) -> list[str]:
    """Start ``(name, argv, env)`` jobs at once; their outputs; fail naming the one that stalled or failed."""
    procs = [(name, subprocess.Popen(argv, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)) for name, argv, env in jobs]
    outs = []
    try:
        for name, proc in procs:
            try:
                outs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} stalled (over {timeout:.0f} s)")
            assert proc.returncode == 0, f"{name} failed: {outs[-1][-3000:]}"
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def _results(out: str) -> list[list]:
    return sorted(json.loads(m) for m in re.findall(r"RESULT (\[.*?\]\])", out))


@pytest.mark.parametrize("source, env, expected", [
    (None, {}, "single"),
    ("torchrun", {"MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torch"),
    ("torchrun", {"DISTOPT_JOB_ID": "abc"}, "shm"),
    ("OMPI", {}, "mpi"),
    ("MPICH", {}, "mpi"),
    ("Slurm", {"MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torch"),
    ("Slurm", {}, "mpi"),
])
@pytest.mark.unit
def test_choose_backend_table(source, env, expected):
    assert world.choose_backend(source, env) == expected


@pytest.mark.unit
def test_plain_process_is_single_without_mpi():
    comm, info = world.build_world(env={})
    assert isinstance(comm, SingleCommunicator) and (info.world_size, info.source) == (1, "single")
    conformance.run_all(comm)
    comm.close()


@pytest.mark.parametrize("backend, env, message", [
    ("shm", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "needs the job id"),
    ("torch", {}, "needs launcher variables"),
    ("single", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "torchrun variables .RANK=1, WORLD_SIZE=2. say 2"),
    ("gloo", {}, "backend must be one of"),
])
@pytest.mark.unit
def test_forced_backend_that_does_not_fit(backend, env, message):
    with pytest.raises(ValueError, match=message):
        world.build_world(backend=backend, env=env)


@pytest.mark.unit
def test_init_returns_ranks_before_any_optimizer():
    w = world.init()
    assert (w.rank, w.world_size, w.local_rank, w.backend) == (0, 1, 0, "single")
    assert world.init() is w and world.current() is w
    with pytest.raises(ValueError, match="already joined"):
        world.init(backend="mpi")
    w.close()
    assert world.current() is None


@pytest.mark.timeout(120)
@pytest.mark.job
def test_torchrun_two_processes_distopt_without_arguments():
    res = _run([*TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), str(LAUNCHED / "average_step.py")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _results(res.stdout) == [["torch", r, 2, r, [-1.5] * 3] for r in range(2)], res.stdout


@pytest.mark.timeout(120)
@pytest.mark.job
def test_torchrun_two_nodes_on_localhost():
    """Two torchrun commands, --nnodes 2 --node-rank 0|1, one process each: ranks 0 and 1, both local rank 0."""
    port = str(free_port())
    outs = _run_together([(f"node {node} (torchrun --node-rank {node})",
                           [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                            "--master-addr", "127.0.0.1", "--master-port", port, str(LAUNCHED / "average_step.py")],
                           {}) for node in range(2)])
    got = [_results(out) for out in outs]
    assert got == [[["torch", 0, 2, 0, [-1.5] * 3]], [["torch", 1, 2, 0, [-1.5] * 3]]], outs


@pytest.mark.timeout(60)
@pytest.mark.job
def test_slurm_variables_with_master_addr_use_torch():
    port = str(free_port())
    outs = _run_together([(f"Slurm task {r}", [sys.executable, str(LAUNCHED / "average_step.py")],
                           dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NODEID="0",
                                SLURM_NNODES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)],
                         timeout=50)
    assert [_results(o) for o in outs] == [[["torch", r, 2, r, [-1.5] * 3]] for r in range(2)], outs


@pytest.mark.job
def test_mpi_disagreeing_with_slurm_names_the_launcher():
    """SLURM_* for 2 tasks without MASTER_ADDR: MPI (a singleton here) disagrees; the error names Slurm and the fix."""
    res = _run([sys.executable, str(LAUNCHED / "average_step.py")], timeout=60, SLURM_PROCID="1", SLURM_NTASKS="2",
               SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_NNODES="1")
    assert res.returncode != 0
    assert ("rank information from Slurm variables (SLURM_PROCID=1, SLURM_NTASKS=2) (rank 1 of 2) disagrees with "
            "MPI (rank 0 of 1): under torchrun or srun without MPI support, use backend='torch'") in res.stderr, \
        res.stderr[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.job
def test_no_loadable_mpi_library():
    """mpi4py cannot load libmpi: BackendUnavailableError naming the fix; one process and shm work without MPI."""
    probe = ("import distopt, numpy as np\n"
             "opt = distopt.DistOpt(distopt.SGD(lr=1.0)); w = np.zeros(2, np.float32)\n"
             "opt.step([w], [np.ones(2, np.float32)]); print('SINGLE', opt.comm.name, w.tolist())\n"
             "try:\n    distopt.DistOpt(distopt.SGD(lr=1.0), backend='mpi')\n"
             "except distopt.BackendUnavailableError as exc:\n    print('UNAVAILABLE', exc)\n")
    res = _run([sys.executable, "-c", probe], MPI4PY_LIBMPI="/nonexistent/libmpi.so")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SINGLE single [-1.0, -1.0]" in res.stdout
    assert re.search(r"UNAVAILABLE backend 'mpi' is unavailable: mpi4py cannot load an MPI library .*/nonexistent.*"
                     r"pip install 'distopt\[mpich\]'", res.stdout), res.stdout
    res = _run([sys.executable, "-m", "distopt.launch", "-n", "2", str(LAUNCHED / "average_step.py")],
               MPI4PY_LIBMPI="/nonexistent/libmpi.so")
    assert res.returncode == 0, res.stderr[-3000:]
    assert _results(res.stdout) == [["shm", r, 2, r, [-1.5] * 3] for r in range(2)]


@pytest.mark.timeout(60)
@pytest.mark.job
def test_cli_tag_output_and_module_form():
    res = _run([sys.executable, "-m", "distopt.launch", "-n", "2", "--tag-output", "-m",
                "tests.support.launched.average_step"])
    assert res.returncode == 0, res.stderr[-3000:]
    for r in range(2):
        assert re.search(rf"^\[rank {r}\] RESULT \[\"shm\", {r}, 2, {r}, ", res.stdout, flags=re.M), res.stdout
    help_text = _run([sys.executable, "-m", "distopt.launch", "--help"]).stdout
    assert "-m MODULE" in help_text and "--tag-output" in help_text and "DISTOPT_JOB_ID" in help_text


@pytest.mark.timeout(120)
@pytest.mark.job
def test_cli_runs_cnn_example_unchanged():
    from tests.test_docs import FASHION_DIR, HAVE_DATA, SMOKE

    pytest.importorskip("torch")
    if not HAVE_DATA:
        pytest.skip(f"no Fashion-MNIST in {FASHION_DIR}")
    res = _run([sys.executable, "-m", "distopt.launch", "-n", "2", "examples/cnn_mpi.py", *SMOKE, "--threads", "1"],
               timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Evaluation accuracy" in res.stdout, res.stdout[-3000:]


# ------------------------------------------------------------------ H39 on every CPU backend

@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["mpiexec", "distopt.launch", "torchrun"])
@pytest.mark.job
def test_h39_close_twice_then_use(launcher):
    script = str(LAUNCHED / "h39_close.py")
    if launcher == "mpiexec":
        res = run_job([sys.executable, script], n=2, timeout=90)
        out = res.stdout
    elif launcher == "distopt.launch":
        res = _run([sys.executable, "-m", "distopt.launch", "-n", "2", script])
        out = res.stdout + res.stderr
    else:
        res = _run([*TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                    str(free_port()), script])
        out = res.stdout + res.stderr
    backend = {"mpiexec": "mpi", "distopt.launch": "shm", "torchrun": "torch"}[launcher]
    assert res.returncode == 0, out[-4000:]
    for r in range(2):
        assert f"H39 {r} {backend} ok" in out, out[-4000:]
    assert "UCX" not in out and "Segmentation" not in out, out[-4000:]


@pytest.mark.job
def test_h39_single_process():
    res = _run([sys.executable, str(LAUNCHED / "h39_close.py")])
    assert res.returncode == 0 and "H39 0 single ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.timeout(90)
@pytest.mark.job
def test_mpi_script_without_close_exits_without_ucx_warnings():
    """A script that never calls close(): the MPI window is freed at exit, before MPI_Finalize."""
    res = run_job([sys.executable, str(LAUNCHED / "average_step.py")], n=2, timeout=80)
    assert res.returncode == 0, res.stdout[-3000:]
    assert _results(res.stdout) == [["mpi", r, 2, r, [-1.5] * 3] for r in range(2)], res.stdout
    assert "UCX" not in res.stdout and "mpool" not in res.stdout, res.stdout[-3000:]


H53_ORDERS = ["destroy", "destroy_close", "close_destroy", "neither"]


@pytest.fixture(scope="module")
def h53_jobs():
    """H53's torchrun jobs, one per order, two at a time (each mostly waits on its rendezvous and on
    importing torch): ``order -> future`` of its finished process."""
    pytest.importorskip("torch")

    def job(order: str) -> subprocess.CompletedProcess:
        return _run([*TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                     str(free_port()), str(LAUNCHED / "h53_teardown.py"), order], timeout=30)

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {order: pool.submit(job, order) for order in H53_ORDERS}


@pytest.mark.parametrize("order", H53_ORDERS)
@pytest.mark.job
def test_h53_teardown_in_any_order_under_torchrun(order, h53_jobs):
    """The script owns the process group; whatever the order of destroy_process_group() and close(),
    every rank exits 0 within 30 s, with identical parameters, no traceback and no warning."""
    res = h53_jobs[order].result()
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    lines = sorted(re.findall(rf"H53 (\d) {order} (\[[^]]*\])", res.stdout))  # the ranks share stdout
    assert [r for r, _ in lines] == ["0", "1"] and lines[0][1] == lines[1][1], out[-4000:]
    assert "Traceback" not in out and "Warning" not in out and "warn" not in out.lower(), out[-4000:]
