"""Limits a job's child process runs under: its memory (an rlimit set at child start), the time
to read and check the model, and the model's size, node count, graph depth and tensor sizes,
checked before anything is compiled. Every refusal is a ModelError that says which limit and how
to get under it.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import onnx
from google.protobuf.message import DecodeError

from opfuse.errors import ModelError

GiB = 1024**3

# Bytes per element of the ONNX element types (unknown types count as 8: refusing too much is
# better than letting an absurd tensor through).
_ITEM_BYTES = {
    onnx.TensorProto.BOOL: 1,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.UINT16: 2,
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.UINT32: 4,
}


@dataclass(frozen=True)
class ModelLimits:
    """What one job's model may be. `max_tensor_bytes` None: the job's memory limit (or 64 GiB)."""

    max_model_bytes: int = 2 * GiB - 1  # protobuf's own ceiling for one message
    max_nodes: int = 50_000
    max_depth: int = 10_000  # the longest chain of dependent nodes
    max_subgraph_nesting: int = 8
    max_tensor_bytes: int | None = None
    load_timeout_s: float = 300.0

    def tensor_bytes_limit(self, memory_limit_bytes: int | None) -> int:
        if self.max_tensor_bytes is not None:
            return self.max_tensor_bytes
        return memory_limit_bytes or 64 * GiB


# A job's memory limit by default: at most this, and at most HOST_MEMORY_SHARE of the host's memory
# (or the container's cgroup limit) shared among the jobs that run on it at once.
MAX_DEFAULT_JOB_MEMORY_BYTES = 32 * GiB
HOST_MEMORY_SHARE = 0.75


def host_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The memory this host gives us: MemTotal, or the cgroup's limit if lower (a container); None
    when neither can be read."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                found.append(int(line.split()[1]) * 1024)  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    for name in ("memory.max", "memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = (cgroup_root / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 2**62:  # "max" or v1's huge number: no limit
            found.append(int(text))
    return min(found) if found else None


def default_job_memory_bytes(host_bytes: int | None = None, concurrent_jobs: int = 1) -> int:
    """min(32 GiB, 75% of the host's memory / the jobs run at once); 32 GiB if the host's memory is
    unknown. `host_bytes` None: read from the host."""
    total = host_memory_bytes() if host_bytes is None else host_bytes
    if total is None:
        return MAX_DEFAULT_JOB_MEMORY_BYTES
    share = int(total * HOST_MEMORY_SHARE / max(1, concurrent_jobs))
    return min(MAX_DEFAULT_JOB_MEMORY_BYTES, share)


class MemoryLimitError(Exception):
    """The child could not apply its memory limit (an rlimit above the hard limit, say)."""


def apply_memory_limit(limit_bytes: int, cuda: bool) -> str:
    """Cap this process's memory; returns the rlimit used, for logs.

    CPU: RLIMIT_AS, the whole address space. CUDA reserves huge ranges of address space it never
    touches (unified addressing), so under RLIMIT_AS it fails to start; there RLIMIT_DATA caps what
    the process can really write to (heap and private mappings), which is what runs out first.
    Past the limit an allocation fails: MemoryError in Python, a clear failure of the job.
    """
    which, name = (resource.RLIMIT_DATA, "RLIMIT_DATA") if cuda else (resource.RLIMIT_AS, "RLIMIT_AS")
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY and limit_bytes > hard:
        limit_bytes = hard  # an unprivileged process cannot raise its hard limit; the lower one holds
    try:
        resource.setrlimit(which, (limit_bytes, hard))
    except (ValueError, OSError) as exc:
        raise MemoryLimitError(f"cannot set {name} to {limit_bytes} bytes: {exc}") from None
    return name


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise ModelError if the block runs longer than `seconds` (SIGALRM; main thread only).

    Checked whenever Python code runs: one C call that never returns is left to the worker's
    wall-time limit, which kills the whole process.
    """

    def expired(_signum: int, _frame: FrameType | None) -> None:
        raise ModelError(
            f"{what} took longer than {seconds:g} s, this worker's limit; the model is too large or "
            "too complex to read in time: simplify it, or ask the operator to raise the limit"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def read_model_proto(path: Path, limits: ModelLimits) -> onnx.ModelProto:
    """Parse the file as an ONNX protobuf (no external data is ever loaded); ModelError if it is too
    large or does not parse."""
    size = path.stat().st_size
    if size > limits.max_model_bytes:
        raise ModelError(
            f"the model file is {size} bytes, more than this worker's limit of {limits.max_model_bytes}"
        )
    model = onnx.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(f"not an ONNX model: the bytes do not parse as an ONNX protobuf ({exc})") from None
    return model


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def count_nodes(graph: onnx.GraphProto, limits: ModelLimits) -> int:
    """Nodes in the graph and every subgraph (If/Loop/Scan bodies); iterative, nesting-limited."""
    total = 0
    stack: list[tuple[onnx.GraphProto, int]] = [(graph, 0)]
    while stack:
        current, nesting = stack.pop()
        if nesting > limits.max_subgraph_nesting:
            raise ModelError(
                f"the model nests subgraphs (If/Loop/Scan bodies) {nesting} deep, more than this "
                f"worker's limit of {limits.max_subgraph_nesting}"
            )
        total += len(current.node)
        if total > limits.max_nodes:
            break
        for node in current.node:
            stack.extend((sub, nesting + 1) for sub in _subgraphs(node))
    return total


def graph_depth(graph: onnx.GraphProto) -> int:
    """The longest chain of nodes where each consumes an output of the one before (iteratively,
    so a chain of any length cannot overflow a stack). ModelError if the graph has a cycle."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                producer[out] = i
    consumers: list[list[int]] = [[] for _ in graph.node]
    pending = [0] * len(graph.node)
    for i, node in enumerate(graph.node):
        parents = {producer[name] for name in node.input if name in producer}
        pending[i] = len(parents)
        for p in parents:
            consumers[p].append(i)
    depth = [1] * len(graph.node)
    ready = [i for i, n in enumerate(pending) if n == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for c in consumers[i]:
            depth[c] = max(depth[c], depth[i] + 1)
            pending[c] -= 1
            if pending[c] == 0:
                ready.append(c)
    if seen != len(graph.node):
        raise ModelError(
            f"the graph has a cycle: {len(graph.node) - seen} node(s) depend on their own outputs; "
            "an ONNX graph must be acyclic"
        )
    return max(depth, default=0)


def _dims(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _check_tensor(what: str, elem_type: int, shape: Sequence[int | None], limit: int) -> None:
    elements = 1
    for d in shape:
        if d is None:
            continue
        if d < 0:
            raise ModelError(f"{what} declares a negative dimension: shape {_dims(shape)}")
        elements *= d
    size = elements * _ITEM_BYTES.get(elem_type, 8)
    if size > limit:
        raise ModelError(
            f"{what} declares shape {_dims(shape)}, {size / GiB:.3g} GiB, more than this worker's "
            f"limit of {limit / GiB:.3g} GiB for one tensor; use smaller shapes"
        )


def _value_shape(vi: onnx.ValueInfoProto) -> list[int | None] | None:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]


def check_tensor_sizes(
    graph: onnx.GraphProto, input_shapes: Mapping[str, Sequence[int]], limit_bytes: int
) -> None:
    """Declared shapes (inputs as the job binds them, outputs, value_info, initializers) that no
    machine could hold are refused here, before a byte of them is allocated."""
    for name, dims in input_shapes.items():
        elem = next((vi.type.tensor_type.elem_type for vi in graph.input if vi.name == name), 1)
        _check_tensor(f"input {name!r} (as given in input_shapes)", elem, [int(d) for d in dims], limit_bytes)
    for kind, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for vi in values:
            if kind == "input" and vi.name in input_shapes:
                continue
            shape = _value_shape(vi)
            if shape is not None:
                _check_tensor(f"{kind} {vi.name!r}", vi.type.tensor_type.elem_type, shape, limit_bytes)
    for init in graph.initializer:
        _check_tensor(f"initializer {init.name!r}", init.data_type, list(init.dims), limit_bytes)


def check_model_limits(
    model: onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]],
    limits: ModelLimits,
    memory_limit_bytes: int | None,
) -> None:
    """Node count, graph depth and tensor sizes within this worker's limits, else ModelError."""
    nodes = count_nodes(model.graph, limits)
    if nodes > limits.max_nodes:
        raise ModelError(
            f"the model has more than {limits.max_nodes} nodes (this worker's limit); fuse or split it "
            "into smaller models, or ask the operator to raise --max-nodes"
        )
    depth = graph_depth(model.graph)
    if depth > limits.max_depth:
        raise ModelError(
            f"the model's graph is {depth} nodes deep (its longest chain of dependent nodes), more than "
            f"this worker's limit of {limits.max_depth}; ask the operator to raise --max-depth"
        )
    check_tensor_sizes(model.graph, input_shapes, limits.tensor_bytes_limit(memory_limit_bytes))
