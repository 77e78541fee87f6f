"""Global loads of a generated kernel compiled for the H200 (sm_90), PTX only, without a GPU:

    python -m tests.ptx KERNEL.py '{"BLOCK_M": 64, ...}'   # prints {"ld.global.v4.b32": n, ...}

Run in a process of its own, without TRITON_INTERPRET: the interpreter the CPU suite runs
replaces parts of triton.language that the compiler needs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path


def sm90_loads(source: str, workdir: Path, config: dict[str, object]) -> Counter[str]:
    """The loads (PTX instruction names, counted) of `source`'s kernel at launch `config`."""
    path = workdir / "kernel_under_test.py"
    path.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.ptx", str(path), json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return Counter(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path, config = sys.argv[1], json.loads(sys.argv[2])
    spec = importlib.util.spec_from_file_location("kernel_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = next(v for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction))
    params = [p.name for p in fn.params]
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    signature = {p: ("constexpr" if p in constexprs else "*fp16") for p in params}
    values = {p: {**module.CONFIG, **config}[p] for p in constexprs}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p not in constexprs}
    src = ASTSource(fn, signature, constexprs=values, attrs=attrs)
    options = {"num_warps": int(config.get("num_warps", 4)), "num_stages": int(config.get("num_stages", 1))}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    print(json.dumps(Counter(re.findall(r"ld\.global[\w.]*", ptx))))


if __name__ == "__main__":
    main()
