"""Build the five FreeToken distributions as sdists and wheels into dist/ (``make wheels``).

Each distribution is built the way a release is: an sdist from a clean copy of its
folder (the files git tracks or would track, so no build/, egg-info or in-place .so
leaks in), then a wheel from that sdist with ``pip wheel --no-deps
--no-build-isolation``. A wheel built from the sdist proves the sdist holds everything
the native build needs (sources, headers, setup.py).

The builds run in this interpreter's environment (.venv from ``make setup``): its
setuptools and pybind11, and its freetoken-core, whose ``freetoken.get_include()``
gives the shared headers to freetoken-cpu-moe, freetoken-cuda and freetoken-rocm.
The native wheels must contain their compiled extension (nvcc and hipcc must be
found); a build without it fails here.

Reuse: a wheel is rebuilt only when its build key changes: the sdist's content, and
for the native packages also freetoken-core's headers, the compilers' versions, the
build tools' versions and the build variables (CC, CXXFLAGS, FREETOKEN_CUDA_ARCH, ...).
Keys live in build/wheels/ (git-ignored); build logs in build/wheels/logs/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NoReturn, Optional

ROOT = Path(__file__).resolve().parents[2]
CORE_INCLUDE = ROOT / "freetoken-core" / "src" / "freetoken" / "include"

#: Environment variables that change what a native build produces.
BUILD_VARS = (
    "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS",
    "CUDA_HOME", "CUDA_PATH", "FREETOKEN_CUDA_ARCH",
    "ROCM_PATH", "HIP_PATH", "FREETOKEN_ROCM_ARCH", "FREETOKEN_ROCM_EVENT_API",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Dist:
    name: str  # distribution name
    folder: str  # relative to ROOT ("." is the meta package)
    extension: Optional[str] = None  # the compiled module the wheel must hold, e.g. "freetoken_cuda/_C"
    compiler: Optional[str] = None  # "cxx" | "nvcc" | "hipcc"
    hint: str = ""  # what to do when the extension is missing


DISTS = (
    # Longest builds first: with several jobs they start first.
    Dist("freetoken-rocm", "freetoken-rocm", "freetoken_rocm/_C", "hipcc",
         "hipcc was not found: install it (make toolchain, as root) or set ROCM_PATH"),
    Dist("freetoken-cuda", "freetoken-cuda", "freetoken_cuda/_C", "nvcc",
         "nvcc was not found: set CUDA_HOME or put nvcc on PATH"),
    Dist("freetoken-cpu-moe", "freetoken-cpu-moe", "freetoken_cpu_moe/_core", "cxx",
         "the C++ extension was not built: see the build log"),
    Dist("freetoken-core", "freetoken-core"),
    Dist("freetoken", "."),
)  # fmt: skip


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


OUR_NAMES = {normalize(d.name) for d in DISTS}


def fail(msg: str) -> NoReturn:
    print(f"make wheels: error: {msg}", file=sys.stderr)
    sys.exit(1)


def check_build_env() -> None:
    """The build interpreter must hold the build tools and this checkout's freetoken-core."""
    for module in ("setuptools", "pybind11", "wheel"):
        try:
            __import__(module)
        except ImportError:
            fail(f"{sys.executable} cannot import {module}; run `make setup` first")
    try:
        import freetoken
    except ImportError:
        fail(f"{sys.executable} cannot import freetoken (freetoken-core); run `make setup` first")
    include = Path(freetoken.get_include()).resolve()
    if include != CORE_INCLUDE.resolve():
        fail(
            f"the build environment's freetoken-core takes its headers from {include}, not from this "
            f"checkout ({CORE_INCLUDE}); install this checkout's freetoken-core (`make setup`)"
        )


def source_files(folder: str) -> list[str]:
    """Files of ``folder`` that git tracks or would track (.gitignore honoured), relative to it."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", folder],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as exc:
        fail(f"cannot list the source files with git (a git checkout is needed): {exc}")
    files = []
    for raw in out.split(b"\0"):
        if not raw:
            continue
        path = raw.decode()
        rel = path if folder == "." else path[len(folder) + 1 :]
        if folder == "." and "/" in rel:
            continue  # the meta package is the top-level files alone; the folders are other packages
        if (ROOT / path).is_file():  # a tracked file deleted in the work tree is not shipped
            files.append(rel)
    return sorted(set(files))


def copy_sources(dist: Dist, dest: Path) -> None:
    src = ROOT / dist.folder
    for rel in source_files(dist.folder):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)


def run_logged(cmd: list[str], log: Path, cwd: Path, what: str) -> str:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}   (in {cwd})\n")
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=f, text=True)
        f.write(r.stdout)
    if r.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        fail(f"{what} failed (exit {r.returncode}); last lines of {log}:\n{tail}")
    return r.stdout


def sdist_digest(sdist: Path) -> str:
    """Hash of the sdist's member names and contents (not its timestamps)."""
    h = hashlib.sha256()
    with tarfile.open(sdist) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            h.update(m.name.encode() + b"\0")
            if m.isfile():
                data = tar.extractfile(m)
                assert data is not None
                h.update(hashlib.sha256(data.read()).digest())
    return h.hexdigest()


def tool_version(cmd: list[str], env: Optional[dict[str, str]] = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cmd[0]}: {exc}"
    return f"{cmd[0]}: {r.stdout.strip()} {r.stderr.strip()}"


def find_tool(root_vars: tuple[str, ...], exe: str) -> Optional[str]:
    for var in root_vars:
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / exe).exists():
            return str(Path(root) / "bin" / exe)
    return shutil.which(exe)


def native_fingerprint(compiler: str) -> dict[str, str]:
    fp = {
        "python": sys.version,
        "platform": sysconfig.get_platform(),
        "setuptools": importlib.metadata.version("setuptools"),
        "pybind11": importlib.metadata.version("pybind11"),
        "headers": hashlib.sha256(
            b"".join(
                str(p.relative_to(CORE_INCLUDE)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest()
                for p in sorted(CORE_INCLUDE.rglob("*"))
                if p.is_file()
            )
        ).hexdigest(),
    }
    fp.update({var: os.environ.get(var, "") for var in BUILD_VARS})
    if compiler == "cxx":
        cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
        fp["compiler"] = tool_version([cxx, "--version"])
    elif compiler == "nvcc":
        nvcc = find_tool(("CUDA_HOME", "CUDA_PATH"), "nvcc")
        fp["compiler"] = tool_version([nvcc, "--version"]) if nvcc else "absent"
    elif compiler == "hipcc":
        hipcc = find_tool(("ROCM_PATH", "HIP_PATH"), "hipcc")
        env = dict(os.environ, HIP_PLATFORM="amd")
        fp["compiler"] = tool_version([hipcc, "--version"], env) if hipcc else "absent"
    return fp


def wheel_has_extension(wheel: Path, extension: str) -> bool:
    pattern = re.compile(re.escape(extension) + r"(\.[^/]*)?\.so$")
    with zipfile.ZipFile(wheel) as z:
        return any(pattern.fullmatch(n) for n in z.namelist())


@dataclasses.dataclass
class Result:
    dist: Dist
    sdist: str
    wheel: str
    reused: bool
    seconds: float


def build_one(dist: Dist, dist_dir: Path, state_dir: Path) -> Result:
    t0 = time.monotonic()
    log = state_dir / "logs" / f"{dist.name}.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix=f"ft-wheel-{dist.name}-") as tmp:
        src = Path(tmp) / "src"
        out = Path(tmp) / "out"
        copy_sources(dist, src)
        if not (src / "pyproject.toml").is_file():
            fail(f"{dist.folder}/pyproject.toml is missing")
        hook = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
        stdout = run_logged([sys.executable, "-c", hook, str(out)], log, src, f"{dist.name}: sdist")
        sdist = out / stdout.strip().splitlines()[-1]
        key = {"sdist": sdist_digest(sdist)}
        if dist.compiler:
            key.update(native_fingerprint(dist.compiler))
        key_file = state_dir / f"{dist.name}.json"
        previous = json.loads(key_file.read_text()) if key_file.is_file() else {}
        old_wheel = dist_dir / previous.get("wheel", "-")
        shutil.copy2(sdist, dist_dir / sdist.name)
        if (
            previous.get("key") == key
            and old_wheel.is_file()
            and hashlib.sha256(old_wheel.read_bytes()).hexdigest() == previous.get("sha256")
        ):
            return Result(dist, sdist.name, old_wheel.name, True, time.monotonic() - t0)
        key_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out), str(sdist)]
        run_logged(cmd, log, Path(tmp), f"{dist.name}: wheel")
        wheels = sorted(out.glob("*.whl"))
        if len(wheels) != 1:
            fail(f"{dist.name}: expected one wheel from pip wheel, got {[w.name for w in wheels]}")
        wheel = wheels[0]
        if dist.extension and not wheel_has_extension(wheel, dist.extension):
            fail(f"{dist.name}: the wheel {wheel.name} has no compiled {dist.extension}: {dist.hint} (build log: {log})")
        shutil.copy2(wheel, dist_dir / wheel.name)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        key_file.write_text(json.dumps({"key": key, "wheel": wheel.name, "sha256": sha}, indent=1) + "\n")
        return Result(dist, sdist.name, wheel.name, False, time.monotonic() - t0)


def dist_name_of(filename: str) -> Optional[str]:
    if filename.endswith(".whl"):
        return normalize(filename.split("-")[0])
    if filename.endswith(".tar.gz"):
        return normalize(filename[: -len(".tar.gz")].rsplit("-", 1)[0])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default=str(ROOT / "dist"), help="output folder (default: dist/)")
    ap.add_argument("--jobs", type=int, default=2, help="distributions built at once (default 2)")
    ap.add_argument("--force", action="store_true", help="rebuild every wheel, reusing nothing")
    args = ap.parse_args()

    t0 = time.monotonic()
    check_build_env()
    dist_dir = Path(args.dist).resolve()
    dist_dir.mkdir(parents=True, exist_ok=True)
    state_dir = ROOT / "build" / "wheels"
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    if args.force:
        for d in DISTS:
            (state_dir / f"{d.name}.json").unlink(missing_ok=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda d: build_one(d, dist_dir, state_dir), DISTS))

    produced = {r.sdist for r in results} | {r.wheel for r in results}
    for f in sorted(dist_dir.iterdir()):
        if f.is_file() and dist_name_of(f.name) in OUR_NAMES and f.name not in produced:
            print(f"make wheels: removing {f.name} (not from this build)")
            f.unlink()

    for r in sorted(results, key=lambda r: r.dist.name):
        how = "reused (same build key)" if r.reused else "built"
        print(f"  {r.wheel:60s} {how:24s} {r.seconds:6.1f}s")
    print(f"make wheels: {len(results)} wheels and sdists in {dist_dir} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
