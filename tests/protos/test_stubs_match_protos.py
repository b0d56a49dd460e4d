"""The committed gRPC stubs are exactly what protos/generate.sh produces from the .proto files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    (work / "protos").mkdir(parents=True)
    for proto in (ROOT / "protos").glob("*.proto"):
        shutil.copy(proto, work / "protos" / proto.name)
    shutil.copy(ROOT / "protos" / "generate.sh", work / "protos" / "generate.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", "protos/generate.sh"], cwd=work, env=env, check=True, capture_output=True
    )

    generated = sorted(p.name for p in (work / "protos").iterdir() if "_pb2" in p.name)
    committed = sorted(p.name for p in (ROOT / "protos").iterdir() if "_pb2" in p.name)
    assert generated == committed, "stub files differ: run protos/generate.sh and commit"
    drifted = [
        name
        for name in generated
        if (work / "protos" / name).read_bytes() != (ROOT / "protos" / name).read_bytes()
    ]
    assert not drifted, (
        f"stubs out of date with the .proto files: {drifted}; run protos/generate.sh"
    )


def test_every_proto_has_stubs() -> None:
    for proto in (ROOT / "protos").glob("*.proto"):
        assert (ROOT / "protos" / f"{proto.stem}_pb2.py").exists(), proto.name
        assert (ROOT / "protos" / f"{proto.stem}_pb2_grpc.py").exists(), proto.name
