"""Reading a bundle without trusting it: every kernel is rendered again from its spec.

A bundle is a zip anyone can edit; its `kernels/<id>.py` would run on the loading machine. So the
reader renders each kernel from the spec plan.json carries (opfuse.codegen.spec) with the
installed opfuse, compares the result byte for byte with the shipped file (which stays, for people
to read), checks that plan.json's kernel records and steps say what the spec implies, and hands on
only the source it rendered. `opfuse.load` reads bundles through `open_bundle`; the API checks a
worker's upload with it before storing it (DESIGN.md §4). No torch or triton here: the API
imports this module.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.bundle_format import BUNDLE_FORMAT, BUNDLE_VERSION, MAX_MEMBER_BYTES
from opfuse.codegen.source import fixed_header
from opfuse.codegen.spec import SpecError, render_spec
from opfuse.errors import BundleError
from opfuse.ir.graph import TensorSpec

PLAN_VERSION = 1  # opfuse.runtime.plan.PLAN_VERSION (tests/unit/test_bundle_check.py: the same)
_KERNEL_ID = re.compile(r"k[0-9]{1,6}")
_CONFIG_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_STEP_KINDS = ("op", "kernel")


@dataclass
class CheckedBundle:
    """A bundle's parts once checked: `sources` are the kernels as this opfuse rendered them."""

    manifest: dict[str, Any]
    plan: dict[str, Any]  # plan.json
    constants: dict[str, np.ndarray]  # model.onnx's initializers
    sources: dict[str, str]  # kernel id -> the source rendered from its spec
    report: dict[str, Any]


def altered(kid: str) -> str:
    return (
        f"kernel {kid}'s source is not what this opfuse generates from its spec: the bundle was "
        "altered or made by another opfuse version; recompile"
    )


def open_bundle(path: str | os.PathLike[str], limit: int | None = None) -> CheckedBundle:
    """Read and check the bundle at `path`; BundleError saying what is wrong otherwise. `limit`:
    the most bytes its members may unpack to together (the API's OPFUSE_MAX_ARTIFACT_BYTES)."""
    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise BundleError(f"cannot open the bundle: {exc}") from None
    with z:
        unpacked = sum(i.file_size for i in z.infolist())
        if limit is not None and unpacked > limit:
            raise BundleError(f"the bundle unpacks to {unpacked} bytes, over the limit of {limit}")
        manifest = _json(z, "manifest.json")
        if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
            raise BundleError("not an opfuse bundle (manifest.format is not 'opfuse-bundle')")
        if manifest.get("version") != BUNDLE_VERSION:
            raise BundleError(
                f"bundle format version {str(manifest.get('version'))[:20]} is not supported by this "
                f"opfuse (it reads version {BUNDLE_VERSION}); recompile the model with this opfuse"
            )
        plan = _json(z, "plan.json")
        if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
            raise BundleError("plan.json is not a plan of a version this opfuse reads")
        model = onnx.ModelProto()
        try:
            model.ParseFromString(_read(z, "model.onnx"))
        except Exception:  # protobuf's DecodeError and kin
            raise BundleError("the bundle's model.onnx is not an ONNX model") from None
        constants = model_constants(model)
        files = {n: _read(z, n) for n in z.namelist() if n.startswith("kernels/") and not n.endswith("/")}
        sources = check_kernels(plan, files, constants)
        report = _json(z, "report.json")
        if not isinstance(report, dict):
            raise BundleError("the bundle's report.json is not a JSON object")
    return CheckedBundle(manifest, plan, constants, sources, report)


def model_constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The fused model's initializers as arrays (bfloat16 ones as float32, as the runtime keeps
    them). Data stored outside the file is refused: it would be read from paths the bundle names."""
    constants: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data:
            raise BundleError(f"constant {t.name[:60]!r} of the bundle's model.onnx is stored outside it")
        try:
            arr = numpy_helper.to_array(t)
        except Exception:
            raise BundleError(f"constant {t.name[:60]!r} of the bundle's model.onnx is damaged") from None
        constants[t.name] = arr.astype(np.float32) if t.data_type == onnx.TensorProto.BFLOAT16 else arr
    return constants


def check_kernels(
    plan: dict[str, Any], files: Mapping[str, bytes], constants: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """Each kernel of plan.json rendered from its spec and compared with the shipped
    `kernels/<id>.py` (`files`: the bundle's members under kernels/); its record and the steps
    launching it checked against what the rendering says. Returns id -> rendered source."""
    try:
        values = {str(d["name"]): TensorSpec.from_json(d) for d in plan["values"]}
        records = list(plan["kernels"])
        steps = list(plan["steps"])
    except (KeyError, TypeError, ValueError):
        raise BundleError("plan.json lacks its values, kernels or steps") from None
    _check_shapes(plan, values, constants)
    sources: dict[str, str] = {}
    made: dict[str, tuple[str, list[str], list[str], str]] = {}  # id -> kind, inputs, outputs, group
    for k in records:
        kid = k.get("id") if isinstance(k, dict) else None
        if not isinstance(kid, str) or not _KERNEL_ID.fullmatch(kid) or kid in sources:
            raise BundleError(f"plan.json names a kernel {str(kid)[:40]!r} opfuse does not generate")
        try:
            src = render_spec(k.get("spec"), values, constants)
        except SpecError as exc:
            raise BundleError(f"kernel {kid} cannot be rendered from the bundle: {exc}; recompile") from None
        source = fixed_header(src.source)
        shipped = files.get(f"kernels/{kid}.py")
        if shipped is None:
            raise BundleError(f"the bundle has no kernels/{kid}.py; it is damaged or not an opfuse bundle")
        if shipped != source.encode():
            raise BundleError(altered(kid))
        group = k["spec"]["part"]["v"]["id"]
        expected = {
            "id": src.id,
            "kind": src.kind,
            "group": group,
            "inputs": src.inputs,
            "outputs": src.outputs,
            "file": f"kernels/{kid}.py",
        }
        wrong = sorted(f for f, v in expected.items() if k.get(f) != v)
        if wrong:
            raise BundleError(
                f"plan.json's kernel {kid} says {', '.join(wrong)} other than its spec implies: the "
                "bundle was altered or made by another opfuse version; recompile"
            )
        _check_config(kid, k.get("config"))
        sources[kid] = source
        made[kid] = (src.kind, src.inputs, src.outputs, group)
    extra = sorted(set(files) - {f"kernels/{kid}.py" for kid in sources})
    if extra:
        raise BundleError(
            f"the bundle holds {extra[0][:60]!r}, which no kernel of its plan is; it was altered"
        )
    _check_steps(steps, made)
    return sources


def _check_shapes(
    plan: dict[str, Any], values: Mapping[str, TensorSpec], constants: Mapping[str, np.ndarray]
) -> None:
    """The buffers kernels are rendered for are the ones the runtime fills: a graph input or
    output, or a constant, has the shape plan.json's `values` gives it (kernels index by those)."""
    try:
        ends = [TensorSpec.from_json(d) for d in [*plan["inputs"], *plan["outputs"]]]
    except (KeyError, TypeError, ValueError):
        raise BundleError("plan.json lacks its inputs or outputs") from None
    shapes = {t.name: tuple(t.shape) for t in ends}
    shapes.update({name: tuple(arr.shape) for name, arr in constants.items()})
    for name, shape in shapes.items():
        if name in values and tuple(values[name].shape) != shape:
            raise BundleError(
                f"plan.json gives {name[:60]!r} the shape {list(values[name].shape)}, but the bundle "
                f"holds it as {list(shape)}: the bundle was altered; recompile"
            )


def _check_config(kid: str, config: Any) -> None:
    """A launch config is block sizes and flags: identifiers to integers or booleans."""
    if not isinstance(config, dict) or not all(
        isinstance(key, str) and _CONFIG_KEY.fullmatch(key) and isinstance(v, int | bool)
        for key, v in config.items()
    ):
        raise BundleError(f"plan.json's kernel {kid} has a launch config that is not block sizes and flags")


def _check_steps(steps: list[Any], made: Mapping[str, tuple[str, list[str], list[str], str]]) -> None:
    """Kernel steps launch a rendered kernel on the buffers it was rendered for; op steps name
    an op (the runtime finds its torch implementation in its registry, or refuses it)."""
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or s.get("kind") not in _STEP_KINDS:
            raise BundleError(f"plan.json's step {i} is neither an op nor a kernel")
        if s["kind"] == "kernel":
            kid = s.get("kernel")
            if not isinstance(kid, str) or kid not in made:
                raise BundleError(
                    f"plan.json's step {i} launches kernel {str(kid)[:40]!r}, which it does not hold"
                )
            _, inputs, outputs, group = made[kid]
            if s.get("inputs") != inputs or s.get("outputs") != outputs or s.get("group") != group:
                raise BundleError(
                    f"plan.json's step {i} launches kernel {kid} on other buffers than its spec "
                    "implies: the bundle was altered; recompile"
                )
        else:
            op = s.get("op_type")
            if not isinstance(op, str) or not re.fullmatch(
                r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)?", op
            ):
                raise BundleError(f"plan.json's step {i} names an op {str(op)[:40]!r} that is no op name")


def _read(z: zipfile.ZipFile, name: str) -> bytes:
    try:
        info = z.getinfo(name)
    except KeyError:
        raise BundleError(f"the bundle has no {name}; it is damaged or not an opfuse bundle") from None
    if info.file_size > MAX_MEMBER_BYTES:
        raise BundleError(f"{name} in the bundle unpacks to {info.file_size} bytes, over the limit")
    try:
        return z.read(info)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise BundleError(f"{name} in the bundle cannot be read: {exc}") from None


def _json(z: zipfile.ZipFile, name: str) -> Any:
    try:
        return json.loads(_read(z, name))
    except (ValueError, RecursionError):
        raise BundleError(f"the bundle's {name} is not JSON") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m opfuse.bundle_check BUNDLE [--limit BYTES]`: check a bundle in a process of its
    own (the API does, so that it imports no more of opfuse than docs/design.md's layering lets it).
    Prints one JSON line, {"ok": true} or {"ok": false, "problem": "..."}; exit status 0 either way."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m opfuse.bundle_check")
    parser.add_argument("bundle")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        open_bundle(args.bundle, limit=args.limit)
    except BundleError as exc:
        print(json.dumps({"ok": False, "problem": str(exc)}))
    else:
        print(json.dumps({"ok": True}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
