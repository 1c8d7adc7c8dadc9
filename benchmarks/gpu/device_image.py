"""An emulated device image for the GPU suite's CPU rehearsal (``gpu_suite.sh --rehearsal``).

    python -m benchmarks.gpu.device_image VENV PACKAGE...     # VENV: made by python -m venv --without-pip

The device machine's Python has a fixed set of packages (its image) and nothing else: no
deepspeed, pydantic, hjson, wandb or datasets, no package index. The rehearsal runs the suite in a
virtual environment that sees, of the packages installed here, only those the image lists (plus
what their versions here need: a package here may be newer than the image's), so that any import
of a package the device lacks fails here as it would there, unless the wheel kit installed it.

Why an import hook and not a folder of links: the packages must keep their real paths. torch
builds its C++ extensions (DeepSpeed's CPU communication op) into a cache keyed by its include
path; torch seen through a link has another path and rebuilds the op (about 100 s here) into the
cache the test suite shares. So the environment adds this machine's site-packages whole, and a
path finder in front of Python's own hides the rest: a hidden top-level module is not found
(``import`` raises ModuleNotFoundError, ``importlib.util.find_spec`` returns None) and a hidden
distribution has no metadata (``importlib.metadata.version`` raises PackageNotFoundError), except
where the kit's folder (``$GPU_SUITE_SITE``, on PYTHONPATH) provides it. No library does this:
venv's ``--system-site-packages`` shows everything.

The kit's DeepSpeed lies in another folder than this machine's, so its CPU shared-memory op
(which DeepSpeed's CUDA accelerator does not have) would be compiled again, about 100 s, at the
first process group: the hook reports that op incompatible, and DeepSpeed then uses
torch.distributed alone, as it does on the GPU.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

# What the device lacks, which the project uses: hidden even when an image package here needs it.
ABSENT = {"deepspeed", "wandb", "datasets", "hjson", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "megatron-core", "dill", "multiprocess"}

HOOK = '''"""Written by benchmarks/gpu/device_image.py: hides what the device image does not hold."""
import importlib.abc, importlib.machinery, importlib.metadata, os, re, site, sys

REAL = {real!r}
KEEP = set({keep!r})
HIDDEN = set({hidden!r})
_norm = lambda n: re.sub(r"[-_.]+", "-", n or "").lower()


class DeviceImageFinder(importlib.machinery.PathFinder):
    """Python's path finder, except that hidden top-level modules and distributions are looked
    up only outside this machine's site-packages (in the kit's folder)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if path is None and fullname in HIDDEN:
            path = [p for p in sys.path if os.path.realpath(p) != REAL]
        return super().find_spec(fullname, path, target)

    @classmethod
    def find_distributions(cls, context=importlib.metadata.DistributionFinder.Context()):
        for dist in super().find_distributions(context):
            where = os.path.realpath(str(dist.locate_file("")))
            if where != REAL or _norm(dist.metadata["Name"]) in KEEP:
                yield dist


class _NoCpuShmOp(importlib.abc.MetaPathFinder):
    """DeepSpeed's CPU accelerator compiles its shared-memory op at the first process group;
    the GPU's CUDA accelerator has no such op. Here it is reported incompatible, so DeepSpeed
    uses torch.distributed alone, as on the GPU, and nothing is compiled."""

    NAME = "deepspeed.ops.op_builder.cpu.comm"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        spec = DeviceImageFinder.find_spec(fullname, path, target)
        if spec is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.ShareMemCommBuilder.is_compatible = lambda self, verbose=False: False
            spec.loader.exec_module = exec_module
        return spec


site.addsitedir(REAL)
sys.meta_path[:] = [DeviceImageFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.meta_path.insert(0, _NoCpuShmOp())
sys.path_importer_cache.clear()
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _top_level(dist: md.Distribution) -> set[str]:
    """The importable top-level names a distribution installs (packages, modules, extensions)."""
    names = set()
    for f in dist.files or []:
        top = f.parts[0]
        if top.startswith("..") or top.endswith((".dist-info", ".egg-info", ".pth", ".libs", ".data")):
            continue
        if len(f.parts) == 1:
            if not top.endswith((".py", ".so", ".pyd")):
                continue
            top = top.split(".")[0]
        names.add(top)
    return names - {"__pycache__", "bin", "share", "include"}


def build(venv: Path, image: set[str]) -> str:
    """Write the hook into ``venv``; returns one line saying what it holds."""
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    real = str(Path(md.distribution("torch").locate_file("")).resolve())
    dists = {}
    for d in md.distributions():
        if str(Path(d.locate_file("")).resolve()) == real:
            dists.setdefault(_norm(d.metadata["Name"]), d)
    keep, todo = set(), [n for n in dists if n in image]
    while todo:                    # the image's packages here, with what their versions here need
        n = todo.pop()
        if n in keep or n in ABSENT or n not in dists:
            continue
        keep.add(n)
        for req in dists[n].requires or []:
            if "extra ==" not in req:
                todo.append(_norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]))
    shown = set().union(*(_top_level(dists[n]) for n in keep))
    hidden = set().union(*(_top_level(d) for n, d in dists.items() if n not in keep)) - shown
    Path(purelib, "_device_image_hook.py").write_text(
        HOOK.format(real=real, keep=sorted(keep), hidden=sorted(hidden)))
    Path(purelib, "_device_image.pth").write_text("import _device_image_hook\n")
    extra = sorted(keep - image)
    return (f"emulated image: {len(keep)} of the {len(dists)} distributions here ({len(keep) - len(extra)} "
            f"in the device image's list, {', '.join(extra) or 'none'} needed by them), "
            f"{len(hidden)} top-level modules hidden")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not Path(argv[0], "bin", "python").exists():
        print("error: device_image.py: usage: device_image.py VENV PACKAGE... (VENV made by python -m venv)",
              file=sys.stderr)
        return 2
    print(build(Path(argv[0]), {_norm(n) for n in argv[1:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
