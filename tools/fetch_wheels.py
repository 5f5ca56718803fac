"""Fill .whl/ with the wheels a GPU machine lacks, pinned to requirements.txt, for tools/gpu_session.sh.

    python tools/fetch_wheels.py                    # on a CPU machine with the package index
    python tools/fetch_wheels.py --dry-run          # only print what the GPU image has and what would come
    python tools/fetch_wheels.py --device-packages "torch==2.11.0 transformers==5.17.0 ..."   # another image

A GPU machine with no package index (the H200 image this project is checked on ships torch,
transformers, peft and accelerate, but not diffusers) gets the missing packages as wheels carried
with the working tree. This compares requirements.txt with what the image holds (DEVICE_PACKAGES
below, or --device-packages), downloads with `pip download --no-deps` for the image's Python and
platform every pinned requirement the image lacks or holds at another version, then follows each
downloaded wheel's Requires-Dist (markers evaluated for that Python) and brings what the image lacks,
one version of each. torch is never brought: the image's CUDA build is the one to use. Packages the
GPU script does not need (NOT_ON_DEVICE) are skipped and listed. It prints what it found and what it
brings; gpu_session.sh installs .whl/*.whl into a private folder on the device before anything runs.
"""
from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The H200 image as read on 2026-11-17 (names) and in 2026-11 pip lists (versions, where seen); None = version
# unknown, taken as compatible. Python 3.12, x86-64.
DEVICE_PYTHON = "3.12"
DEVICE_PACKAGES = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "peft": None, "pillow": None,
    "safetensors": "0.8.0", "sentencepiece": "0.2.2", "tokenizers": "0.23.2", "torch": "2.11.0",
    "transformers": "5.17.0", "einops": None, "matplotlib": None, "imageio": None, "tqdm": None,
    "tensorboard": None, "psutil": None, "pytest": None, "pytest-timeout": None, "protobuf": None,
    "filelock": None, "regex": None, "requests": None, "httpx": None, "zipp": None, "packaging": None,
    "pyyaml": None, "typing-extensions": None, "fsspec": None, "jinja2": None, "networkx": None, "sympy": None,
    "certifi": None, "charset-normalizer": None, "idna": None, "urllib3": None, "anyio": None, "h11": None,
    "httpcore": None, "hf-xet": None, "click": None, "typer": None, "rich": None, "shellingham": None,
    "markdown-it-py": None, "mdurl": None, "pygments": None, "sniffio": None, "setuptools": None,
}
NEVER_BRING = {"torch"}  # the image's CUDA build
NOT_ON_DEVICE = {"wandb"}  # optional tracking: the GPU script never turns it on
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: str) -> dict[str, str | None]:
    """name -> pinned version (None when unpinned) of a requirements.txt."""
    out = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonical(name)] = version.strip() or None
    return out


def plan(requirements: dict[str, str | None], device: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(pip specs to bring, lines describing what the image already has or what is skipped)."""
    bring, notes = [], []
    for name, version in requirements.items():
        have = device.get(name, "absent") if name in device else "absent"
        if name in NEVER_BRING or name in NOT_ON_DEVICE:
            notes.append(f"{name}: image has {have}; not brought ({'its own CUDA build' if name in NEVER_BRING else 'not needed on the device'})")
        elif name in device and (version is None or device[name] in (None, version)):
            notes.append(f"{name}: image has {have or 'a version'}; kept")
        else:
            bring.append(f"{name}=={version}" if version else name)
            notes.append(f"{name}: image has {have}; bringing {version or 'the latest'}")
    return bring, notes


def requires(wheel: str, python: str) -> list[tuple[str, str]]:
    """(name, version specifier) a wheel needs on `python` (extras and markers that do not apply dropped)."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = email.parser.Parser().parsestr(z.read(meta).decode())
    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    names = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or Marker(str(req.marker)).evaluate(env):
            names.append((canonical(req.name), str(req.specifier)))
    return names


def satisfied(have: str | None, specifier: str) -> bool:
    """Whether the image's version (None: unknown, taken as compatible) meets a Requires-Dist specifier."""
    from packaging.specifiers import SpecifierSet

    return have is None or SpecifierSet(specifier).contains(have, prereleases=True)


def download(spec: str, dest: str, python: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", dest, "-q", spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    before = set(os.listdir(dest))
    subprocess.run(cmd, check=True)
    new = sorted(set(os.listdir(dest)) - before)
    name = canonical(re.split(r"[<>=!~;\s]", spec, maxsplit=1)[0])
    found = new or [f for f in os.listdir(dest) if canonical(f.split("-")[0]) == name]
    return os.path.join(dest, found[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=os.path.join(ROOT, ".whl"))
    parser.add_argument("--requirements", default=os.path.join(ROOT, "requirements.txt"))
    parser.add_argument("--device-packages", default=None,
                        help="the image's packages as 'name==version name ...' (default: the H200 image above)")
    parser.add_argument("--python", default=DEVICE_PYTHON)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    device = dict(DEVICE_PACKAGES)
    if args.device_packages:
        device = {canonical(s.partition("==")[0]): (s.partition("==")[2] or None) for s in args.device_packages.split()}
    bring, notes = plan(read_requirements(args.requirements), device)
    print(f"GPU image (Python {args.python}): what requirements.txt asks and what the image has")
    for line in notes:
        print("  " + line)
    if args.dry_run:
        print("would bring: " + " ".join(bring) + " (and what they need that the image lacks)")
        return 0
    os.makedirs(args.dest, exist_ok=True)
    queue, seen, brought = list(bring), set(), []
    while queue:
        spec = queue.pop(0)
        name = canonical(re.split(r"[<>=!~;\s]", spec, maxsplit=1)[0])
        if name in seen:
            continue
        seen.add(name)
        wheel = download(spec, args.dest, args.python)
        brought.append(os.path.basename(wheel))
        for need, specifier in requires(wheel, args.python):
            if need in seen or need in NEVER_BRING:
                continue
            if need not in device:
                queue.append(need + specifier)
            elif not satisfied(device[need], specifier):
                print(f"  {need}: image has {device[need]}, {os.path.basename(wheel)} needs {specifier}; bringing one")
                queue.append(need + specifier)
    total = sum(os.path.getsize(os.path.join(args.dest, w)) for w in brought)
    print(f"brought {len(brought)} wheels, {total / 2**20:.1f} MiB, into {args.dest}:")
    for w in brought:
        print("  " + w)
    print("carry it: run(command='bash tools/gpu_session.sh', carry=['.whl'])  (.whl/ is git-ignored)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
