"""The documentation is tested: every code block runs, every command is checked.

Each fenced block in ``docs/**/*.md`` may be preceded by a marker comment,
``<!-- test: ... -->``, that says how it is checked:

* a ``python`` block without a marker, or marked ``run``, runs as a script
  in a subprocess (its own temporary directory as the working directory);
* ``mpi``: a block meant for several ranks, run under ``mpiexec -n 2``. All
  such blocks run in ONE job (``tests/support/docs_snippets/run_blocks.py``), one
  after the other, each from a fresh namespace;
* ``gpu``: needs CuPy and a CUDA device; run under ``mpiexec -n 1`` where
  they exist, skipped elsewhere;
* ``file=NAME``: a file the reader saves (a script, a hostfile); written to
  disk for the command check that uses it;
* ``cmd=ID`` (shell blocks): checked by ``CHECKS[ID]`` below, which runs an
  equivalent command (smaller, or on localhost) or checks the scripts,
  flags and extras it names;
* ``output=ID``: the output printed by command ``ID``; its lines are
  compared, numbers aside, with a real run;
* ``table=ID`` (on a python block and before a Markdown table): the block
  prints that table;
* ``diagram``: a text diagram; the ``distopt`` modules it names must exist.
* ``measured=SCRIPT``: a text block of what benchmark ``SCRIPT``
  (``benchmarks/NAME.py``) printed in a measured run; the script must exist
  and name the first word of the block's title line.

A block of any other kind, a shell block without a check, or a check
without its block fails :func:`test_every_block_is_checked`. Also here: the
troubleshooting messages are found in distopt's source, the site builds with
``mkdocs build --strict``, and the API reference covers every public name.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.harness import ROOT, mpiexec, run_job

DOCS = ROOT / "docs"
RUNNER = ROOT / "tests" / "support" / "docs_snippets" / "run_blocks.py"
FASHION_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")
HAVE_DATA = all(any((Path(FASHION_DIR) / (s + ext)).is_file() for ext in ("", ".gz")) for s in IDX_STEMS)
SMOKE = ["--max-steps", "5", "--eval-limit", "200", "--data-dir", FASHION_DIR]
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"no Fashion-MNIST IDX files in {FASHION_DIR} "
                                "(apt-get install dataset-fashion-mnist, or set FASHION_MNIST_DIR)")

# ---------------------------------------------------------------- parsing

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str                 # path relative to docs/
    line: int                 # 1-based line of the opening fence
    lang: str
    code: str
    marker: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _parse_marker(body: str) -> dict[str, str]:
    out = {}
    for token in shlex.split(body):
        key, _, value = token.partition("=")
        out[key] = value
    return out


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def parse_blocks(path: Path) -> list[Block]:
    """Fenced code blocks of one page, with the marker comment right above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        body = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        k = i - 1
        marker = _MARKER.match(lines[k]) if k >= 0 else None
        blocks.append(Block(str(path.relative_to(DOCS)), i + 1, m["lang"] or "", "\n".join(body) + "\n",
                            _parse_marker(marker["body"]) if marker else {}))
        i = j + 1
    return blocks


def parse_tables(path: Path) -> dict[str, list[str]]:
    """``{id: lines}`` of the Markdown tables right after a ``<!-- test: table=id -->`` marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tables = {}
    for i, line in enumerate(lines):
        m = _MARKER.match(line)
        if m and "```" not in (lines[i + 1] if i + 1 < len(lines) else ""):
            marker = _parse_marker(m["body"])
            if "table" in marker:
                rows = []
                for row in lines[i + 1:]:
                    if not row.startswith("|"):
                        break
                    rows.append(row.strip())
                tables[marker["table"]] = rows
    return tables


ALL_BLOCKS = [b for page in _pages() for b in parse_blocks(page)]


def _kind(block: Block) -> str:
    m = block.marker
    for key in ("file", "cmd", "output", "diagram", "measured", "gpu", "mpi"):
        if key in m:
            return key
    return "run" if block.lang == "python" else "unmarked"


def _blocks(kind: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if _kind(b) == kind and (b.lang == "python" or kind not in ("run", "mpi", "gpu"))]


def _file_block(name: str) -> Block:
    hits = [b for b in ALL_BLOCKS if b.marker.get("file") == name]
    assert len(hits) == 1, f"expected one block marked file={name}, found {len(hits)}"
    return hits[0]


def _cmd_block(cmd_id: str) -> Block:
    hits = [b for b in ALL_BLOCKS if b.marker.get("cmd") == cmd_id]
    assert len(hits) == 1, f"expected one block marked cmd={cmd_id}, found {len(hits)}"
    return hits[0]


def _commands(block: Block) -> list[list[str]]:
    """The commands of a shell block (comments and continuation lines handled), as argv lists."""
    text = block.code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(shlex.split(line, comments=True))
    return out


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", "DISTOPT_TIMEOUT": "30",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _python(argv: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------ the block inventory

@pytest.mark.unit
def test_every_block_is_checked():
    problems = []
    for b in ALL_BLOCKS:
        kind = _kind(b)
        if b.lang not in ("python", "bash", "text"):
            problems.append(f"{b.id}: language {b.lang!r}: use python, bash or text")
        elif kind == "unmarked":
            problems.append(f"{b.id}: a {b.lang} block needs a marker (cmd=, file=, output= or diagram)")
        elif kind == "cmd" and b.marker["cmd"] not in CHECKS:
            problems.append(f"{b.id}: no check for cmd={b.marker['cmd']} in tests/test_docs.py CHECKS")
        elif kind in ("run", "mpi", "gpu") and b.lang != "python":
            problems.append(f"{b.id}: {kind} applies to python blocks")
        elif kind == "measured" and b.lang != "text":
            problems.append(f"{b.id}: measured= applies to text blocks")
        elif kind == "output" and b.marker["output"] not in CHECKS:
            problems.append(f"{b.id}: output={b.marker['output']} names no command check")
    used = {b.marker.get("cmd") for b in ALL_BLOCKS}
    problems += [f"CHECKS[{k!r}] has no block marked cmd={k}" for k in CHECKS if k not in used]
    files = {b.marker["file"] for b in ALL_BLOCKS if "file" in b.marker}
    problems += [f"file={name} is used by no command check" for name in files - FILES_USED]
    assert not problems, "\n".join(problems)


@pytest.mark.unit
def test_shell_blocks_name_existing_scripts():
    """Every ``examples/...`` or ``tests/...`` path in a shell block exists."""
    missing = []
    for b in ALL_BLOCKS:
        if b.lang == "bash":
            for path in re.findall(r"\b((?:examples|tests|docs)/[\w./-]+\.py)\b", b.code):
                if not (ROOT / path).is_file():
                    missing.append(f"{b.id}: {path}")
    assert not missing, missing


# ------------------------------------------------------------ python blocks

def _own_process(block: Block) -> bool:
    """A block that starts worker processes (spawn, multiprocessing) runs as a script of its own: its
    worker functions must be importable from its ``__main__``."""
    return any(word in block.code for word in ("spawn(", "multiprocessing", "__main__"))


@pytest.fixture(scope="module")
def local_results(tmp_path_factory) -> dict:
    """The plain-``python`` blocks that start no processes, run one after the other in ONE process
    (``run_blocks.py --local``: a fresh namespace and folder each, the environment restored after
    each); results by block id. A block that fails there runs again as a script of its own, and
    that run decides (so no block fails for what another one left behind)."""
    base = tmp_path_factory.mktemp("docs-local")
    manifest = []
    for n, b in enumerate(_blocks("run")):
        if _own_process(b) or ("import torch" in b.code and not HAVE_TORCH):
            continue
        workdir = base / f"block{n}"
        workdir.mkdir()
        (workdir / "block.py").write_text(b.code, encoding="utf-8")
        manifest.append({"id": b.id, "path": str(workdir / "block.py"), "workdir": str(workdir)})
    (base / "manifest.json").write_text(json.dumps(manifest))
    try:
        _python([str(RUNNER), "--local", str(base / "manifest.json"), str(base / "results.json")], base,
                timeout=90 * max(len(manifest), 1))
    except subprocess.TimeoutExpired:
        pass  # the blocks without a result run as scripts of their own
    return json.loads((base / "results.json").read_text()) if (base / "results.json").exists() else {}


@pytest.mark.parametrize("block", _blocks("run"), ids=lambda b: b.id)
@pytest.mark.job
def test_python_block(block: Block, tmp_path: Path, request):
    _skip_without_torch(block)
    batched = None if _own_process(block) else request.getfixturevalue("local_results").get(block.id)
    if batched is not None and batched["ok"]:
        res = subprocess.CompletedProcess([], 0, batched["ranks"][0]["stdout"], "")
    else:  # a script of its own, as a reader runs it
        script = tmp_path / "block.py"
        script.write_text(block.code, encoding="utf-8")
        res = _python([str(script)], tmp_path, timeout=90)
    assert res.returncode == 0, f"{block.id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    if "table" in block.marker:
        table = parse_tables(DOCS / block.page)[block.marker["table"]]
        assert res.stdout.strip().splitlines() == table, (
            f"{block.id}: the table in the page differs from what the block prints:\n{res.stdout}")


HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _skip_without_torch(block: Block) -> None:
    if "import torch" in block.code and not HAVE_TORCH:
        pytest.skip("needs PyTorch (pip install -e '.[torch]')")


@pytest.fixture(scope="module")
def mpi_results(tmp_path_factory) -> dict:
    """Run the ``mpi`` blocks under ``mpiexec -n 2``; results by block id.

    One job runs the blocks one after the other and stops at the first that
    fails (the ranks may be out of step after it); a new job then takes the
    blocks after it, so every block gets a result of its own.
    """
    base = tmp_path_factory.mktemp("docs-mpi")
    manifest = []
    for n, b in enumerate(_blocks("mpi")):
        if "import torch" in b.code and not HAVE_TORCH:
            continue
        workdir = base / f"block{n}"
        workdir.mkdir()
        path = workdir / "block.py"
        path.write_text(b.code, encoding="utf-8")
        manifest.append({"id": b.id, "path": str(path), "workdir": str(workdir)})
    results: dict = {}
    outputs = []
    for attempt in range(4):  # at most 3 failing blocks get a fresh job after them
        remaining = [m for m in manifest if m["id"] not in results]
        if not remaining:
            break
        (base / f"manifest{attempt}.json").write_text(json.dumps(remaining))
        results_path = base / f"results{attempt}.json"
        res = run_job([sys.executable, str(RUNNER), str(base / f"manifest{attempt}.json"), str(results_path)],
                      n=2, timeout=240, collective_timeout=30.0)
        outputs.append(f"--- job {attempt} (exit {res.returncode}) ---\n{res.stdout[-4000:]}")
        new = json.loads(results_path.read_text()) if results_path.exists() else {}
        results.update(new)
        if not new:  # the job died before finishing any block
            break
    return {"results": results, "output": "\n".join(outputs)}


@pytest.mark.parametrize("block", _blocks("mpi"), ids=lambda b: b.id)
@pytest.mark.job
def test_mpi_block(block: Block, mpi_results: dict):
    _skip_without_torch(block)
    result = mpi_results["results"].get(block.id)
    if result is None:
        pytest.fail(f"{block.id} did not run; the jobs' output:\n{mpi_results['output'][-6000:]}")
    if not result["ok"]:
        report = "\n".join(f"--- rank {r} ---\n{x['stdout'][-1500:]}{x['error']}"
                           for r, x in enumerate(result["ranks"]))
        pytest.fail(f"{block.id} failed under mpiexec -n 2:\n{report}")


@pytest.mark.gpu
@pytest.mark.parametrize("block", _blocks("gpu"), ids=lambda b: b.id)
@pytest.mark.unit
def test_gpu_block(block: Block, tmp_path: Path):
    """On a GPU machine, or on the CuPy stand-in (two devices) where CuPy is not installed; blocks of CUDA
    tensors need a real device."""
    from tests.support.gpu import is_standin, require_device, standin_env

    extra: dict[str, str] = {}
    if is_standin():
        if "import torch" in block.code:
            pytest.skip("CUDA tensors need a real device")
        env = standin_env(devices=2)
        extra = {key: env[key] for key in ("CUPY_STANDIN_DEVICES",)}
        extra["PYTHONPATH"] = env["PYTHONPATH"]
    else:
        require_device()
    if "import torch" in block.code:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs PyTorch with CUDA")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    if "spawn(" in block.code:  # the multiprocessing mode: the block starts its own workers
        res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(**extra), capture_output=True,
                             text=True, timeout=180)
        assert res.returncode == 0, f"{block.id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    else:  # one GPU per rank; a machine with one GPU runs the block as a job of one rank
        res = run_job([sys.executable, str(script)], n=1, timeout=180, env=extra)
        assert res.returncode == 0, f"{block.id} failed under mpiexec -n 1:\n{res.stdout[-6000:]}"


def _exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute of one."""
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        module, _, attr = dotted.rpartition(".")
        return _exists(module) and hasattr(importlib.import_module(module), attr) if module else False


@pytest.mark.unit
def test_measured_blocks_come_from_existing_benchmarks():
    blocks = _blocks("measured")
    assert blocks, "no measured= block: the performance page shows the benchmarks' output"
    for b in blocks:
        script = ROOT / b.marker["measured"]
        assert script.parent.name == "benchmarks" and script.is_file(), f"{b.id}: {script} is not a benchmark"
        title = b.code.split()[0].rstrip(",")
        assert title in script.read_text(), f"{b.id}: {script.name} does not print a title starting {title!r}"


@pytest.mark.unit
def test_diagrams_name_existing_modules():
    for b in _blocks("diagram"):
        for name in set(re.findall(r"\bdistopt(?:\.\w+)+", b.code)):
            assert _exists(name), f"{b.id}: {name} does not exist"


# ----------------------------------------------------------- command checks

def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def check_install(block: Block, tmp_path: Path) -> None:
    """The extras named in the install commands, and in the extras table, are the project's."""
    extras = _extras()
    named = {e.strip() for group in re.findall(r'\.\[([\w,\s-]+)\]', block.code) for e in group.split(",")}
    assert named and named <= set(extras), f"unknown extras {named - set(extras)} (have {sorted(extras)})"
    page = (DOCS / block.page).read_text()
    table = {m for m in re.findall(r"^\| `(\w+)`(?: / `(\w+)`)? \|", page, flags=re.M) for m in m if m}
    assert table == set(extras), f"the extras table lists {sorted(table)}, pyproject has {sorted(extras)}"


@pytest.fixture(scope="module")
def cnn_smoke():
    """``mpiexec -n 2 python examples/cnn_mpi.py`` cut down to 20 steps and 1000 test images: the smoke run
    of tests/test_examples.py (:func:`tests.support.examples.cnn_run`, one job for every example run)."""
    pytest.importorskip("torch")
    from tests.support.examples import cnn_run

    return cnn_run("smoke")


def _script_args(block: Block, script: str) -> list[list[str]]:
    """For each command of ``block`` that runs ``script``, the arguments after it."""
    out = []
    for argv in _commands(block):
        if script in argv:
            out.append(argv[argv.index(script) + 1:])
    assert out, f"{block.id}: no command runs {script}"
    return out


def _script_module(name: str):
    """``examples/<name>.py`` or ``benchmarks/<name>.py`` imported in this process (both folders on
    ``sys.path``, as the scripts themselves have them): the command checks parse flags with the
    scripts' own parsers here, not in a new interpreter each."""
    for folder in ("examples", "benchmarks"):
        if str(ROOT / folder) not in sys.path:
            sys.path.insert(0, str(ROOT / folder))
    return importlib.import_module(name)


def _parses(parse, argv: list[str]):
    """``(parse(argv), None)``, or ``(None, message)`` where argparse refuses ``argv`` (its SystemExit)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv), None
    except SystemExit as exc:
        return None, f"{argv} does not parse (exit {exc.code}): {err.getvalue()[-3000:]}"


def _check_cnn_args(arg_lists: list[list[str]], tmp_path: Path) -> None:  # noqa: ARG001
    """The flags parse with examples/cnn_mpi.py's own parser."""
    pytest.importorskip("torch")
    cnn_mpi = _script_module("cnn_mpi")
    for args in arg_lists:
        _, error = _parses(cnn_mpi.parse_args, args)
        assert error is None, error


def _rank0_lines(out: str) -> list[str]:
    return [t for r, t in re.findall(r"^\[(\d+)\]\s?(.*?)\s*$", out, flags=re.M) if r == "0"]


@needs_data
def check_first_cpu_run(block: Block, tmp_path: Path, cnn_smoke=None) -> None:
    assert "dataset-fashion-mnist" in (ROOT / "examples" / "fashion_mnist.py").read_text()
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)
    res = cnn_smoke
    assert res.ok, res.stdout[-6000:]
    expected = [b for b in ALL_BLOCKS if b.marker.get("output") == "first-cpu-run"]
    assert len(expected) == 1
    patterns = [re.escape(line).replace(r"\.", ".") for line in expected[0].code.strip().splitlines()]
    patterns = [re.sub(r"\d+(?:\.\d+)?", r"[\\d.]+", p) for p in patterns]
    got = _rank0_lines(res.stdout)
    assert len(got) == len(patterns), f"rank 0 printed {got}, the page shows {expected[0].code}"
    for pattern, line in zip(patterns, got):
        assert re.fullmatch(pattern, line), f"{line!r} does not have the shape of {pattern!r}"


@needs_data
def check_mpiexec_one_node(block: Block, tmp_path: Path, cnn_smoke=None) -> None:
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)
    assert cnn_smoke.ok, cnn_smoke.stdout[-6000:]


RANKS_PROBE = textwrap.dedent("""
    import distopt, json, sys
    from mpi4py import MPI
    info = distopt.launch.ranks.resolve(mpi_comm=MPI.COMM_WORLD)
    line = "PROBE " + json.dumps([info.source, info.global_rank, info.world_size, info.local_rank]) + "\\n"
    sys.stdout.write(line)  # one write per line: the ranks share the terminal
""")


def check_mpich_hostfile(block: Block, tmp_path: Path) -> None:
    """The hostfile format and the flags, on this machine: ``localhost:2`` with ``-f``, ``-n``, ``-ppn``."""
    hosts = _file_block("hosts")
    assert all(re.fullmatch(r"[\w.-]+:\d+", line) for line in hosts.code.split()), hosts.code
    (argv,) = _commands(block)
    assert argv[:1] == ["mpiexec"] and argv[argv.index("-f") + 1] == "hosts"
    assert int(argv[argv.index("-n") + 1]) == sum(int(line.split(":")[1]) for line in hosts.code.split())
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)
    (tmp_path / "hosts").write_text("localhost:2\n")
    (tmp_path / "probe.py").write_text(RANKS_PROBE)
    res = subprocess.run([mpiexec(), "-f", "hosts", "-n", "2", "-ppn", "2", sys.executable, "probe.py"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    seen = sorted(json.loads(m) for m in re.findall(r"PROBE (\[[^]]*\])", res.stdout))
    assert seen == [["MPICH", 0, 2, 0], ["MPICH", 1, 2, 1]], res.stdout


def check_openmpi_hostfile(block: Block, tmp_path: Path) -> None:
    hosts = _file_block("hosts-openmpi")
    assert all(re.fullmatch(r"[\w.-]+ slots=\d+", line) for line in hosts.code.strip().splitlines())
    (argv,) = _commands(block)
    assert argv[0] == "mpirun" and argv[argv.index("--hostfile") + 1] == "hosts-openmpi"
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)


def check_srun(block: Block, tmp_path: Path) -> None:
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)
    sbatch = _file_block("job.sbatch")
    (tmp_path / "job.sbatch").write_text(sbatch.code)
    res = subprocess.run(["bash", "-n", "job.sbatch"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "examples/cnn_mpi.py" in sbatch.code and (ROOT / "examples/cnn_mpi.py").is_file()


def check_multiprocess_example(block: Block, tmp_path: Path) -> None:  # noqa: ARG001
    """The example and its flags exist (its real run is tests/test_examples.py's business): the script
    run as ``__main__`` in this process with ``--help`` after the page's flags exits 0 with its help."""
    pytest.importorskip("torch")
    _script_module("cnn_mpi")  # its imports on sys.path
    script = str(ROOT / "examples/cnn_multiprocess.py")
    for args in _script_args(block, "examples/cnn_multiprocess.py"):
        out, err = io.StringIO(), io.StringIO()
        argv, sys.argv = sys.argv, [script, *args, "--help"]
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                    pytest.raises(SystemExit) as exc:
                runpy.run_path(script, run_name="__main__")
        finally:
            sys.argv = argv
        assert exc.value.code in (0, None) and "--dist-option" in out.getvalue(), err.getvalue()[-3000:]


def check_distopt_launch(block: Block, tmp_path: Path) -> None:
    """``python -m distopt.launch -n 4 launched.py`` with the page's script."""
    (argv,) = _commands(block)
    assert argv[:3] == ["python", "-m", "distopt.launch"], argv
    script = _file_block(argv[-1])
    (tmp_path / argv[-1]).write_text(script.code)
    res = _python(argv[1:], tmp_path, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    n = int(argv[argv.index("-n") + 1])
    assert sorted(re.findall(r"rank (\d+): w = ", res.stdout)) == [str(r) for r in range(n)], res.stdout
    assert len(set(re.findall(r"w = (\[[^]]*\])", res.stdout))) == 1, res.stdout  # identical everywhere


def check_distopt_launch_elastic(block: Block, tmp_path: Path) -> None:
    """The launcher's parser takes the page's elastic flags; the page's script then runs under the elastic
    launcher with 2 copies (a run id of its own) and finishes."""
    import uuid

    from distopt.launch.cli import _parser
    from distopt.launch.elastic_agent import elastic_config

    (argv,) = _commands(block)
    assert argv[:3] == ["python", "-m", "distopt.launch"], argv
    ns = _parser().parse_args(argv[3:])
    config = elastic_config(ns.nproc, ns.min_np, ns.max_np, ns.max_restarts, ns.run_id)
    assert config is not None and (config.min_np, config.max_np, config.run_id) == (2, 4, "job42"), config
    script = ns.command[-1]
    (tmp_path / script).write_text(_file_block(script).code)
    res = _python(["-m", "distopt.launch", "-n", "2", "--min-np", "1", "--run-id", f"docs-{uuid.uuid4().hex[:8]}",
                   script], tmp_path, timeout=120)
    assert res.returncode == 0 and "done in a world of 2" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def check_from_ddp(block: Block, tmp_path: Path) -> None:
    """The page's DDP script and its distopt port, each under ``torchrun --nproc-per-node 2``: the same losses
    and the same parameters, bit for bit."""
    from tests.support.torch_workers import free_port

    run = pytest.importorskip("torch.distributed.run")
    outputs = []
    for argv in _commands(block):
        assert argv[0] == "torchrun", argv
        ns = run.get_args_parser().parse_args(argv[1:])
        (tmp_path / ns.training_script).write_text(_file_block(ns.training_script).code)
        logs = tmp_path / f"logs-{ns.training_script}"  # each rank's stdout in a file of its own
        res = _python(["-m", "torch.distributed.run", *argv[1:-1], "--master-addr", "127.0.0.1", "--master-port",
                       str(free_port()), "--log-dir", str(logs), "--redirects", "1", ns.training_script], tmp_path,
                      timeout=180)
        # plain DDP's gloo teardown may abort a rank after the script finished (pytorch/pytorch issue 190489,
        # see distopt/comm/torch_exit.py): accepted for the DDP reference only, its printed results compared
        torn = ns.training_script == "ddp_train.py" and "terminate called without an active exception" in res.stderr
        assert res.returncode == 0 or torn, res.stdout[-3000:] + res.stderr[-3000:]
        printed = [f.read_text() for f in sorted(logs.rglob("stdout.log"))]
        lines = sorted(line for text in printed for line in text.splitlines()
                       if line.startswith(("epoch ", "checksum ")))
        assert len(lines) == 4, printed
        outputs.append(lines)
    assert outputs[0] == outputs[1], outputs


def check_torchrun(block: Block, tmp_path: Path) -> None:
    """torchrun's own parser takes the flags, and the script's parser its arguments (runs: tests/launch/test_world.py)."""
    run = pytest.importorskip("torch.distributed.run")
    for argv in _commands(block):
        assert argv[0] == "torchrun", argv
        ns = run.get_args_parser().parse_args(argv[1:])
        assert ns.training_script == "examples/cnn_mpi.py" and (ROOT / ns.training_script).is_file()
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)


def check_torchrun_elastic(block: Block, tmp_path: Path) -> None:
    """torchrun's parser takes the page's flags; the page's script then runs under an elastic torchrun on this
    machine (one agent of 2 workers, c10d rendezvous, the page's ``--rdzv-conf``) and finishes."""
    import uuid

    from tests.support.torch_workers import free_port

    run = pytest.importorskip("torch.distributed.run")
    (argv,) = _commands(block)
    assert argv[:2] == ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun"], argv
    ns = run.get_args_parser().parse_args(argv[2:])
    assert (ns.rdzv_backend, ns.nnodes, ns.rdzv_id) == ("c10d", "2:4", "job42"), ns
    (tmp_path / ns.training_script).write_text(_file_block(ns.training_script).code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
           f"docs-{uuid.uuid4().hex[:8]}", "--rdzv-conf", ns.rdzv_conf, "--max-restarts", "0", ns.training_script]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), capture_output=True,
                         text=True, timeout=150)
    assert res.returncode == 0 and "done in a world of 2" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def check_strategy_runs(block: Block, tmp_path: Path) -> None:
    """Each strategy command parses; the table below it lists the same settings."""
    args = _script_args(block, "examples/cnn_mpi.py")
    _check_cnn_args(args, tmp_path)
    options = [a[a.index("--dist-option") + 1] for a in args]
    after = "\n".join((DOCS / block.page).read_text().splitlines()[block.line:])
    results = after[after.index("\n|"):].split("\n\n")[0]   # the first table after the commands
    table = re.findall(r"^\| (plain|half|partialUpdate|sparseTopK|sparseThreshold) \|", results, flags=re.M)
    assert table == options, f"commands run {options}, the results table lists {table}"


def check_train_runs(block: Block, tmp_path: Path) -> None:  # noqa: ARG001
    """The benchmark commands parse with train.py's parser (every strategy known, extra flags
    cnn_mpi's); the PNG that plot_train.py writes is checked in and shown on the page."""
    pytest.importorskip("torch")
    runs = _script_args(block, "benchmarks/train.py")
    cnn_mpi, train = _script_module("cnn_mpi"), _script_module("train")
    for argv in runs:
        args, error = _parses(train.parse_args, argv)
        assert error is None, error
        assert set(args.strategies.split(",")) <= set(train.STRATEGIES), args.strategies
        _, error = _parses(cnn_mpi.parse_args, args.rest)
        assert error is None, error
    page = (DOCS / block.page).read_text()
    for argv in _script_args(block, "benchmarks/plot_train.py"):
        png = Path(argv[argv.index("--png") + 1])
        assert (ROOT / png).is_file(), f"{png} is not checked in"
        assert f"]({png.relative_to('docs')})" in page, f"the page does not show {png}"


def check_gpu_install(block: Block, tmp_path: Path) -> None:  # noqa: ARG001
    """The CUDA extras named are the project's (each CuPy with the NCCL wheel of its CUDA version)."""
    extras = _extras()
    named = {e.strip() for group in re.findall(r'\.\[([\w,\s-]+)\]', block.code) for e in group.split(",")}
    assert "cuda12" in named and named <= set(extras), named
    for cuda in ("cuda12", "cuda13"):
        assert any(r.startswith("cupy-") for r in extras[cuda]) and any("nccl" in r for r in extras[cuda])


def check_gpu_check(block: Block, tmp_path: Path) -> None:  # noqa: ARG001
    """The GPU check's commands parse with its own parser (its run: tests/test_benchmarks.py)."""
    for argv in _script_args(block, "benchmarks/gpu_check.py"):
        _, error = _parses(_script_module("gpu_check").parse_args, argv)
        assert error is None, error


def check_gpu_tests(block: Block, tmp_path: Path) -> None:
    """``pytest -m gpu`` with the suite's ``--cupy`` choices, and the GPU check's flags."""
    tests = [argv for argv in _commands(block) if argv[1:3] == ["-m", "pytest"]]
    assert tests and all(argv[3:5] == ["-m", "gpu"] for argv in tests)
    for argv in tests:
        if "--cupy" in argv:
            assert argv[argv.index("--cupy") + 1] in ("auto", "real", "standin")
    check_gpu_check(block, tmp_path)


def check_docs_build(block: Block, tmp_path: Path, site=None) -> None:
    """The packages named are what the build needs; ``mkdocs build --strict`` passes (the ``site`` fixture)."""
    install, build, test = _commands(block)
    named = {re.split(r"[\[=<>]", arg)[0] for arg in install[2:]}
    assert named == {"mkdocs", "mkdocs-material", "mkdocstrings"}, named
    assert build[:3] == ["mkdocs", "build", "--strict"] and test[-1] == "tests/test_docs.py"
    assert (site / "index.html").is_file()


def check_netsim_runs(block: Block, tmp_path: Path) -> None:  # noqa: ARG001
    """The simulated-link commands parse with benchmarks/netsim.py's own parser (runs: tests/test_netsim.py)."""
    runs = _script_args(block, "benchmarks/netsim.py")
    netsim = _script_module("netsim")
    for argv in runs:
        args, error = _parses(netsim.parse_args, argv)
        assert error is None, error
        if args.rest:
            _, error = _parses(_script_module("cnn_mpi").parse_args, args.rest)
            assert error is None, error


def check_mpich_tcp(block: Block, tmp_path: Path) -> None:
    """mpiexec over the hostfile of launch.md, UCX held to TCP on one interface; cnn_mpi's flags parse."""
    (argv,) = _commands(block)
    assert argv[0] == "mpiexec" and argv[argv.index("-f") + 1] == "hosts", argv
    genv = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}
    assert genv.get("UCX_TLS") == "tcp,self" and "UCX_NET_DEVICES" in genv, genv
    _check_cnn_args(_script_args(block, "examples/cnn_mpi.py"), tmp_path)


CHECKS = {
    "install": check_install,
    "first-cpu-run": check_first_cpu_run,
    "mpiexec-one-node": check_mpiexec_one_node,
    "mpich-hostfile": check_mpich_hostfile,
    "openmpi-hostfile": check_openmpi_hostfile,
    "srun": check_srun,
    "multiprocess-example": check_multiprocess_example,
    "distopt-launch": check_distopt_launch,
    "torchrun": check_torchrun,
    "from-ddp": check_from_ddp,
    "torchrun-nodes": check_torchrun,
    "torchrun-two-hosts": check_torchrun,
    "torchrun-elastic": check_torchrun_elastic,
    "distopt-launch-elastic": check_distopt_launch_elastic,
    "mpich-tcp": check_mpich_tcp,
    "netsim-runs": check_netsim_runs,
    "strategy-runs": check_strategy_runs,
    "train-runs": check_train_runs,
    "docs-build": check_docs_build,
    "gpu-install": check_gpu_install,
    "gpu-check": check_gpu_check,
    "gpu-tests": check_gpu_tests,
}
#: ``file=`` blocks that a command check reads.
FILES_USED = {"hosts", "hosts-openmpi", "job.sbatch", "launched.py", "elastic_mlp.py", "ddp_train.py",
              "distopt_train.py"}
#: The checks that start a job (mpiexec, the launcher, the site build); the others parse the commands
#: with the scripts' own parsers in this process (the ``unit`` tier).
JOB_CHECKS = {"first-cpu-run", "mpiexec-one-node", "mpich-hostfile", "distopt-launch", "docs-build",
              "torchrun-elastic", "distopt-launch-elastic", "from-ddp"}


def _check_marks(cmd_id: str) -> list[pytest.MarkDecorator]:
    if cmd_id not in JOB_CHECKS:
        return [pytest.mark.unit]
    if "cnn_smoke" in CHECKS[cmd_id].__code__.co_varnames:  # may wait for the job of every example run
        from tests.support.examples import JOB_TIMEOUT

        return [pytest.mark.job, pytest.mark.timeout(JOB_TIMEOUT + 60)]
    return [pytest.mark.job]


@pytest.mark.parametrize("cmd_id", [pytest.param(k, marks=_check_marks(k)) for k in sorted(CHECKS)])
def test_shell_block(cmd_id: str, tmp_path: Path, request):
    block = _cmd_block(cmd_id)
    check = CHECKS[cmd_id]
    for mark in getattr(check, "pytestmark", []):
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    kwargs = {name: request.getfixturevalue(name) for name in ("cnn_smoke", "site")
              if name in check.__code__.co_varnames[:check.__code__.co_argcount]}
    check(block, tmp_path, **kwargs)


# --------------------------------------------------- troubleshooting messages

def _string_pieces() -> list[str]:
    """The literal parts of every string in distopt's source.

    An f-string is split at its fields, except fields that name a string
    constant of the same module (``f"{TIMEOUT_ENV} must be ..."``), which
    are filled in.
    """
    pieces = []
    for path in (ROOT / "distopt").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                current = ""
                for v in node.values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        current += v.value
                    elif (isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)
                          and v.value.id in constants and v.conversion == -1 and v.format_spec is None):
                        current += constants[v.value.id]
                    else:
                        pieces.append(current)
                        current = ""
                pieces.append(current)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces.append(node.value)
    return pieces


def _found(fragment: str, pieces: list[str]) -> bool:
    """Whether ``fragment`` is in one literal, or spans up to three at field boundaries.

    A message can join literals of different expressions (``f"... {detail}"``
    with ``detail = "ranks that ..."``): then the fragment is the end of one
    literal, optionally a whole literal, and the start of another.
    """
    if any(fragment in p for p in pieces):
        return True
    whole = set(pieces)
    ends = [i for i in range(1, len(fragment)) if any(p.endswith(fragment[:i]) for p in pieces)]
    starts = {j for j in range(1, len(fragment)) if any(p.startswith(fragment[j:]) for p in pieces)}
    return any(i in starts or any(j > i and fragment[i:j] in whole for j in starts) for i in ends)


def _message_cells() -> list[tuple[str, str]]:
    """(row, message) for the code spans in the first column of troubleshooting.md's tables."""
    out = []
    for line in (DOCS / "troubleshooting.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        if "(from " in first:  # a message of the shell or of NCCL, not of distopt
            continue
        out.extend((first, span) for span in re.findall(r"`([^`]+)`", first))
    return out


@pytest.mark.unit
def test_troubleshooting_messages_are_distopts():
    """Every message on the page is built from string literals in distopt/ (``<...>`` marks a value)."""
    pieces = _string_pieces()
    import builtins

    from distopt import errors, launch
    missing = []
    for row, message in _message_cells():
        m = re.match(r"(\w+(?:Error|Exception)): ", message)
        if m:
            name = m.group(1)
            assert any(hasattr(m, name) for m in (errors, launch, builtins)), f"{row}: no exception class {name}"
            message = message[m.end():]
        elif re.fullmatch(r"\w+(?:Error|Exception)", message):
            continue
        elif re.fullmatch(r"distopt(\.\w+)+", message):  # a name: it must exist
            module, _, attr = message.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), f"{row}: no {message}"
            continue
        for fragment in re.split(r"<[^<>]*>", message):
            fragment = fragment.strip(" .;:")
            if len(fragment) >= 3 and not _found(fragment, pieces):
                missing.append(f"{fragment!r} (from {message!r})")
    assert not missing, "not found in distopt's string literals:\n" + "\n".join(missing)


# ------------------------------------------------------------ the site build

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers", "material")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"docs tools not installed ({', '.join(missing)}): pip install mkdocs mkdocs-material "
                    "'mkdocstrings[python]'")
    out = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    warnings = [line for line in res.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    return out


@pytest.mark.job
def test_mkdocs_build_strict(site: Path):
    assert (site / "index.html").is_file() and (site / "reference" / "opt" / "index.html").is_file()


#: The NCCL backend's modules, which need CuPy to import (their ``__all__`` is read from the source).
CUPY_MODULES = ("distopt.comm.nccl", "distopt.comm.nccl_shards", "distopt.comm.nccl_types")


def _public_modules() -> list[str]:
    """Every module of distopt/ that declares ``__all__`` (private ``_x`` modules and the NCCL backend's,
    which need CuPy to import, aside)."""
    out = []
    for path in sorted((ROOT / "distopt").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if any(p.startswith("_") for p in parts) or name in (*CUPY_MODULES, "distopt.launch.__main__"):
            continue
        if "__all__" in path.read_text():
            out.append(name)
    return out


REFERENCED_MODULES = _public_modules()


@pytest.mark.job
def test_reference_covers_public_names(site: Path):
    """Every name in the ``__all__`` of the public modules has an anchor in the API reference."""
    anchors = set()
    for page in (site / "reference").rglob("*.html"):
        anchors |= set(re.findall(r'id="(distopt[\w.]*)"', page.read_text(encoding="utf-8")))
    missing = []
    for module_name in REFERENCED_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            candidates = {f"{module_name}.{name}"}
            if hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
                candidates.add(f"{obj.__module__}.{obj.__qualname__}")
            if not candidates & anchors:
                missing.append(f"{module_name}.{name}")
    for module_name in CUPY_MODULES:  # not importable without CuPy
        tree = ast.parse((ROOT / Path(*module_name.split("."))).with_suffix(".py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                missing += [f"{module_name}.{n.value}" for n in node.value.elts
                            if f"{module_name}.{n.value}" not in anchors]
    assert not missing, f"public names missing from the API reference: {missing}"
