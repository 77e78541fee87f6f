"""Count planned kernel launches, before and after fusion, for the zoo models — on the CPU, without
running a kernel.

    PYTHONPATH=. python bench/kernels.py --models resnet50,mobilenet_v3_large --batch 1 --precision fp16

For each model: the exported ONNX graph's node count (Constant nodes left out), its compute nodes
as the compile report defines them (`compute_nodes`: the steps of the unfused plan that launch a
kernel), the unfused plan's launches (`kernels.before`), the fused plan's launches
(`kernels.after`), the ratio after / compute nodes, the launches that run an anchor (a GEMM,
convolution or attention: never two in one kernel) and the ratio they alone make (`floor`: the
least `after` can be under that rule), the op steps left unfused by op type, and the fusion groups
by kind. It runs the front half of `opfuse.compile` (load, specialize, passes,
precision, fusion planning, lowering with code generation) and stops before profiling, tuning and
verification, which execute the plan.

The counts are those of `opfuse.compile` without tuning: on a GPU, tuning may move a conv or GEMM
group to its vendor variant (the library kernel, then its epilogue as one more kernel), one launch
more per group so moved. Verification may roll groups back; nothing is rolled back here.

Needs torch, onnx, onnxscript, transformers and torchvision (for the vision models); never the
service's packages (fastapi, sqlalchemy).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds opfuse/ and bench/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class KernelCount:
    model: str
    batch: int
    precision: str
    onnx_nodes: int  # the exported graph, Constant nodes left out
    compute_nodes: int  # as the report defines it
    before: int  # the unfused plan's launches
    after: int  # the fused plan's launches
    kernel_steps: int  # generated kernels (one launch each)
    distinct_kernels: int  # ... of which distinct for Triton's compile cache (repeated layers share)
    vendor_steps: int  # library anchors of vendor-variant conv/GEMM groups (one launch each)
    # Launches that run a GEMM, convolution or attention (a template with its epilogue, or the
    # library's kernel): never two in one kernel, so `after` cannot go below this.
    anchor_launches: int
    unfused_steps: int  # op steps outside every group that launch a kernel
    unfused_by_op: dict[str, int] = field(default_factory=dict)
    groups_by_kind: dict[str, int] = field(default_factory=dict)
    not_fused_reasons: dict[str, int] = field(default_factory=dict)
    passes_fired: dict[str, int] = field(default_factory=dict)
    patterns: dict[str, int] = field(default_factory=dict)  # launching steps by what they hold
    copies_before: int | None = None  # hidden view copies of the unfused plan (view_copies)
    copies_after: int | None = None  # ... and of the fused plan
    duplicate_group_ids: int = 0  # ids that more than one group carries (see step_groups)
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.after / self.compute_nodes if self.compute_nodes else float("nan")

    @property
    def floor(self) -> float:
        """The ratio if every launch but the anchors' were fused away."""
        return self.anchor_launches / self.compute_nodes if self.compute_nodes else float("nan")

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ratio"] = round(self.ratio, 4)
        d["floor"] = round(self.floor, 4)
        return d


@dataclass
class Planned:
    """What the front half of opfuse.compile produces."""

    graph: Any  # the optimized, fused-precision graph the fusion plan refers to
    fusion: Any
    base_plan: Any
    plan: Any
    passes: Any


def plan_model(
    model: Any,
    input_shapes: Mapping[str, Sequence[int]] | None,
    precision: str,
    disabled: Collection[str] = (),
) -> Planned:
    """The unfused and fused plans, built exactly as opfuse.compile builds them (compiler.py),
    minus everything that executes a plan (profiling, tuning, verification)."""
    from opfuse.frontend.load import load_and_specialize
    from opfuse.fusion.planner import FusionPlan, plan_fusion
    from opfuse.graph import graph_from_onnx
    from opfuse.lowering import build_plan
    from opfuse.passes.pipeline import optimize_onnx, run_passes
    from opfuse.passes.precision import apply_precision
    from opfuse.runtime.ops import SUPPORTED_OPS

    off = set(disabled)
    _original, specialized = load_and_specialize(model, input_shapes, SUPPORTED_OPS)
    optimized, _status = optimize_onnx(specialized)
    graph = graph_from_onnx(optimized)
    declared_inputs, declared_outputs = list(graph.inputs), list(graph.outputs)
    original_graph = copy.deepcopy(graph)
    passes = run_passes(graph, off)
    graph.disabled = off  # codegen's own switches, as compile sets them
    cast: dict[int, Any] = {}
    apply_precision(graph, precision, cast)
    apply_precision(original_graph, precision, cast)
    fusion = plan_fusion(graph, off)
    base_plan = build_plan(original_graph, FusionPlan([], []), precision, declared_inputs, declared_outputs)
    plan = build_plan(graph, fusion, precision, declared_inputs, declared_outputs)
    return Planned(graph, fusion, base_plan, plan, passes)


def alternative_faults(p: Planned, precision: str) -> dict[str, str]:
    """What tuning on the GPU generates beyond the plan, and cannot: the groups whose alternative
    form (the library's kernel with the epilogue's, or the group's split form, timed against the
    template) or, for an anchor with nothing to fuse, whose template fails to generate; each with
    its error, found as a compile finds them (pipeline.builder.faulty_groups). A compile keeps the
    template of the first and the library's kernel for the second; this finds the fault without a
    GPU."""
    from opfuse.fusion.planner import FusionPlan
    from opfuse.lowering import build_plan
    from opfuse.pipeline.builder import faulty_groups

    lone = FusionPlan(p.fusion.lone, [])
    faults = faulty_groups(
        [g.id for g in p.fusion.lone],
        lambda ids: build_plan(p.graph, lone, precision, p.plan.inputs, p.plan.outputs, enabled=ids),
    )
    return {
        **faults,
        **faulty_groups(_with_alternatives(p), lambda ids: alternatives_plan(p, precision, ids)),
    }


def _with_alternatives(p: Planned) -> list[str]:
    from opfuse.codegen.registry import has_alternative

    return [g.id for g in p.fusion.groups if g.variant == "template" and has_alternative(g)]


def alternatives_plan(p: Planned, precision: str, ids: Collection[str] | None = None) -> Any:
    """The plan of `p` with the groups `ids` (every group that has one, by default) in their
    alternative form (variant "vendor"): what a compile on the GPU runs for the groups whose
    alternative tuning measures faster."""
    from opfuse.lowering import build_plan

    ids = _with_alternatives(p) if ids is None else ids
    variants = {gid: "vendor" for gid in ids}
    return build_plan(p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants=variants)


def verify_alternatives(p: Planned, proto: Any, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """The plan with every group in its alternative form (`alternatives_plan`), verified against
    onnxruntime as a compile verifies its plan (verify.rollback.Verifier, fp32): the record as
    report["verification"] has it: `passed`, each output's relative L2 error, and `rolled_back`,
    the groups whose alternative fails on its own."""
    import numpy as np

    from opfuse.pipeline.builder import PlanBuilder
    from opfuse.verify.compare import DEFAULT_TOLERANCES
    from opfuse.verify.rollback import Verifier

    variants = {gid: "vendor" for gid in _with_alternatives(p)}
    builder = PlanBuilder(p.graph, list(p.fusion.groups), "fp32", p.plan.inputs, p.plan.outputs, variants)
    rng = np.random.default_rng(seed)
    verifier = Verifier(proto, p.plan.inputs, device, DEFAULT_TOLERANCES["fp32"], rng, p.base_plan)
    return verifier.verify_with_rollback(builder, builder.plan())[1]


def bias_adds(plan: Any) -> int:
    """The plan's per-op library convs with a bias: on the GPU each is two kernels (the library's
    conv, then torch's add of the bias), counted as one launch. A conv group's library form moves
    the bias into its epilogue's kernel (codegen.registry.bias_to_epilogue); a conv with nothing
    fused after it keeps the add."""
    return sum(
        1
        for s in plan.steps
        if s.kind == "op" and s.op_type in ("Conv", "opfuse.ConvNHWC") and len(s.inputs) > 2 and s.inputs[2]
    )


def softmax_chains(p: Planned, depth: int = 6) -> collections.Counter[str]:
    """The Softmaxes the fused plan does not run inside an attention group, by the ops between
    their score MatMul and them ("MatMul Add Max Softmax"): the nearest MatMul up the data path
    within `depth` ops (a constant input, a Where's condition, is not followed), or "no MatMul"
    where none is that near. What `match_attention` (opfuse/fusion/attention.py) does not walk."""
    from opfuse.ir.queries import UseDef

    use = UseDef(p.graph)
    fused = {n.id for g in p.fusion.groups if g.kind == "attention" for n in g.nodes}
    return collections.Counter(
        _score_chain(p.graph, use, n, depth)
        for n in p.graph.nodes
        if n.op_type == "Softmax" and n.id not in fused
    )


def _score_chain(graph: Any, use: Any, softmax: Any, depth: int) -> str:
    """Breadth first up `softmax`'s data inputs: the ops from the first MatMul met to it."""
    queue = collections.deque([(softmax, ["Softmax"])])
    seen = {softmax.id}
    while queue:
        node, path = queue.popleft()
        if len(path) > depth:
            break
        for x in node.inputs[1:] if node.op_type == "Where" else node.inputs:
            prod = use.producer(x) if x and x not in graph.constants else None
            if prod is None or prod.id in seen:
                continue
            if prod.op_type == "MatMul":
                return " ".join(["MatMul", *reversed(path)])
            seen.add(prod.id)
            queue.append((prod, [*path, prod.op_type]))
    return "no MatMul"


def view_copies(plan: Any) -> int | None:
    """Copies the plan makes at run time that no step counts: a generated kernel's input that is a
    non-contiguous view (the executor copies it with .contiguous() first), and a view op whose
    output cannot alias its input (Reshape of a non-contiguous tensor copies). Found by running the
    view ops on CPU tensors of the plan's shapes and allocating every other step's outputs empty;
    no op step or kernel is run, except op steps with integer or bool outputs (shape arithmetic,
    masks), which view ops may read. Strided inputs of per-op torch kernels are not counted (torch
    may copy inside). None where the walk fails."""
    import numpy as np
    import torch

    from opfuse.runtime.ops import VIEW_OPS, run_op
    from opfuse.runtime.tensors import torch_dtype

    def empty(name: str) -> torch.Tensor:
        spec = plan.values[name]
        return torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype))

    try:
        env: dict[str, torch.Tensor] = {k: torch.from_numpy(np.array(v)) for k, v in plan.constants.items()}
        for spec in plan.inputs:
            env[spec.name] = empty(spec.name)
        copies = 0
        with torch.no_grad():
            for s in plan.steps:
                if s.kind == "kernel":
                    copies += sum(1 for x in plan.kernels[s.kernel].inputs if not env[x].is_contiguous())
                    env.update((o, empty(o)) for o in s.outputs if o)
                    continue
                outs = [o for o in s.outputs if o]
                computed = s.op_type in VIEW_OPS or all(
                    not torch_dtype(plan.values[o].dtype).is_floating_point for o in outs
                )
                if not computed:
                    env.update((o, empty(o)) for o in outs)
                    continue
                args = [env[x] if x else None for x in s.inputs]
                values = run_op(s.op_type, args, s.attrs, num_outputs=len(s.outputs))
                for name, v in zip(s.outputs, values, strict=False):
                    if name:
                        env[name] = v
                if s.op_type in VIEW_OPS and s.op_type not in ("Shape", "Size", "Constant") and args:
                    base = args[0]
                    if base is not None and base.numel() > 1:
                        ptr = base.untyped_storage().data_ptr()
                        copies += sum(
                            1
                            for v in values
                            if isinstance(v, torch.Tensor)
                            and v.numel() > 1
                            and v.untyped_storage().data_ptr() != ptr
                        )
        return copies
    except Exception:
        return None


def jitted_function(source: str) -> tuple[int, str]:
    """What Triton's compile cache keys a generated kernel on: its jitted function's text and line."""
    lines = source.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("@triton.jit")), 0)
    end = next((i for i in range(start + 2, len(lines)) if lines[i].startswith("def ")), len(lines))
    return start, "\n".join(lines[start:end])


ANCHOR_KERNELS = ("gemm", "conv", "attention", "chain")


def anchor_launches(plan: Any) -> int:
    """Launching steps of `plan` that run an anchor: a GEMM, conv or attention kernel, or a
    library GEMM/convolution (alone or as a vendor variant's first step)."""
    from opfuse.ir.ops import CONV_OPS

    anchor_ops = ("MatMul", "Gemm", "ConvTranspose", *CONV_OPS)
    return sum(
        s.launches
        for s in plan.steps
        if (s.kind == "kernel" and plan.kernels[s.kernel].kind in ANCHOR_KERNELS)
        or (s.kind == "op" and s.op_type in anchor_ops)
    )


def count(name: str, batch: int, precision: str, onnx_nodes: int, p: Planned) -> KernelCount:
    groups = step_groups(p)
    unfused = [s for s in p.plan.steps if s.kind == "op" and not s.group and s.launches]
    vendor = [s for s in p.plan.steps if s.kind == "op" and s.group and s.launches]
    kinds: collections.Counter[str] = collections.Counter()
    for g in p.fusion.groups:
        kinds[f"{g.kind}:{g.variant}" if g.variant else g.kind] += 1
    reasons: collections.Counter[str] = collections.Counter(
        f"{nf.rule}: {nf.reason}" for nf in p.passes.not_fired + p.fusion.not_fused
    )
    return KernelCount(
        model=name,
        batch=batch,
        precision=precision,
        onnx_nodes=onnx_nodes,
        compute_nodes=sum(1 for s in p.base_plan.steps if s.launches),
        before=p.base_plan.launches,
        after=p.plan.launches,
        kernel_steps=sum(1 for s in p.plan.steps if s.kind == "kernel"),
        distinct_kernels=len({jitted_function(k.source) for k in p.plan.kernels.values()}),
        vendor_steps=len(vendor),
        anchor_launches=anchor_launches(p.plan),
        unfused_steps=len(unfused),
        unfused_by_op=dict(collections.Counter(s.op_type for s in unfused).most_common()),
        groups_by_kind=dict(sorted(kinds.items())),
        not_fused_reasons=dict(reasons.most_common()),
        passes_fired=dict(p.passes.fired),
        patterns=dict(
            collections.Counter(step_pattern(p, s, groups) for s in p.plan.steps if s.launches).most_common()
        ),
        copies_before=view_copies(p.base_plan),
        copies_after=view_copies(p.plan),
        duplicate_group_ids=sum(
            1 for v in collections.Counter(g.id for g in p.fusion.groups).values() if v > 1
        ),
    )


def step_groups(p: Planned) -> tuple[dict[str, Any], dict[str, Any]]:
    """The group behind each kernel step (by kernel id) and each vendor anchor step (by node id).

    Not by group id: group ids are not unique across kinds (a GEMM anchor group and a pointwise
    group can both be "g0"). build_plan names kernels k0, k1, ... in the order of fusion.groups."""
    from opfuse.passes.rules import node_label

    by_kernel = {f"k{i}": g for i, g in enumerate(p.fusion.groups)}
    for s in p.plan.steps:
        if s.kind == "kernel":
            g = by_kernel[s.kernel]
            labels = [node_label(n) for n in g.nodes]
            with_prologue = [node_label(n) for n in [*g.prologue, *g.nodes]]
            assert s.label in (", ".join(labels), ", ".join(with_prologue)) or g.variant == "vendor", (
                s.kernel,
                s.label,
            )
    by_anchor = {g.nodes[0].id: g for g in p.fusion.groups if g.kind in ("conv", "gemm")}
    return by_kernel, by_anchor


def step_tag(
    p: Planned, s: Any, groups: tuple[dict[str, Any], dict[str, Any]] | None = None
) -> tuple[str, str]:
    """(what kind of launch a step is, the op types it covers)."""
    by_kernel, by_anchor = groups or step_groups(p)
    if s.kind == "kernel":
        g = by_kernel[s.kernel]
        tag = f"{g.kind}{':' + g.variant if g.variant else ''}"
        if g.kind in ("conv", "gemm") and g.variant == "vendor":
            return tag + "-epilogue", "+".join(n.op_type for n in g.nodes[1:])
        return tag, "+".join(n.op_type for n in g.nodes)
    if s.group:
        return f"{by_anchor[s.node].kind}:vendor-anchor", s.op_type
    return "op", s.op_type


def step_pattern(p: Planned, s: Any, groups: tuple[dict[str, Any], dict[str, Any]] | None = None) -> str:
    tag, ops = step_tag(p, s, groups)
    return f"[{tag}] {ops}"


def describe_steps(p: Planned) -> list[str]:
    """One line per launching step of the fused plan, in order: what it is and what it holds."""
    groups = step_groups(p)
    lines = []
    for i, s in enumerate(p.plan.steps):
        if not s.launches:
            continue
        tag, ops = step_tag(p, s, groups)
        shape = (
            tuple(p.plan.values[s.outputs[0]].shape) if s.outputs and s.outputs[0] in p.plan.values else ()
        )
        lines.append(f"{i:4d} {tag:<22} {ops:<60} {shape}")
    return lines


def export_zoo(name: str, batch: int, path: str, keep_batchnorm: bool = False) -> dict[str, list[int]]:
    from bench.zoo import build, export_onnx

    zm = build(name, batch)
    export_onnx(zm, path, keep_batchnorm)
    return {k: list(v.shape) for k, v in zm.example.items()}


def measure(
    name: str,
    batch: int,
    precisions: list[str],
    disabled: Collection[str],
    dump_dir: str | None,
    keep_batchnorm: bool = False,
) -> list[KernelCount]:
    import onnx

    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{name}.onnx")
        shapes = export_zoo(name, batch, path, keep_batchnorm)
        proto = onnx.load(path)
        onnx_nodes = sum(1 for n in proto.graph.node if n.op_type != "Constant")
        for precision in precisions:
            t0 = time.perf_counter()
            p = plan_model(proto, shapes, precision, disabled)
            row = count(name, batch, precision, onnx_nodes, p)
            row.seconds = round(time.perf_counter() - t0, 2)
            rows.append(row)
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                stem = os.path.join(dump_dir, f"{name}-b{batch}-{precision}")
                with open(stem + ".steps.txt", "w") as f:
                    f.write("\n".join(describe_steps(p)) + "\n")
                with open(stem + ".json", "w") as f:
                    json.dump(
                        {
                            **row.to_json(),
                            "groups": [g.to_json() for g in p.fusion.groups],
                            "not_fused": [nf.to_json() for nf in p.passes.not_fired + p.fusion.not_fused],
                        },
                        f,
                        indent=1,
                        default=str,
                    )
    return rows


def print_row(r: KernelCount, top: int = 10, show_patterns: int = 0) -> None:
    print(
        f"{r.model:<20}{r.batch:>3} {r.precision:<5}{r.onnx_nodes:>7}{r.compute_nodes:>9}"
        f"{r.before:>8}{r.after:>7}{r.ratio:>7.2f}   kernels {r.kernel_steps} ({r.distinct_kernels} "
        f"distinct), anchor launches {r.anchor_launches} (floor {r.floor:.2f}), vendor anchors "
        f"{r.vendor_steps}, unfused ops {r.unfused_steps}; hidden view copies before/after "
        f"{r.copies_before}/{r.copies_after}"
    )
    ops = ", ".join(f"{k} {v}" for k, v in list(r.unfused_by_op.items())[:top]) or "none"
    print(f"    unfused op steps (top {top}): {ops}")
    print("    groups: " + (", ".join(f"{k} {v}" for k, v in r.groups_by_kind.items()) or "none"))
    if show_patterns:
        print("    launches by pattern:")
        for k, v in list(r.patterns.items())[:show_patterns]:
            print(f"      {v:4d}  {k}")
    if r.duplicate_group_ids:
        print(f"    note: {r.duplicate_group_ids} group ids are carried by more than one group")


HEADER = (
    f"{'model':<20}{'b':>3} {'prec':<5}{'onnx':>7}{'compute':>9}{'before':>8}{'after':>7}{'ratio':>7}"
    f"{'anchors':>8}{'floor':>7}{'copies b/a':>12}"
)


def main(argv: Sequence[str] | None = None) -> None:
    from bench.zoo import ZOO

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", default="fp16", help="one or more, comma-separated: fp16,fp32")
    ap.add_argument("--disable", default="", help="fusion/pass rules to disable, comma-separated")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--patterns", type=int, default=0, help="also print the N commonest launch patterns")
    ap.add_argument("--dump", default=None, help="folder for per-model step listings and JSON")
    ap.add_argument("--out", default=None, help="write all rows as JSON here")
    ap.add_argument(
        "--keep-batchnorm",
        action="store_true",
        help="export BatchNormalization as nodes of their own (the ONNX Model Zoo's form) instead of "
        "folded into the convolutions by the exporter",
    )
    args = ap.parse_args(argv)
    disabled = [x for x in args.disable.split(",") if x]
    precisions = args.precision.split(",")
    rows: list[KernelCount] = []
    print(HEADER, flush=True)
    for name in args.models.split(","):
        try:
            new = measure(name, args.batch, precisions, disabled, args.dump, args.keep_batchnorm)
        except Exception as exc:
            print(f"{name:<20}{args.batch:>3} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        for r in new:
            print_row(r, args.top, args.patterns)
        sys.stdout.flush()
        rows += new
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"disabled": disabled, "rows": [r.to_json() for r in rows]}, f, indent=1)
    print()
    print(HEADER)
    for r in rows:
        print(
            f"{r.model:<20}{r.batch:>3} {r.precision:<5}{r.onnx_nodes:>7}{r.compute_nodes:>9}"
            f"{r.before:>8}{r.after:>7}{r.ratio:>7.2f}{r.anchor_launches:>8}{r.floor:>7.2f}"
            f"{f'{r.copies_before}/{r.copies_after}':>12}"
        )


if __name__ == "__main__":
    main()
