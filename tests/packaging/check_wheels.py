"""Install the wheels in dist/ into fresh venvs and run them (``make wheel-check``).

What a user gets from ``pip install``, without this checkout: four fresh venvs, our
packages installed only from the wheels (``--no-index --find-links dist
--only-binary :all:``, so the unrelated ``freetoken`` on PyPI can never be picked), and
every command run from an empty folder with no source tree on ``sys.path``:

- ``freetoken`` (CPU), ``freetoken[cuda]``, ``freetoken[rocm]``: the expected
  distributions and ``freetoken.backends`` entry points are installed, the native
  extensions import, ``freetoken doctor`` selects ``cpu`` and shows the GPU plugin as
  loaded (``unavailable`` without a GPU, never a load or version error), and
  ``freetoken generate`` runs the built-in demo model;
- ``freetoken-core`` alone: the core, engine and server import without
  freetoken_cpu_moe, its wheel ships the shared headers, ``freetoken doctor`` works,
  and ``freetoken generate`` fails with an error that names freetoken-cpu-moe and how
  to install it.

Third-party dependencies (torch pinned as in requirements-dev.txt, the rest from the
wheels' own metadata) are installed once with ``pip install --target`` into a folder
that every venv sees through a ``.pth`` file; our packages are never installed there
(checked). That folder is kept in build/wheel-check/ and reused while the requirement
set is the same. The venvs share one ``FREETOKEN_CACHE``, so the demo model is built
once. Run with the interpreter of .venv (``make wheel-check`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import NoReturn

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
OURS = ("freetoken", "freetoken-core", "freetoken-cpu-moe", "freetoken-cuda", "freetoken-rocm")
INSTALL_HINT = "pip install"
GENERATE = ["generate", "--prompt", "hi", "--max-tokens", "4", "--temperature", "0", "--json"]
COMMAND_TIMEOUT_S = 600


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    requirement: str  # what the user installs, without the version
    dists: frozenset[str]  # our distributions that must end up installed, and no others
    backends: frozenset[str]  # freetoken.backends entry points that must be registered
    modules: tuple[str, ...]  # must import from the venv
    core_only: bool = False


VARIANTS = (
    Variant("cpu", "freetoken", frozenset(OURS[:3]), frozenset({"cpu"}),
            ("freetoken", "freetoken_cpu_moe", "freetoken_cpu_moe._core", "freetoken_cpu_moe.backend")),
    Variant("cuda", "freetoken[cuda]", frozenset(OURS[:4]), frozenset({"cpu", "cuda"}),
            ("freetoken", "freetoken_cpu_moe", "freetoken_cpu_moe._core", "freetoken_cuda", "freetoken_cuda._C")),
    Variant("rocm", "freetoken[rocm]", frozenset(OURS[:3] + OURS[4:]), frozenset({"cpu", "rocm"}),
            ("freetoken", "freetoken_cpu_moe", "freetoken_cpu_moe._core", "freetoken_rocm", "freetoken_rocm._C")),
    Variant("core-only", "freetoken-core", frozenset({"freetoken-core"}), frozenset(), ("freetoken",), core_only=True),
)  # fmt: skip

#: Run inside each venv: where our distributions, modules and entry points come from.
PROBE = r"""
import importlib, importlib.metadata as md, json, os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
ours = set(json.loads(sys.argv[1]))
out = {"prefix": sys.prefix, "sys_path": sys.path, "dists": {}, "modules": {}, "errors": {}}
for d in md.distributions():
    name = norm(d.metadata["Name"])
    if name in ours:
        out["dists"].setdefault(name, []).append(str(d.locate_file("")))
out["backends"] = sorted(ep.name for ep in md.entry_points(group="freetoken.backends"))
for m in json.loads(sys.argv[2]):
    try:
        out["modules"][m] = importlib.import_module(m).__file__
    except Exception as exc:
        out["errors"][m] = f"{type(exc).__name__}: {exc}"
import freetoken
inc = freetoken.get_include()
out["include"] = sorted(os.path.relpath(os.path.join(d, f), inc) for d, _, fs in os.walk(inc) for f in fs)
print(json.dumps(out))
"""

CORE_IMPORTS = (
    "import freetoken, freetoken.engine.engine, freetoken.server.app; import sys; "
    "assert 'freetoken_cpu_moe' not in sys.modules, 'importing the core pulled in freetoken_cpu_moe'"
)


class Check:
    """Collects failures; every step prints what it did and how long it took."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def fail(self, where: str, msg: str) -> None:
        self.failures.append(f"[{where}] {msg}")
        print(f"  FAIL [{where}] {msg}", flush=True)

    def expect(self, ok: bool, where: str, msg: str) -> bool:
        if not ok:
            self.fail(where, msg)
        return ok


def die(msg: str) -> NoReturn:
    print(f"wheel-check: error: {msg}", file=sys.stderr)
    sys.exit(1)


def find_wheels(dist: Path) -> dict[str, Path]:
    found: dict[str, list[Path]] = {}
    for w in dist.glob("*.whl"):
        found.setdefault(normalize(w.name.split("-")[0]), []).append(w)
    wheels = {}
    for name in OURS:
        ws = found.get(name, [])
        if len(ws) != 1:
            die(f"expected one wheel of {name} in {dist}, found {[w.name for w in ws]}; run `make wheels`")
        wheels[name] = ws[0]
    return wheels


def wheel_metadata(wheel: Path) -> tuple[str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    return msg["Version"], msg.get_all("Requires-Dist") or []


def torch_pin() -> str:
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if re.match(r"torch\s*==", line):
            return line
    die("requirements-dev.txt pins no torch (a line torch==VERSION)")


def third_party_requirements(wheels: dict[str, Path]) -> list[str]:
    """torch pinned, then every requirement of our wheels that is not one of ours."""
    reqs = {torch_pin()}
    for wheel in wheels.values():
        for spec in wheel_metadata(wheel)[1]:
            req = Requirement(spec)
            if normalize(req.name) in OURS:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement; our extras only add our own packages
            reqs.add(str(req))
    return sorted(reqs)


def third_party_dir(reqs: list[str], state: Path) -> tuple[Path, bool]:
    key = hashlib.sha256(json.dumps([sys.version, sysconfig.get_platform(), reqs]).encode()).hexdigest()[:16]
    target = state / f"thirdparty-{key}"
    if (target / "COMPLETE").is_file():
        return target, True
    state.mkdir(parents=True, exist_ok=True)
    for old in state.glob("thirdparty-*"):
        shutil.rmtree(old)
    partial = state / f"partial-{key}"
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(partial), *reqs]
    print(f"  $ {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        die(f"installing the third-party dependencies failed (exit {r.returncode}):{tail(r.stdout + r.stderr, 40)}")
    (partial / "COMPLETE").write_text("\n".join(reqs) + "\n")
    partial.rename(target)
    return target, False


def ours_in(folder: Path) -> list[str]:
    """Our packages or distributions found in a folder (must be none in the shared one)."""
    hits = []
    for p in folder.iterdir():
        base = p.name.split("-")[0] if p.name.endswith((".dist-info", ".egg-info")) else p.name
        if normalize(base) in OURS or p.name.startswith(("freetoken_", "freetoken.")) or p.name == "freetoken":
            hits.append(p.name)
    return sorted(hits)


def clean_env(venv: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FREETOKEN_", "VIRTUAL_ENV", "PIP_"))}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        PYTHONNOUSERSITE="1",
        FREETOKEN_CACHE=str(cache),
    )
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(cmd, 124, exc.stdout or "", f"timed out after {COMMAND_TIMEOUT_S}s")


def tail(text: str, n: int = 15) -> str:
    lines = text.strip().splitlines()[-n:]
    return "\n      " + "\n      ".join(lines) if lines else " (no output)"


def check_variant(v: Variant, version: str, dist: Path, shared: Path, work: Path, cache: Path, chk: Check) -> None:
    where = v.name
    venv = work / f"venv-{v.name}"
    cwd = work / "run"
    cwd.mkdir(exist_ok=True)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if not chk.expect(r.returncode == 0, where, f"python -m venv failed:{tail(r.stderr)}"):
        return
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, check=True).stdout.strip()
    )  # fmt: skip
    (site / "freetoken_check_thirdparty.pth").write_text(f"import site; site.addsitedir({str(shared)!r})\n")
    env = clean_env(venv, cache)

    # Our wheels only: no index, binaries only (dist/ also holds the sdists).
    install = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
               "--find-links", str(dist), "--only-binary", ":all:", f"{v.requirement}=={version}"]  # fmt: skip
    r = run(install, env, cwd)
    if not chk.expect(r.returncode == 0, where, f"pip install {v.requirement}=={version} failed:{tail(r.stdout + r.stderr)}"):
        return
    r = run([sys.executable, "-m", "pip", "--python", str(py), "check"], env, cwd)
    chk.expect(r.returncode == 0, where, f"pip check found broken requirements:{tail(r.stdout + r.stderr)}")
    print(f"  [{where}] venv + pip install {v.requirement}=={version}: {time.monotonic() - t0:.1f}s", flush=True)

    # Where everything comes from.
    r = run([str(py), "-c", PROBE, json.dumps(list(OURS)), json.dumps(list(v.modules))], env, cwd)
    if not chk.expect(r.returncode == 0, where, f"the import probe failed:{tail(r.stdout + r.stderr)}"):
        return
    probe = json.loads(r.stdout.strip().splitlines()[-1])
    prefix = str(venv)
    chk.expect(set(probe["dists"]) == v.dists, where,
               f"installed distributions of ours are {sorted(probe['dists'])}, expected {sorted(v.dists)}")  # fmt: skip
    for name, locations in probe["dists"].items():
        chk.expect(len(locations) == 1 and locations[0].startswith(prefix), where,
                   f"{name} is installed at {locations}, expected once inside {prefix}")  # fmt: skip
    chk.expect(set(probe["backends"]) == v.backends, where,
               f"freetoken.backends entry points are {probe['backends']}, expected {sorted(v.backends)}")  # fmt: skip
    for m, err in probe["errors"].items():
        chk.fail(where, f"import {m} failed: {err}")
    for m, path in probe["modules"].items():
        chk.expect(bool(path) and path.startswith(prefix), where, f"{m} was imported from {path}, not from {prefix}")
    leaks = [p for p in probe["sys_path"] if p and p != str(shared) and (p == str(ROOT) or p.startswith(str(ROOT) + os.sep))]
    chk.expect(not leaks, where, f"the source tree is on sys.path: {leaks}")
    src_include = ROOT / "freetoken-core" / "src" / "freetoken" / "include"
    expected_headers = sorted(str(p.relative_to(src_include)) for p in src_include.rglob("*") if p.is_file())
    missing = sorted(set(expected_headers) - set(probe["include"]))
    chk.expect(not missing, where, f"freetoken.get_include() of the installed core lacks {missing}")

    if v.core_only:
        r = run([str(py), "-c", CORE_IMPORTS], env, cwd)
        chk.expect(r.returncode == 0, where, f"core imports without freetoken_cpu_moe failed:{tail(r.stdout + r.stderr)}")

    # doctor: the human report, then the JSON one for the assertions.
    freetoken = str(venv / "bin" / "freetoken")
    r = run([freetoken, "doctor"], env, cwd)
    chk.expect(r.returncode == 0, where, f"freetoken doctor exited {r.returncode}:{tail(r.stdout + r.stderr)}")
    r = run([freetoken, "doctor", "--json"], env, cwd)
    chk.expect(r.returncode == 0, where, f"freetoken doctor --json exited {r.returncode}:{tail(r.stderr)}")
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError as exc:
        chk.fail(where, f"freetoken doctor --json printed no JSON ({exc}):{tail(r.stdout + r.stderr)}")
    else:
        check_doctor(v, version, report, chk)

    # generate on the built-in demo model.
    t1 = time.monotonic()
    r = run([freetoken, *GENERATE], env, cwd)
    if v.core_only:
        text = r.stdout + r.stderr
        chk.expect(r.returncode != 0, where, "freetoken generate succeeded without freetoken-cpu-moe")
        chk.expect("freetoken-cpu-moe" in text and INSTALL_HINT in text, where,
                   f"freetoken generate's error does not name freetoken-cpu-moe and `{INSTALL_HINT} ...`:{tail(text)}")  # fmt: skip
        chk.expect("Traceback" not in text, where, f"freetoken generate ended in a traceback, not an error message:{tail(text)}")
    elif chk.expect(r.returncode == 0, where, f"freetoken generate exited {r.returncode}:{tail(r.stdout + r.stderr)}"):
        try:
            out = json.loads(r.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError) as exc:
            chk.fail(where, f"freetoken generate --json printed no JSON ({exc}):{tail(r.stdout)}")
        else:
            n = out.get("completion_tokens")
            chk.expect(isinstance(n, int) and 1 <= n <= 4 and len(out.get("token_ids", [])) == n, where,
                       f"freetoken generate returned {out}")  # fmt: skip
    print(f"  [{where}] checks done: {time.monotonic() - t0:.1f}s (generate {time.monotonic() - t1:.1f}s)", flush=True)


def check_doctor(v: Variant, version: str, report: dict, chk: Check) -> None:
    where = f"{v.name}: doctor"
    packages = report.get("freetoken", {}).get("packages", {})
    wrong = {k: val for k, val in packages.items() if val is not None and val != version}
    chk.expect(not wrong, where, f"package versions differ from {version}: {wrong}")
    plugins = {p.get("name"): p for p in report.get("plugins", [])}
    chk.expect(set(plugins) == set(v.backends), where, f"plugins {sorted(plugins)}, expected {sorted(v.backends)}")
    if v.core_only:
        return
    sel = report.get("selection", {})
    chk.expect(sel.get("backend") == "cpu" and not sel.get("error"), where, f"selected {sel}, expected cpu")
    for name, p in plugins.items():
        ok = {"available"} if name == "cpu" else {"available", "unavailable"}
        chk.expect(p.get("status") in ok, where,
                   f"plugin {name} has status {p.get('status')!r} (expected {sorted(ok)}): {p.get('error')}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default=str(ROOT / "dist"), help="folder with the wheels (default: dist/)")
    ap.add_argument("--only", nargs="+", choices=[v.name for v in VARIANTS], help="check only these variants")
    ap.add_argument("--keep", action="store_true", help="keep the venvs (their folder is printed)")
    args = ap.parse_args()

    t0 = time.monotonic()
    dist = Path(args.dist).resolve()
    wheels = find_wheels(dist)
    versions = {name: wheel_metadata(w)[0] for name, w in wheels.items()}
    if len(set(versions.values())) != 1:
        die(f"the wheels in {dist} have different versions: {versions}; run `make wheels`")
    version = versions["freetoken"]
    print(f"wheel-check: {', '.join(w.name for w in wheels.values())}", flush=True)

    reqs = third_party_requirements(wheels)
    shared, reused = third_party_dir(reqs, ROOT / "build" / "wheel-check")
    t_deps = time.monotonic() - t0
    print(f"  third-party dependencies ({'reused' if reused else 'installed'}) in {shared}: {t_deps:.1f}s", flush=True)
    leaked = ours_in(shared)
    if leaked:
        die(f"the shared third-party folder {shared} holds FreeToken packages: {leaked}")

    chk = Check()
    work = Path(tempfile.mkdtemp(prefix="freetoken-wheel-check-"))
    cache = work / "cache"
    try:
        for v in VARIANTS:
            if not args.only or v.name in args.only:
                check_variant(v, version, dist, shared, work, cache, chk)
    finally:
        if args.keep or chk.failures:
            print(f"wheel-check: venvs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - t0
    if chk.failures:
        print(f"wheel-check: FAILED ({len(chk.failures)} problems, {total:.1f}s):", file=sys.stderr)
        for f in chk.failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print(f"wheel-check: all variants passed in {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
