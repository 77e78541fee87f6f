"""The benchmark tools keep working: bench/micro.py's smoke mode and bench/run.py's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the GPU runs the real benchmarks")


def test_micro_smoke_runs_each_case_as_one_verified_kernel() -> None:
    from bench import micro

    for row in micro.bandwidth("cpu", small=True):
        assert row["kernels"] == 1 and row["verified"] is True and row["ms"] > 0
    for row in micro.gemm("cpu", small=True, budget=0):
        assert row["verified"] is True and row["opfuse_ms"] > 0


def test_run_prints_one_table_from_several_result_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from bench import run

    peers = {"torch_compile_cudagraph": {"ms": 1.0}, "torch_compile": {"ms": 2.0, "compile_s": 9.0}}
    files = []
    cases = (("resnet50", 0.5, True), ("bert-base", 2.0, True), ("vit", 9.0, False), ("mobilenet", 7.0, True))
    for i, (model, ms, verified) in enumerate(cases):
        row = {
            "model": model,
            "batch": 1,
            "precision": "fp16",
            "opfuse_ms": ms,
            "onnx_eager_ms": 5.0,
            "verified": verified,
            "rel_l2": 0.5,
            "peers": peers,
            "vacuous": model == "mobilenet",
            "opfuse_compile_s": 41.0,
            "opfuse_warm_compile_s": 6.5 if i == 0 else None,
        }
        path = tmp_path / f"gpu{i}.json"
        path.write_text(json.dumps({"meta": {"gpu": "x"}, "rows": [row]}))
        files.append(str(path))
    sys_argv = sys.argv
    sys.argv = ["bench/run.py", "--print", *files]
    try:
        run.main()
    finally:
        sys.argv = sys_argv
    out = capsys.readouterr().out
    assert "resnet50" in out and "bert-base" in out and "UNVERIFIED" in out and "VACUOUS" in out
    assert "warm s" in out and "41.0    6.5" in out
    assert (
        "geometric mean opfuse / (torch.compile + CUDA graph): 1.00" in out
    )  # sqrt(0.5 * 2.0): the unverified and vacuous rows are out


def test_rows_are_dealt_to_the_gpus_once_each_and_balanced() -> None:
    from bench import run

    todo = [
        (m, b, p)
        for m in ("resnet50", "bert-base", "gpt2", "vit_b_16", "mobilenet_v3_large")
        for b in (1, 32)
        for p in ("fp16", "fp32")
    ]
    for n in (1, 2, 3):
        shards = run.shard_rows(todo, n)
        assert len(shards) == n
        assert sorted(r for s in shards for r in s) == sorted(todo)
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 2


def test_source_digest_names_the_code() -> None:
    from bench import run

    digest = run.source_digest()
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert run.source_digest() == digest
