"""The single-file ``.ninfer`` model artifact, and ``ninfer convert``.

Format (version 1): one safetensors file holding every weight tensor under its HF name, with the
checkpoint's text files in the safetensors header metadata:

    "ninfer.format": "1"
    "ninfer.file.config.json": <text>            (required)
    "ninfer.file.tokenizer.json": <text>         (required)
    "ninfer.file.tokenizer_config.json": <text>  (optional, carries the chat template)
    "ninfer.file.generation_config.json": <text> (optional)
    "ninfer.file.chat_template.jinja": <text>    (optional)

Because it is plain safetensors, any safetensors reader opens the weights. To serve one, the engine
lays the text files into a private directory next to a symlink to the artifact (named
``model.safetensors``), and loads that directory with the ordinary checkpoint loader.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from services.engine.errors import ModelLoadError

FORMAT_VERSION = "1"
TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja")
REQUIRED = ("config.json", "tokenizer.json")
_PREFIX = "ninfer.file."


def pack(src: Path, out: Path) -> Path:
    """Pack an HF checkpoint directory (single or sharded safetensors) into one ``.ninfer`` file."""
    from tqdm import tqdm

    from services.engine.model.loader import _tensor_files

    if not src.is_dir():
        raise ModelLoadError(str(src), "directory does not exist")
    metadata = {"ninfer.format": FORMAT_VERSION}
    for name in TEXT_FILES:
        path = src / name
        if path.is_file():
            metadata[_PREFIX + name] = path.read_text(encoding="utf-8")
        elif name in REQUIRED:
            raise ModelLoadError(str(src), f"{name} not found")
    json.loads(metadata[_PREFIX + "config.json"])  # fail early on a broken config
    files = _tensor_files(src)
    tensors = {}
    for name, file in tqdm(sorted(files.items()), desc="packing tensors", unit="tensor", disable=None):
        with safe_open(str(src / file), framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    return out


def materialize(artifact: Path, cache_dir: Path) -> Path:
    """A checkpoint directory view of ``artifact`` under ``cache_dir`` (re-used while the file is unchanged)."""
    if not artifact.is_file():
        raise ModelLoadError(str(artifact), "file does not exist")
    try:
        with safe_open(str(artifact), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as exc:
        raise ModelLoadError(str(artifact), f"not a .ninfer (safetensors) file: {exc}") from None
    if metadata.get("ninfer.format") != FORMAT_VERSION:
        raise ModelLoadError(str(artifact), f"unsupported .ninfer format {metadata.get('ninfer.format')!r}")
    stat = artifact.stat()
    key = hashlib.sha256(f"{artifact.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    view = cache_dir / f"{artifact.stem}-{key}"
    view.mkdir(parents=True, exist_ok=True)
    for name in TEXT_FILES:
        text = metadata.get(_PREFIX + name)
        if text is not None:
            (view / name).write_text(text, encoding="utf-8")
        elif name in REQUIRED:
            raise ModelLoadError(str(artifact), f"artifact lacks {name}")
    link = view / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(artifact.resolve())
    return view


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ninfer", description="NInfer model artifact tools")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="pack an HF checkpoint directory into one .ninfer file")
    convert.add_argument("src", type=Path, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    convert.add_argument("out", type=Path, help="output file, e.g. model.ninfer")
    args = parser.parse_args(argv)
    try:
        out = pack(args.src, args.out)
    except ModelLoadError as exc:
        print(f"ninfer convert: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
