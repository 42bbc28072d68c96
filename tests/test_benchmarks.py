"""Smoke runs of the benchmark scripts, so they never rot.

Each script runs with its smallest settings (seconds) and must exit 0 and
write JSON with the expected keys; the numbers themselves are not checked
(beyond the all-reduce's own correctness count). The MPI ones run under
``mpiexec -n 2`` through :func:`tests.support.harness.run_job`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import ROOT, run_job

BENCH = ROOT / "benchmarks"
HAVE_TORCH = importlib.util.find_spec("torch") is not None

sys.path.insert(0, str(ROOT / "examples"))
import fashion_mnist  # noqa: E402

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", fashion_mnist.DEFAULT_DIR)
HAVE_DATA = all(fashion_mnist.find_file(DATA_DIR, stem) for stem in fashion_mnist.FILES.values())


def _load(path: Path, benchmark: str) -> dict:
    assert path.is_file(), f"{path} was not written"
    data = json.loads(path.read_text())
    assert data["benchmark"] == benchmark
    assert {"date_utc", "cpus", "numpy"} <= set(data["env"])
    return data


@pytest.mark.job
def test_allreduce_smoke(tmp_path):
    out = tmp_path / "allreduce.json"
    res = run_job([sys.executable, str(BENCH / "allreduce.py"), "--quick", "--max-bytes", "65536",
                   "--warmup", "1", "--iters", "2", "--rounds", "1", "--out", str(out)], n=2, timeout=60)
    assert res.returncode == 0, res.stdout[-6000:]
    data = _load(out, "allreduce")
    assert data["world_size"] == 2
    assert {"distopt-mpi", "mpi4py"} <= set(data["backends"])
    if HAVE_TORCH:
        assert "gloo" in data["backends"] or "gloo" in data["skipped"]
    sizes = [r["bytes"] for r in data["results"]]
    assert sizes[0] == 8 and sizes[-1] == 65536
    for row in data["results"]:
        for name, rec in row["backends"].items():
            assert {"time_us", "algbw_GBps", "busbw_GBps", "xraw", "wrong", "median_time_us"} <= set(rec), name
            assert rec["wrong"] == 0, (name, row["bytes"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").is_file()


@pytest.mark.job
def test_step_smoke(tmp_path):
    out = tmp_path / "step.json"
    res = run_job([sys.executable, str(BENCH / "step.py"), "--quick", "--warmup", "1", "--iters", "1",
                   "--width-div", "8", "--out", str(out)], n=2, timeout=60)
    assert res.returncode == 0, res.stdout[-6000:]
    data = _load(out, "step")
    assert data["config"]["tensors"] == 161
    expected = {"raw", "naive", "step", "step_noop", "half", "topk1", "topk01", "thresh", "partial", "dgc",
                "powersgd", "copy", "zero1", "zero2"}
    assert expected <= set(data["results"]) | set(data["skipped"])
    if HAVE_TORCH:
        assert "ddp" in data["results"]
    for key, rec in data["results"].items():
        assert {"time_ms", "min_ms", "cpu_ms", "copy_passes", "x_raw", "wire_MB", "dense_MB", "wire_ratio"
                } <= set(rec), key
        assert rec["cpu_ms"] > 0 and rec["copy_passes"] > 0, key
    assert data["results"]["topk1"]["density"] == pytest.approx(0.01, rel=0.05)
    assert data["results"]["step_noop"]["control_per_step"] == 1.0  # the step header alone
    assert data["results"]["copy"]["copy_passes"] == pytest.approx(1.0)
    assert data["results"]["dgc"]["wire_ratio"] < 0.1 and data["results"]["powersgd"]["wire_ratio"] < 0.1
    table = subprocess.run([sys.executable, str(BENCH / "targets.py"), "--step", str(out), "--allreduce",
                            str(tmp_path / "none.json"), "--train", str(tmp_path / "none.json"),
                            "--overlap", str(tmp_path / "none.json")],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    lines = {row.split("|")[1].strip(): row for row in table.stdout.splitlines() if row.startswith("| ")}
    assert "| <= 1.0 | 1.00 | yes |" in lines["control collectives per dense step"]
    assert "not measured" in lines["CNN epoch, 2 processes: plain time / DDP gloo time"]


@pytest.mark.unit
def test_resnet50_shapes():
    sys.path.insert(0, str(BENCH))
    try:
        import step
    finally:
        sys.path.remove(str(BENCH))
    shapes = step.resnet50_shapes()
    assert len(shapes) == 161
    assert sum(int(__import__("numpy").prod(s)) for s in shapes) == 25_557_032


@pytest.mark.job
def test_compress_smoke(tmp_path):
    out = tmp_path / "compress.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, str(BENCH / "compress.py"), "--quick", "--n", "300000", "--repeat", "1",
                          "--no-cupy", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    data = _load(out, "compress")
    ops = [r["op"] for r in data["numpy"]]
    assert any(op.startswith("top-K 1%") for op in ops) and any(op.startswith("densify") for op in ops)
    for r in data["numpy"]:
        assert r["ok"], r["op"]
        assert {"median_ms", "min_ms"} <= set(r["distopt"]) and r["speedup"] > 0
    assert data["cupy"] is None and data["cupy_skipped"]


@pytest.mark.skipif(not HAVE_TORCH, reason="train.py needs torch")
@pytest.mark.skipif(not HAVE_DATA, reason=f"no Fashion-MNIST IDX files in {DATA_DIR}")
@pytest.mark.job
def test_train_smoke(tmp_path):
    out = tmp_path / "train.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DISTOPT_TIMEOUT": "60"}
    res = subprocess.run([sys.executable, str(BENCH / "train.py"), "--quick", "--max-steps", "3",
                          "--eval-limit", "200", "--procs", "2", "--strategies", "plain", "--data-dir", DATA_DIR,
                          "--timeout", "100", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=150)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    data = _load(out, "train")
    runs = {(r["impl"], r["strategy"], r["procs"]) for r in data["runs"]}
    assert runs == {("distopt", "plain", 2), ("ddp", "DDP", 2)}
    for r in data["runs"]:
        assert {"train_time", "samples_per_s", "eval_acc", "x_ddp_time", "d_acc_pp"} <= set(r)
        assert r["samples"] == 3 * 64 * 2
    plain, ddp = sorted(data["runs"], key=lambda r: r["impl"] == "ddp")
    assert plain["eval_acc"] == pytest.approx(ddp["eval_acc"], abs=0.02)  # same data, init and update rule


@pytest.mark.job
def test_plot_train_table_and_png(tmp_path):
    """plot_train.py: one row per DistOpt run at --procs, in LABELS order, last-epoch wire ratio, difference
    from plain."""
    pytest.importorskip("matplotlib")

    def run(strategy, accs, wire):
        history = [{"epoch": i, "eval_acc": a, "epoch_wire_ratio": wire} for i, a in enumerate(accs)]
        return {"impl": "distopt", "strategy": strategy, "procs": 2, "epochs": len(accs), "eval_acc": accs[-1],
                "wire_ratio": wire * 1.5, "history": history}

    runs = [run("dgc", [0.7, 0.885], 0.002), run("plain", [0.8, 0.9], 1.0),  # listed as plain, dgc
            {**run("plain", [0.1, 0.2], 1.0), "procs": 1}]
    (tmp_path / "a.json").write_text(json.dumps({"runs": runs}))
    png = tmp_path / "acc.png"
    res = subprocess.run([sys.executable, str(BENCH / "plot_train.py"), str(tmp_path / "a.json"), "--png", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "strategy" not in line]
    assert rows == ["| plain | 1.0000 | 1.5000 | 0.9000 | +0.00 | 0.9000 |",
                    "| DGC 99.9 % | 0.0020 | 0.0030 | 0.8850 | -1.50 | 0.8850 |"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _can_make_netns() -> bool:
    import shutil

    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc", "unshare"))):
        return False
    name = f"dnsimprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return ok


@pytest.mark.skipif(not HAVE_TORCH, reason="netsim.py's workers need torch")
@pytest.mark.skipif(not _can_make_netns(), reason="netsim.py needs root and network namespaces (ip, tc, unshare)")
@pytest.mark.job
def test_netsim_gpt_smoke(tmp_path):
    """The smallest GPT run over a simulated 2-node link (the step workload and the teardown: test_netsim.py)."""
    out = tmp_path / "netsim.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, str(BENCH / "netsim.py"), "--workload", "gpt", "--layers", "1",
                          "--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab", "128", "--warmup", "1",
                          "--iters", "2", "--no-probe", "--timeout", "150", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    data = _load(out, "netsim")
    assert data["workload"] == "gpt" and data["link"]["nodes"] == 2
    assert set(data["results"]) == {"ddp", "dense", "half", "topk1", "dgc", "powersgd"}
    for key, rec in data["results"].items():
        assert rec["time_ms"] > 0 and rec["final_loss"] > 0 and rec["wire_bytes"] > 0, key
    assert data["results"]["dense"]["final_loss"] == pytest.approx(data["results"]["ddp"]["final_loss"], rel=1e-3)


@pytest.mark.job
def test_zero_benchmark_smoke(tmp_path):
    """``benchmarks/zero.py`` (a driver of torchrun jobs) at W = 2 on a tiny GPT, DDP and ``zero=1``: every
    field of both rows; zero=1 holds half of DDP's AdamW state and ends bitwise equal to DDP."""
    pytest.importorskip("torch")
    out = tmp_path / "zero.json"
    res = subprocess.run([sys.executable, str(BENCH / "zero.py"), "--variants", "ddp,zero1", "--gpt", "256,32,2,1,16,2",
                          "--rounds", "1", "--iters", "1", "--warmup", "1", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = _load(out, "zero")
    rows = data["results"]
    assert set(rows) == {"ddp", "zero1"}
    for key, rec in rows.items():
        assert {"time_ms", "x_ddp", "peak_rss_mib", "parameter_bytes", "optimizer_state_bytes", "gradient_bytes",
                "max_abs_diff_vs_ddp"} <= set(rec), key
        assert rec["peak_rss_mib"] > 0 and rec["parameter_bytes"] == rec["params"] * 4, rec
    assert rows["zero1"]["max_abs_diff_vs_ddp"] == 0.0, rows["zero1"]
    assert rows["ddp"]["optimizer_state_bytes"] == 2 * rows["ddp"]["parameter_bytes"]  # AdamW's two moments
    assert rows["zero1"]["optimizer_state_bytes"] <= rows["ddp"]["optimizer_state_bytes"] / 2 + 1024, rows


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
@pytest.mark.job
def test_zero3_benchmark_smoke(tmp_path, launcher):
    """``benchmarks/zero3.py`` at W = 2 on a tiny GPT, under torchrun and mpiexec: DDP, ``zero=3`` and FSDP2;
    zero=3 ends bitwise equal to DDP and holds half of its parameters and AdamW state at rest, as FSDP2."""
    pytest.importorskip("torch")
    out = tmp_path / "zero3.json"
    res = subprocess.run([sys.executable, str(BENCH / "zero3.py"), "--variants", "ddp,zero3,fsdp2", "--launcher",
                          launcher, "--gpt", "256,32,2,1,16,2", "--rounds", "1", "--iters", "1", "--warmup", "1",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = _load(out, "zero3")
    rows = data["results"]
    assert set(rows) == {"ddp", "zero3", "fsdp2"} and data["launcher"] == launcher
    for key, rec in rows.items():
        assert {"time_ms", "x_ddp", "peak_rss_mib", "parameter_bytes", "optimizer_state_bytes", "gradient_bytes",
                "max_abs_diff_vs_ddp"} <= set(rec), key
    assert rows["zero3"]["max_abs_diff_vs_ddp"] == 0.0 and rows["fsdp2"]["max_abs_diff_vs_ddp"] == 0.0, rows
    full = rows["ddp"]["parameter_bytes"]
    assert full == rows["ddp"]["params"] * 4
    # 1/W, plus the odd elements and the one element each freed parameter keeps (this GPT has < 32 tensors)
    assert full / 2 <= rows["zero3"]["parameter_bytes"] <= full / 2 + 64 + 4 * 32, rows
    assert rows["zero3"]["optimizer_state_bytes"] <= rows["ddp"]["optimizer_state_bytes"] / 2 + 1024, rows
    assert 0 < rows["zero3"]["gathered_bytes_peak"] <= full, rows


@pytest.mark.unit
def test_zero_targets_read_zero_py_results():
    """targets.py's zero.py rows: zero=1's time over zero=0's, and zero=1's peak RSS over zero=0's minus the
    optimizer state zero=1 saves (MiB); "not measured" without the run."""
    sys.path.insert(0, str(BENCH))
    try:
        import targets
    finally:
        sys.path.remove(str(BENCH))
    mib = 1 << 20
    run = {"results": {"zero0": {"time_ms": 100.0, "peak_rss_mib": 1000.0, "optimizer_state_bytes": 200 * mib},
                       "zero1": {"time_ms": 95.0, "peak_rss_mib": 850.0, "optimizer_state_bytes": 100 * mib}}}
    (_, _, t_value, t_met), (_, _, o_value, _), (_, _, r_value, r_met) = targets.zero_rows(run)
    assert t_value == pytest.approx(0.95) and not t_met and o_value is None
    assert r_value == pytest.approx(850 / 900) and r_met
    assert [row[2] for row in targets.zero_rows(None)] == [None, None, None]


@pytest.mark.unit
def test_zero3_targets_read_zero3_py_results():
    """targets.py's zero3.py rows: zero=3's time over DDP's and FSDP2's, its peak RSS over FSDP2's."""
    sys.path.insert(0, str(BENCH))
    try:
        import targets
    finally:
        sys.path.remove(str(BENCH))
    run = {"results": {"zero3": {"time_ms": 120.0, "x_ddp": 1.2, "peak_rss_mib": 900.0},
                       "fsdp2": {"time_ms": 200.0, "peak_rss_mib": 1000.0}}}
    (_, _, ddp, ddp_met), (_, _, fsdp, fsdp_met), (_, _, rss, rss_met) = targets.zero3_rows(run)
    assert ddp == pytest.approx(1.2) and ddp_met and fsdp == pytest.approx(0.6) and not fsdp_met
    assert rss == pytest.approx(0.9) and rss_met
    assert [row[2] for row in targets.zero3_rows(None)] == [None, None, None]


@pytest.mark.job
def test_elastic_benchmark_smoke(tmp_path):
    """``benchmarks/elastic.py`` on a tiny GPT: three torchrun agents, one killed; every figure is written, the
    two survivors saw the loss and stepped again, and the times are in order (detection before recovery)."""
    pytest.importorskip("torch")
    out = tmp_path / "elastic.json"
    res = subprocess.run([sys.executable, str(BENCH / "elastic.py"), "--gpt", "256,32,2,1,16,2", "--steps", "8",
                          "--every", "2", "--timeout", "200", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=260)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = _load(out, "elastic")["results"]
    assert rec["survivors_lost"] == 2, rec
    assert 0 < rec["detect_s"] < rec["kill_to_step_s"] and 0 < rec["recovery_s"] <= rec["kill_to_step_s"], rec
    assert rec["commit_bytes"] > 0 and rec["commit_ms"] > 0 and rec["worker_start_s"] > 0, rec
    assert rec["step_ms_world3"] > 0 and rec["step_ms_world2"] > 0, rec


@pytest.mark.job
def test_gpu_check_runs_end_to_end_on_the_standin(tmp_path):
    """``benchmarks/gpu_check.py --standin``: every part runs, the GPU tests pass on the stand-in, and every
    strategy on CuPy gives its NumPy twin's bits at world size 1 over NCCL and in two processes sharing one
    device over shared memory. (Not marked ``gpu``: the check runs ``pytest -m gpu`` itself.)"""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--standin", "--out", str(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["ok"] and data["standin"] and data["versions"]["standin"] and data["versions"]["nccl_available"]
    assert data["tests"]["counts"]["passed"] > 50 and "failed" not in data["tests"]["counts"]
    for part, backend in (("nccl_w1", "nccl"), ("shared", "shm")):
        strategies = data[part]["strategies"]
        assert {"dense", "half-fp16", "sparse-topk", "sparse-threshold", "dgc", "powersgd", "partial"} <= set(strategies)
        for key, s in strategies.items():
            assert s["bitwise"] and s["backend"] == backend, (part, key, s)
    assert data["nccl_w1"]["strategies"]["dense"]["host_syncs_per_step"] == 0
    assert data["timing"]["numpy_ms"] > 0 and data["timing"]["cupy_nccl_ms"] > 0


@pytest.mark.timeout(480)
@pytest.mark.job
def test_fits_benchmark_smoke(tmp_path):
    """``benchmarks/fits.py`` at W = 4 on an 8.4M-parameter GPT. With float32 parameters + AdamW at 1.5x the
    per-rank cap, DDP runs out of memory inside the cap (the worker catches the refused allocation and reports
    it); under a cap 1/0.3 of them, meta-built ``zero=3`` trains within it, its last loss within float32
    rounding of the one-process reference, gathering twice and reducing once the float32 model per step; and
    the elastic part (torchrun --nnodes 1, one worker SIGKILLed) recovers inside the same cap and ends bitwise
    equal to its uninterrupted run."""
    pytest.importorskip("torch")
    gpt = ["--gpt", "4096,256,4,8,32,2", "--steps", "2"]
    tight, loose = tmp_path / "tight.json", tmp_path / "loose.json"
    res = subprocess.run([sys.executable, str(BENCH / "fits.py"), *gpt, "--variants", "ddp", "--ratio", "1.5",
                          "--no-elastic", "--timeout", "150", "--out", str(tight)], cwd=ROOT, capture_output=True,
                         text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ddp = _load(tight, "fits")["results"]["ddp"]
    assert ddp["status"] == "oom" and ddp["where"] in ("build", "step 1"), ddp
    assert "allocate memory" in ddp["error"] or ddp["error"].startswith("MemoryError"), ddp
    res = subprocess.run([sys.executable, str(BENCH / "fits.py"), *gpt, "--variants", "zero3", "--ratio", "0.3",
                          "--elastic-steps", "6", "--every", "2", "--kill-after-step", "3", "--timeout", "150",
                          "--out", str(loose)], cwd=ROOT, capture_output=True, text=True, timeout=260)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = _load(loose, "fits")
    z3, params = data["results"]["zero3"], data["params"]
    assert z3["status"] == "ok" and 0 < z3["peak_growth_mib"] <= z3["cap_mib"], z3
    assert abs(z3["loss_diff"]) < 1e-4 and z3["s_per_step"] > 0, z3
    assert z3["gather_bytes"] == 8 * params and z3["reduce_bytes"] == 4 * params, z3
    el = data["elastic"]
    assert el["status"] == "ok" and el["killed"] and el["exit"] == 0, el
    assert el["bitwise"] and el["losses_equal"] and el["steps_redone"] == 1, el
    assert 0 < el["restored_s"] <= el["recovery_s"] and el["peak_growth_mib"] <= el["cap_mib"], el
